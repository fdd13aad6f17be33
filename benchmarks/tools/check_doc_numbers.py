"""Check that every performance number in README.md and docs/*.md appears in a committed result file.

    python -m benchmarks.tools.check_doc_numbers          # lists the unmatched numbers; exit status 1 if there are any
    python -m benchmarks.tools.check_doc_numbers --all    # every number: where it was found, or why it is exempt

What counts as a performance number (prose and tables; fenced code blocks and inline `code` are skipped):
- a time: µs, ms, s, seconds, min, minutes ("1 min 18 s" is one time, 78 s);
- a throughput: images/s (img/s), views/s, GB/s, TFLOP/s (TFLOPS);
- a memory size: MB, GB (10^6, 10^9 bytes), MiB, GiB (2^20, 2^30 bytes);
- a speed or memory ratio: a number with × right after it ("6.7×"; not "6k × 768", "8×8" or "×10"), or "2x faster";
- a percentage whose line, table headers or parent bullets say MFU or utilisation.
A bare number takes a unit only from the next number when joined to it by "/", "–" or "→" ("0.58 / 1.29 / 0.78 ms",
"78–81 min", "43.1 → 39.7 ms"), or in a table from its column header, else its row header, when that header names
one unit with no number before it ("ms/step", "peak GiB", "× published fp32"; never after "load average").

Committed results are the files in benchmarks/results/. A JSON leaf takes its unit from its key, read as `_`-separated
tokens: `s`, `seconds`, `ms`, `minutes`; `mb`, `gb`, `mib`, `gib`, `bytes`; `tflops`; `X_per_s`, `X_per_cpu_s`,
`X_per_wall_s` (X/s, for images, views and gb); `speedup`, `vs`, `over`, `ratio` (a ratio); `mfu`, `util` (a fraction,
written as a percentage). A key with no unit takes its parent key's (`phase_seconds: {features: ...}`), or the unit
that the `unit` string of its object starts with (for that object's numbers and its lists' records).
`UNIT_OVERRIDES` corrects keys whose producer stores another unit than the key says. The `settings` and `targets`
subtrees are inputs and goals, not results, and are skipped. JSON strings and .txt/.log files give every number
written with a unit ("144 s", "41.23s", "about 512.2 GiB"), percentages excepted.

A number appears when a result value of the same quantity, converted to the same base unit, rounds to it at the
precision written: |value - written| <= half a unit of its last digit ("43.1 ms" matches 43.06 ms and 0.04306 s;
"0.59 s" matches 0.5912 s; "9.5 min" matches 570 s). An integer's trailing zeros are digits, unless the number is
marked approximate (~, ≈, about, around, roughly): "~10,460 s" matches 10,455.9 s, "1,570 s" does not match
1,568.8 s. MB and MiB, GB and GiB are different units: converted, never equated.

Where it is looked up: in the result files its line names (`benchmarks/results/x.json`, a bare `x.json` that exists
there, or `nvidia-h200-{tests,demo}.txt`); if the line names none, in those its block names (the paragraph, list or
table up to a blank line, fenced commands included); if that names none, in those its section and the sections
above it name; if they name none either, in every result file. Only those files: a number quoted from another file
must name it. `--all` shows the value each number matched.

Ratios are checked more weakly: a written ratio appears when a stored ratio rounds to it, or when the quotient of two
values of one quantity (time, memory, a throughput) within ONE of the files above does. With many values in a file a
quotient may match by chance: a matched ratio shows that the file can produce it, not that the doc divided the right
two numbers. The same holds, less often, for numbers written with one or two digits.

Exempt, and listed as such by `--all`, because they state a bound or a goal, not a measurement: a number directly
preceded by ≤, ≥, < or > ("target ≤ 10 s", "≥ 8× faster"), by "target", "targets", "target of" or "target:" ("a
target of 5×"), or by "datasheet" or "datasheet:" ("datasheet: 989 TFLOP/s"), or directly followed by the word
"target" ("the 20× target"). Nothing else is exempt: a number without a result file must be removed, or reworded so
that it no longer states a measurement, or its result file committed.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"

# written unit -> (quantity, factor to the quantity's base unit: s, bytes, items/s, FLOP/s, bytes/s, 1, fraction)
UNITS = {
    "µs": ("time", 1e-6),
    "μs": ("time", 1e-6),
    "ms": ("time", 1e-3),
    "s": ("time", 1.0),
    "second": ("time", 1.0),
    "seconds": ("time", 1.0),
    "min": ("time", 60.0),
    "minute": ("time", 60.0),
    "minutes": ("time", 60.0),
    "MB": ("memory", 1e6),
    "GB": ("memory", 1e9),
    "MiB": ("memory", 2.0**20),
    "GiB": ("memory", 2.0**30),
    "images/s": ("images/s", 1.0),
    "img/s": ("images/s", 1.0),
    "views/s": ("views/s", 1.0),
    "GB/s": ("bandwidth", 1e9),
    "TFLOP/s": ("FLOP/s", 1e12),
    "TFLOPS": ("FLOP/s", 1e12),
    "×": ("ratio", 1.0),
    "%": ("utilisation", 0.01),
}
# units that only result keys name (`peak_bytes_beyond_features`); "4 bytes per entry" in a doc is no measurement
RESULT_ONLY_UNITS = {"bytes": ("memory", 1.0)}
# quantities whose quotient within one file may stand for a written ratio
DIVISIBLE = ("time", "memory", "images/s", "views/s", "bandwidth", "FLOP/s")

# JSON key token -> written unit
KEY_UNITS = {
    "s": "s",
    "seconds": "s",
    "ms": "ms",
    "minutes": "min",
    "bytes": "bytes",
    "mb": "MB",
    "gb": "GB",
    "mib": "MiB",
    "gib": "GiB",
    "tflops": "TFLOP/s",
}
RATIO_TOKENS = {"speedup", "vs", "over", "ratio"}
FRACTION_TOKENS = {"mfu", "util"}
SKIPPED_KEYS = {"settings", "targets"}
# (result file, key token) -> the unit its producer really stores
UNIT_OVERRIDES = {
    # process_memory.py divides /proc's kB (KiB) by 1024 and synthetic_shards.py bytes by 2**20, and both name the
    # result *_mb: these are MiB, in bench_stream's and bench_decode's result files
    ("stream_cpu.json", "mb"): "MiB",
    ("decode_cpu.json", "mb"): "MiB",
}

_UNIT_ALTERNATION = "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True))
_SPACED_UNITS = "|".join(re.escape(u) for u in sorted(set(UNITS) - {"×"}, key=len, reverse=True))
# not part of a word, a decimal or a product ("×10", "× 10")
NUMBER = r"(?<![\w.×])(?<!× )(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
# a number and its unit, or a bare number; × right after the number and with no operand after it is a ratio
# ("6.7×", "6.7× faster"; "8×8" is a dimension); "6k", "2B" are not numbers
QUANTITY_RE = re.compile(
    rf"(?P<num>{NUMBER})(?:(?P<times>×)(?!\s*\d)|[ \u00a0\u2009]?(?P<unit>{_SPACED_UNITS})(?![A-Za-z0-9])"
    rf"|[ \u00a0]?(?P<x>x)(?=\s+(?:faster|slower)\b)|(?![\w×]))"
)
COMPOUND_TIME_RE = re.compile(rf"(?P<min>{NUMBER}) min (?P<s>{NUMBER}) s(?![A-Za-z0-9])")
JOINER_RE = re.compile(r"\s*(?:/|–|→)\s*$")
EXEMPT_RE = re.compile(r"(?:[≤≥<>]|\btargets?(?:\s+of|:)?|\bdatasheet:?)\s*[~≈]?\s*$", re.IGNORECASE)
EXEMPT_AFTER_RE = re.compile(r"\s*targets?\b", re.IGNORECASE)
APPROXIMATE_RE = re.compile(r"(?:[~≈]|\babout|\baround|\broughly)\s*$", re.IGNORECASE)
NO_UNIT_INHERITANCE_RE = re.compile(r"load average\s*$", re.IGNORECASE)
HEADER_UNIT_RE = re.compile(rf"(?<![\w/.'’])(?P<unit>{_UNIT_ALTERNATION})(?![A-Za-z0-9])(?!\s*\d)")
UTILISATION_RE = re.compile(r"\bMFU\b|utili[sz]ation", re.IGNORECASE)
CODE_SPAN_RE = re.compile(r"`[^`]*`")
RESULT_NAME_RE = re.compile(r"(?:benchmarks/results/)?([\w.-]*\{[\w.,-]+\}[\w.-]*|[\w.-]+\.(?:json|txt|log))")


@dataclass(frozen=True)
class ResultValue:
    file: str
    where: str
    quantity: str
    value: float  # in the quantity's base unit


@dataclass(frozen=True)
class DocNumber:
    path: str
    line: int
    text: str  # as written, e.g. "43.1 ms"
    unit: str  # written or taken from a header or a joined number
    quantity: str
    value: float  # in the quantity's base unit
    tolerance: float  # half a unit of the last written digit, in the base unit
    named_files: tuple[str, ...] = ()
    exempt: str = ""  # why it is not a measurement, when it is not


@dataclass
class Verdict:
    number: DocNumber
    found_in: str = ""  # "file: where" of the matching value or quotient
    why: str = ""  # why it did not match


@dataclass
class Results:
    values: dict[str, list[ResultValue]] = field(default_factory=dict)  # file -> values

    def sorted_values(self, file: str, quantity: str) -> list[ResultValue]:
        return sorted((v for v in self.values.get(file, []) if v.quantity == quantity), key=lambda v: v.value)


# ---------------------------------------------------------------------------------------------------------- results


def _parse_number(text: str) -> float:
    return float(text.replace(",", ""))


def _decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def written_unit(m: re.Match) -> str | None:
    """The unit written right after a QUANTITY_RE match's number, or None."""
    return m.group("unit") or ("×" if m.group("times") or m.group("x") else None)


