"""The repository stands alone: what it says about the published code is in docs/reference.md, and it points nowhere
outside the checkout.

- No file sends a reader to the team's private notes on the published code or to a folder beside the checkout (the
  test-data folder is found through `INFOSIEVE_REALDATA` and tests/conftest.py, never named as a relative path).
- Every `docs/reference.md §N` citation, in code or docs, and every link to an anchor of docs/reference.md, names a
  section that exists there; every section has its stable anchor; every config key the page names exists.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from infosieve_fast.config.settings import Config

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference.md"
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".benchmarks", ".whl", "build", "runs"}
# spelled in pieces so that this file does not match itself
PRIVATE_NOTES = re.compile("REF" + r"ERENCE(?:\.md\b|\s*§)")
BESIDE_CHECKOUT = ".." + "/shared"
# `docs/reference.md §1, §3.8, §4`, `§3.3-3.5`, `§3.1-3.6/3.10`, `§2-§4`, `§5.1 / §5.2`, `§6 and §10` (may wrap a line)
CITATION = re.compile(r"reference\.md\s+(§\d+(?:\.\d+)?(?:\s*(?:,|/|-|–|and)\s*§?\d+(?:\.\d+)?)*)")
LINK = re.compile(r"\]\(([^)\s#]*reference\.md)#([^)\s]+)\)")
SECTION_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def repository_files() -> list[Path]:
    """Every text file of the checkout, outside version control's and tools' own folders."""
    files = []
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if not path.is_file() or any(p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts[:-1]):
            continue
        data = path.read_bytes()
        if b"\0" not in data[:8192]:
            files.append(path)
    return files


def reference_sections() -> tuple[set[str], set[str]]:
    """(section numbers of the headings of docs/reference.md, its anchor ids); checks each heading has its anchor on
    the line before it, `sN` or `sN-M`."""
    lines = REFERENCE.read_text().splitlines()
    numbers, anchors = set(), set(re.findall(r'<a id="([^"]+)"></a>', REFERENCE.read_text()))
    for i, line in enumerate(lines):
        m = re.match(r"#{2,4} (\d+(?:\.\d+)?)\.? ", line)
        if m:
            numbers.add(m.group(1))
            anchor = "s" + m.group(1).replace(".", "-")
            assert i > 0 and lines[i - 1] == f'<a id="{anchor}"></a>', f"docs/reference.md: {line!r} lacks its anchor"
    return numbers, anchors


def test_reference_page_has_numbered_sections_with_anchors():
    numbers, anchors = reference_sections()
    # the topics the code cites: defaults, model, losses, loop, k-means, accuracy, splits, kernels, departures
    assert {"1", "2.1", "2.2", "2.3", "3.1", "3.5", "3.10", "4", "5.1", "5.2", "6", "7", "8", "8.1", "11"} <= numbers
    assert {"s" + n.replace(".", "-") for n in numbers} <= anchors


def test_no_file_points_to_the_private_notes_or_beside_the_checkout():
    offending = []
    for path in repository_files():
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if PRIVATE_NOTES.search(line) or BESIDE_CHECKOUT in line:
                offending.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not offending, "cite docs/reference.md and name the data, not a folder beside the checkout:\n" + "\n".join(
        offending
    )


def test_every_cited_section_of_the_reference_page_exists():
    numbers, anchors = reference_sections()
    missing, cited = [], 0
    for path in repository_files():
        text = path.read_text(errors="replace")
        where = path.relative_to(ROOT)
        for m in CITATION.finditer(text):
            for number in SECTION_NUMBER.findall(m.group(1)):
                cited += 1
                if number not in numbers:
                    missing.append(f"{where}: {m.group(0)!r} cites §{number}")
        for m in LINK.finditer(text):
            target = (path.parent / m.group(1)).resolve()
            cited += 1
            if target != REFERENCE or m.group(2) not in anchors:
                missing.append(f"{where}: link {m.group(1)}#{m.group(2)} is not an anchor of docs/reference.md")
    within = re.findall(r"§(\d+(?:\.\d+)?)", REFERENCE.read_text())  # the page's own cross-references
    missing += [f"docs/reference.md cites §{n}" for n in within if n not in numbers]
    assert cited > 50, cited  # the code and docs do cite it: the pattern still finds them
    assert not missing, "\n".join(missing)


def _config_keys(cls=Config, prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(cls):
        keys.add(prefix + f.name)
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            keys |= _config_keys(f.default_factory, f"{prefix}{f.name}.")
    return keys


def _named_keys(text: str) -> set[str]:
    """The `section.key` spans of a Markdown text (file names such as `model.py` left out)."""
    sections = "|".join(f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default_factory))
    spans = re.findall(rf"`((?:{sections})\.[a-z_][a-z0-9_.]*)", text)
    return {s for s in spans if not re.search(r"\.(py|pt|json|jsonl|yaml|txt|md|html)$", s)}


def test_config_keys_named_by_the_reference_page_and_the_readme_switch_table_exist():
    readme = (ROOT / "README.md").read_text()
    switch_table = readme.split("### Reference parity and departures", 1)[1].split("\n## ", 1)[0]
    for where, text in (("docs/reference.md", REFERENCE.read_text()), ("README.md's switch table", switch_table)):
        named = _named_keys(text)
        assert len(named) > 10, (where, named)
        assert not sorted(named - _config_keys()), f"{where} names config keys that do not exist"
