"""Text that comes from data (file names, class names, cluster names) made harmless where it is shown: on a
terminal, its control characters escaped (an escape sequence in a file name would otherwise act on the terminal); in
a CSV cell, a leading `=`, `+`, `-`, `@`, tab or carriage return quoted with `'` (a spreadsheet would otherwise run
the cell as a formula)."""

from __future__ import annotations

import re

# C0 controls, DEL and C1 controls (0x9b starts an escape sequence on many terminals too)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def terminal_safe(text: str) -> str:
    """`text` with every control character written as its escape (`\\x1b`, `\\n`), so it stays one visible line."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def csv_safe(value):
    """A CSV cell that no spreadsheet reads as a formula: a string starting like one gets a leading `'`."""
    return f"'{value}" if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value