def text_values(text: str) -> Iterator[tuple[float, str]]:
    """(value in its written unit, unit) for every number written with a unit in a result's text; percentages are
    left out (a log's "[ 45%]" is progress, not utilisation: utilisation comes from `mfu`/`util` keys only)."""
    for m in QUANTITY_RE.finditer(text):
        unit = written_unit(m)
        if unit and unit != "%":
            yield _parse_number(m.group("num")), unit


def key_unit(key: str, file: str) -> str | None:
    """The written unit a JSON key names (see the module docstring), or None."""
    tokens = key.lower().split("_")
    if RATIO_TOKENS.intersection(tokens):
        return "×"
    if FRACTION_TOKENS.intersection(tokens):
        return "fraction"
    if "per" in tokens:
        after = [t for t in tokens[tokens.index("per") + 1 :] if t not in ("cpu", "wall")]
        thing = tokens[tokens.index("per") - 1] if tokens.index("per") > 0 else ""
        if after and KEY_UNITS.get(after[0]) == "s":
            return {"images": "images/s", "views": "views/s", "gb": "GB/s"}.get(thing)
    for token in tokens:
        if token in KEY_UNITS:
            return UNIT_OVERRIDES.get((file, token), KEY_UNITS[token])
    return None


def _unit_field(node: dict) -> str | None:
    """The written unit an object's `unit` string starts with."""
    text = node.get("unit")
    if not isinstance(text, str):
        return None
    m = re.match(rf"(?:{_UNIT_ALTERNATION})(?![A-Za-z0-9])", text.strip())
    return m.group(0) if m else None


