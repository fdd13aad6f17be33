"""docs/methods.md's side-by-side tables: every cell is its compare file's statistic at the precision shown, and the
cub100 held-out runs are on the held-out species with the epochs the choice runs' records pick."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "methods.md"
TABLES = {  # section heading: the compare file its table shows, and the seeds of each of its methods
    "## The digits, side by side": ("methods_demo_cpu.json", 3),
    "### The demo's 12 epochs": ("methods_demo_12_epochs_cpu.json", 6),
    "## cub100 held-out species": ("methods_cub100_heldout_60-79_cpu.json", 3),
}
COLUMNS = {  # a table's column header: where its cells come from in a compare file's entry
    "All": ("accuracy", "v2", "all"),
    "Old": ("accuracy", "v2", "old"),
    "New": ("accuracy", "v2", "new"),
    "before: All": ("before", "all"),
    "before: Old": ("before", "old"),
    "before: New": ("before", "new"),
}
CHOICE = RESULTS / "methods_cub100_choice_0-19"


def tables(heading: str) -> list[tuple[list[str], list[list[str]]]]:
    """The header and rows of each table in the section `heading` of docs/methods.md."""
    section = DOC.read_text().split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    found, block = [], []
    for line in [*section.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip("|").split("|")])
        elif block:
            found.append((block[0], block[2:]))
            block = []
    return found


def table(heading: str, column: str = "seeds") -> tuple[list[str], list[list[str]]]:
    """The first table of the section `heading` with a `column`."""
    return next(t for t in tables(heading) if column in t[0])


def method_of(row: list[str]) -> str:
    """The method a row shows, from its config's name: `configs/demo-gcd.yaml` -> gcd, `demo.yaml` -> infosieve."""
    config = re.search(r"`configs/([\w.-]+)\.yaml`", row[0]).group(1)
    found = re.search(r"-(gcd|simgcd|selex)$", config)
    return found.group(1) if found else "infosieve"


def stat(entry: dict, path: tuple[str, ...]) -> dict:
    for key in path:
        entry = entry[key]
    return entry


@pytest.mark.parametrize("heading", TABLES)
def test_each_cell_is_the_compare_files_mean_and_sd(heading):
    name, seeds = TABLES[heading]
    result = json.loads((RESULTS / name).read_text())
    entries = {re.search(r"-(\w+): \(no grid\)$", e["label"]).group(1): e for e in result["entries"]}
    header, rows = table(heading)
    assert sorted(method_of(row) for row in rows) == sorted(entries) == ["gcd", "infosieve", "selex", "simgcd"]
    shown = [h for h in header if h in COLUMNS]
    assert {"All", "Old", "New"} <= set(shown)
    for row in rows:
        entry = entries[method_of(row)]
        assert row[header.index("seeds")] == str(len(entry["runs"])) == str(seeds)
        for column in shown:
            s = stat(entry, COLUMNS[column])
            assert row[header.index(column)] == f"{s['mean']:.4f} ± {s['sd']:.4f}", (heading, row[0], column)


def test_the_held_out_runs_train_the_epochs_the_choice_runs_pick_on_other_species():
    result = json.loads((RESULTS / TABLES["## cub100 held-out species"][0]).read_text())
    header, rows = table("## cub100 held-out species")
    for row in rows:
        method = method_of(row)
        (choice,) = (CHOICE / f"methods-cub-choice-{method}" / "runs").iterdir()
        log = [json.loads(line) for line in (choice / "log.jsonl").read_text().splitlines()]
        alls = [r["eval"]["all"] for r in log]  # the choice runs evaluate after every epoch
        picked = 1 + max(range(len(alls)), key=lambda i: (alls[i], -i))  # the best All, the earlier on a tie
        (entry,) = [e for e in result["entries"] if e["label"].startswith(f"methods-cub-heldout-{method}:")]
        assert {r["epochs"] for r in entry["runs"]} == {picked} and row[header.index("epochs")] == str(picked)
        choice_header, choice_rows = table("## cub100 held-out species", "epochs chosen")
        (shown,) = [r for r in choice_rows if r[0] == row[0].split(" (")[0]]
        before = json.loads((choice / "metrics.json").read_text())["before"]["all"]
        assert shown[1:] == [f"{before:.4f}", *(f"{a:.4f}" for a in alls), str(picked)], choice_header
        assert "cub20-shards" in (choice / "config.yaml").read_text()  # chosen on species 0-19 ...
        for run in entry["runs"]:  # ... measured on 60-79
            assert "cub60-79-shards" in (RESULTS / "methods_cub100_heldout_60-79" / Path(run["run"]).relative_to(
                "runs") / "config.yaml").read_text()  # fmt: skip
