"""One-line notices on stderr from the main process: which path a run took, and why a fallback happened."""

from __future__ import annotations

import sys

from . import distributed as dist
from .shown_text import terminal_safe


def notice(line: str) -> None:
    """`line` on stderr, once per run (rank 0 under torchrun)."""
    if dist.is_main_process():
        print(f"infosieve: {terminal_safe(line)}", file=sys.stderr, flush=True)


def error_line(err: BaseException) -> str:
    """An error in one line: its type and the first line of its message (at most 300 characters)."""
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first}"