def _result_value(file: str, where: str, unit: str, value: float) -> ResultValue:
    if unit == "fraction":
        return ResultValue(file, where, "utilisation", value)
    quantity, factor = {**UNITS, **RESULT_ONLY_UNITS}[unit]
    return ResultValue(file, where, quantity, value * factor)


def json_values(file: str, node, where: str = "", unit: str | None = None) -> Iterator[ResultValue]:
    """Every value with a unit in a parsed result JSON; `unit` is the one inherited from above."""
    if isinstance(node, dict):
        field_unit = _unit_field(node)
        for key, child in node.items():
            if key in SKIPPED_KEYS:
                continue
            own = key_unit(key, file)
            inherited = own or (field_unit if not isinstance(child, dict) else None) or unit
            yield from json_values(file, child, f"{where}.{key}" if where else key, inherited)
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from json_values(file, child, f"{where}[{i}]", unit)
    elif isinstance(node, str):
        for value, written in text_values(node):
            yield _result_value(file, where, written, value)
    elif isinstance(node, (int, float)) and not isinstance(node, bool) and unit:
        yield _result_value(file, where, unit, float(node))


def load_results(results_dir: Path = RESULTS_DIR) -> Results:
    """Every value with a unit in the JSON, .txt and .log files of `results_dir`."""
    if not results_dir.is_dir():
        raise FileNotFoundError(f"{results_dir}: no such result folder; pass --results DIR")
    results = Results()
    for path in sorted(results_dir.iterdir()):
        if path.suffix == ".json":
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: not valid JSON ({err}); fix or remove the result file") from err
            results.values[path.name] = list(json_values(path.name, data))
        elif path.suffix in (".txt", ".log"):
            text = path.read_text(errors="replace")
            results.values[path.name] = [_result_value(path.name, "text", u, v) for v, u in text_values(text)]
    return results


# ------------------------------------------------------------------------------------------------------------- docs


@dataclass(frozen=True)
class ProseLine:
    number: int
    text: str  # with inline code blanked and ** removed
    raw: str
    context: str  # table headers and parent bullets: what the line is about
    block: int  # the paragraph, list or table it belongs to (lines up to a blank line or heading)
    sections: tuple[int, ...]  # its section and the sections that hold it, innermost first (0: before any heading)
    code: bool = False  # inside a fenced code block: names result files, holds no prose numbers
    cells: tuple[tuple[int, int, str | None], ...] = ()  # table cells: (start, end, unit named by the headers)


def _blank_code(text: str, span_open: bool = False) -> tuple[str, bool]:
    """The line with its inline code blanked (offsets kept), and whether a code span runs on into the next line;
    `span_open`: one runs on from the line before."""
    if span_open:
        end = text.find("`")
        if end < 0:
            return " " * len(text), True
        head, text = " " * (end + 1), text[end + 1 :]
    else:
        head = ""
    text = CODE_SPAN_RE.sub(lambda m: " " * len(m.group(0)), text)
    start = text.find("`")
    if start >= 0:
        return head + text[:start] + " " * (len(text) - start), True
    return head + text, False


def _prose(raw: str, span_open: bool = False) -> tuple[str, bool]:
    text, still_open = _blank_code(raw, span_open)
    return text.replace("**", "  "), still_open


def _cells(line: str) -> list[tuple[int, int]]:
    """(start, end) of every cell of a Markdown table row; escaped pipes stay inside their cell."""
    bars = [m.start() for m in re.finditer(r"(?<!\\)\|", line)]
    return [(a + 1, b) for a, b in zip(bars, bars[1:], strict=False)]


def header_unit(header: str) -> str | None:
    """The one unit a table header names without a number before it ("ms/step", "peak GiB"), else None."""
    text = _prose(header)[0]
    units = {m.group("unit") for m in HEADER_UNIT_RE.finditer(text) if not re.search(r"\d\s*$", text[: m.start()])}
    return units.pop() if len(units) == 1 else None


def _table_cells(raw: str, header: list[str]) -> tuple[tuple[int, int, str | None], ...]:
    """A data row's cells, each with the unit its column header names, or else its row header (first cell)."""
    spans = _cells(raw)
    row_header = raw[spans[0][0] : spans[0][1]] if spans else ""
    return tuple(
        (a, b, None if i == 0 else header_unit(header[i] if i < len(header) else "") or header_unit(row_header))
        for i, (a, b) in enumerate(spans)
    )


def markdown_lines(text: str) -> Iterator[ProseLine]:
    """Every line but fences, table separators and blank lines, with its block and sections; for prose, also what
    each table cell and bullet is about."""
    in_fence, block, span_open = False, 0, False
    headings: list[tuple[int, int]] = [(0, 0)]  # (level, section id) of the open sections, outermost first
    table_header: list[str] = []
    bullets: list[tuple[int, str]] = []  # (indent, text) of the enclosing bullets
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") and not in_fence:
            level = len(stripped) - len(stripped.lstrip("#"))
            headings = [h for h in headings if h[0] < level] + [(level, number)]
            block += 1
        sections = tuple(section for _, section in reversed(headings))
        if stripped.startswith("```"):
            in_fence = not in_fence
        elif in_fence:
            yield ProseLine(number, "", raw, "", block, sections, code=True)
        elif not stripped:
            block, table_header, bullets, span_open = block + 1, [], [], False
        elif not stripped.startswith("|"):
            table_header = []
            indent = len(raw) - len(raw.lstrip())
            if re.match(r"\s*(?:[-*+]|\d+\.)\s", raw):
                bullets = [b for b in bullets if b[0] < indent] + [(indent, stripped)]
            elif indent == 0:
                bullets = []
            text, span_open = _prose(raw, span_open)
            yield ProseLine(number, text, raw, " ".join(b[1] for b in bullets), block, sections)
        elif not table_header:
            table_header = [raw[a:b] for a, b in _cells(raw)]
            yield ProseLine(number, _prose(raw)[0], raw, "", block, sections)
        elif not re.fullmatch(r"[\s|:-]+", stripped):
            cells = _table_cells(raw, table_header)
            context = " ".join(table_header) + " " + (raw[cells[0][0] : cells[0][1]] if cells else "")
            yield ProseLine(number, _prose(raw)[0], raw, context, block, sections, cells=cells)


def named_result_files(raw: str, known: set[str]) -> tuple[str, ...]:
    """The result files a line names, braces expanded, that exist in the results folder."""
    names: list[str] = []
    for m in RESULT_NAME_RE.finditer(raw):
        name = m.group(1)
        brace = re.match(r"(.*)\{([^}]*)\}(.*)", name)
        expanded = [brace.group(1) + part + brace.group(3) for part in brace.group(2).split(",")] if brace else [name]
        names += [n for n in expanded if n in known and n not in names]
    return tuple(names)


@dataclass(frozen=True)
class _Token:
    start: int
    end: int
    written: str
    value: float  # in the written unit
    precision: str  # the part whose last digit sets the precision ("18" of "1 min 18 s")
    unit: str | None


def _tokens(text: str) -> list[_Token]:
    """Every number of a line, with its unit when one is written right after it."""
    tokens = [
        _Token(
            m.start(),
            m.end(),
            m.group(0),
            _parse_number(m.group("min")) * 60 + _parse_number(m.group("s")),
            m.group("s"),
            "s",
        )
        for m in COMPOUND_TIME_RE.finditer(text)
    ]
    compounds = [(t.start, t.end) for t in tokens]
    for m in QUANTITY_RE.finditer(text):
        if any(a <= m.start() < b for a, b in compounds):
            continue
        unit = written_unit(m)
        num = m.group("num")
        tokens.append(_Token(m.start(), m.end(), m.group(0).strip(), _parse_number(num), num, unit))
    return sorted(tokens, key=lambda t: t.start)


def _cell_unit(line: ProseLine, position: int) -> str | None:
    for start, end, unit in line.cells:
        if start <= position < end:
            return unit
    return None


def _tolerance(precision: str, approximate: bool) -> float:
    """Half a unit of the last written digit; an approximate integer's trailing zeros are not written digits."""
    if "." in precision:
        return 0.5 * 10.0 ** -_decimals(precision)
    digits = precision.replace(",", "")
    zeros = len(digits) - len(digits.rstrip("0")) if approximate and digits.strip("0") else 0
    return 0.5 * 10.0**zeros


def _resolve_units(line: ProseLine, tokens: list[_Token]) -> tuple[list[str | None], list[int]]:
    """The unit of every token, and the index of the first token of its joined chain ("0.58 / 1.29 / 0.78 ms")."""
    text = line.text
    joined = [i > 0 and bool(JOINER_RE.fullmatch(text[tokens[i - 1].end : t.start])) for i, t in enumerate(tokens)]
    chain_start = []
    for i in range(len(tokens)):
        chain_start.append(chain_start[i - 1] if joined[i] else i)
    units = [t.unit for t in tokens]
    for i in range(len(tokens) - 2, -1, -1):
        if units[i] is None and joined[i + 1]:
            units[i] = units[i + 1]
    for i, token in enumerate(tokens):
        first = tokens[chain_start[i]]
        if units[i] is None and not NO_UNIT_INHERITANCE_RE.search(text[: first.start]):
            units[i] = _cell_unit(line, token.start)
    return units, chain_start


def line_numbers(path: str, line: ProseLine, known: set[str], around: tuple[str, ...] = ()) -> list[DocNumber]:
    """The performance numbers of one prose line, in order. They are looked up in the result files the line names,
    or else in `around`: those its block names, or else those its sections name."""
    tokens = _tokens(line.text)
    units, chain_start = _resolve_units(line, tokens)
    named = named_result_files(line.raw, known) or around
    numbers = []
    for token, unit, first in zip(tokens, units, chain_start, strict=True):
        if unit is None or (unit == "%" and not UTILISATION_RE.search(line.raw + " " + line.context)):
            continue
        prefix = line.text[: tokens[first].start]
        exempt = EXEMPT_RE.search(prefix) or EXEMPT_AFTER_RE.match(line.text, token.end)
        quantity, factor = UNITS[unit]
        written = token.written if token.unit else f"{token.written} {unit}"
        tolerance = _tolerance(token.precision, bool(APPROXIMATE_RE.search(prefix))) * factor
        numbers.append(
            DocNumber(
                path,
                line.number,
                written,
                unit,
                quantity,
                token.value * factor,
                tolerance,
                named,
                f"next to '{exempt.group(0).strip()}'" if exempt else "",
            )
        )
    return numbers


def doc_numbers(path: Path, known: set[str], root: Path = ROOT) -> list[DocNumber]:
    """Every performance number of one Markdown file."""
    rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
    lines = list(markdown_lines(path.read_text()))
    by_block: dict[int, list[str]] = {}
    by_section: dict[int, list[str]] = {}
    for line in lines:
        for named in (by_block.setdefault(line.block, []), by_section.setdefault(line.sections[0], [])):
            named += [f for f in named_result_files(line.raw, known) if f not in named]
    numbers = []
    for line in lines:
        if not line.code:
            in_sections = dict.fromkeys(f for section in line.sections for f in by_section.get(section, []))
            numbers += line_numbers(rel, line, known, tuple(by_block[line.block]) or tuple(in_sections))
    return numbers


# --------------------------------------------------------------------------------------------------------- matching


def _in_range(floats: list[float], lo: float, hi: float) -> int | None:
    """Index of a value in [lo, hi] of a sorted list, or None."""
    i = bisect.bisect_left(floats, lo)
    return i if i < len(floats) and floats[i] <= hi else None


def _slack(x: float) -> float:
    return 1e-9 * max(1.0, abs(x))  # floating-point noise of the unit conversions


def _direct_match(number: DocNumber, values: list[ResultValue]) -> ResultValue | None:
    floats = [v.value for v in values]
    tol = number.tolerance + _slack(number.value)
    i = _in_range(floats, number.value - tol, number.value + tol)
    return None if i is None else values[i]


def _quotient_match(number: DocNumber, values: list[ResultValue]) -> tuple[ResultValue, ResultValue] | None:
    """Two values a, b of one quantity with a / b rounding to the written ratio."""
    positive = [v for v in values if v.value > 0]
    floats = [v.value for v in positive]
    tol = number.tolerance + _slack(number.value)
    for b in positive:
        i = _in_range(floats, b.value * (number.value - tol), b.value * (number.value + tol))
        if i is not None:
            return positive[i], b
    return None


def find_value(number: DocNumber, results: Results, file: str) -> str:
    """Where `file` holds a value that rounds to the number, or ""."""
    hit = _direct_match(number, results.sorted_values(file, number.quantity))
    return hit.where if hit else ""


def find_quotient(number: DocNumber, results: Results, file: str) -> str:
    """ "a / b" for two values of one quantity in `file` whose quotient rounds to the written ratio, or ""."""
    for quantity in DIVISIBLE:
        pair = _quotient_match(number, results.sorted_values(file, quantity))
        if pair:
            return f"{pair[0].where} / {pair[1].where}"
    return ""


def _nearest(number: DocNumber, results: Results, scope: list[str]) -> str:
    candidates = [v for file in scope for v in results.values[file] if v.quantity == number.quantity]
    if not candidates:
        return f"none holds a {number.quantity} value"
    best = min(candidates, key=lambda v: abs(v.value - number.value))
    shown = best.value / UNITS[number.unit][1]
    return f"nearest {number.quantity} value: {shown:.6g} {number.unit} ({best.file}: {best.where})"


def check_number(number: DocNumber, results: Results) -> Verdict:
    """Where the number appears: in the files its line, block or sections name, or in any file when they name none."""
    scope = list(number.named_files) or list(results.values)
    searches = [find_value, find_quotient] if number.quantity == "ratio" else [find_value]
    for search in searches:  # a stored ratio in any file of the scope before any quotient
        for file in scope:
            where = search(number, results, file)
            if where:
                return Verdict(number, found_in=f"{file}: {where}")
    ratio_note = "; no stored ratio or quotient of two values of one file rounds to it" * (number.quantity == "ratio")
    return Verdict(
        number,
        why=f"no value in {_scope_name(number)} rounds to it at the precision written{ratio_note}; "
        f"{_nearest(number, results, scope)}",
    )


def _scope_name(number: DocNumber) -> str:
    if not number.named_files:
        return "any result file"
    return ", ".join(number.named_files) + " (named by its line, block or section)"


def default_docs(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def check(docs: list[Path] | None = None, results_dir: Path = RESULTS_DIR, root: Path = ROOT) -> list[Verdict]:
    """A verdict for every performance number of the docs; exempt numbers are not looked up."""
    results = load_results(results_dir)
    known = set(results.values)
    verdicts = []
    for path in docs if docs is not None else default_docs(root):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such Markdown file; pass existing README/docs paths")
        for number in doc_numbers(path, known, root):
            verdicts.append(Verdict(number) if number.exempt else check_number(number, results))
    return verdicts


def unmatched(verdicts: list[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if not v.number.exempt and not v.found_in]


def describe(verdict: Verdict) -> str:
    n = verdict.number
    head = f"{n.path}:{n.line}: {n.text!r} ({n.quantity})"
    if n.exempt:
        return f"{head}: exempt, {n.exempt}"
    if verdict.found_in:
        return f"{head}: found in {verdict.found_in}"
    return f"{head}: UNMATCHED, {verdict.why}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("docs", nargs="*", type=Path, help="Markdown files (default: README.md and docs/**/*.md)")
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="result folder (default: benchmarks/results)")
    p.add_argument("--all", action="store_true", help="list every number, matched and exempt ones too")
    args = p.parse_args(argv)
    verdicts = check([d.resolve() for d in args.docs] or None, args.results)
    missing = unmatched(verdicts)
    for verdict in verdicts if args.all else missing:
        print(describe(verdict))
    print(
        f"{len(verdicts)} performance numbers, {len(missing)} unmatched, "
        f"{sum(bool(v.number.exempt) for v in verdicts)} exempt"
    )
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
