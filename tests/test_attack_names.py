"""Hostile names (issue 42): names read back from a run are checked where they are read, `export` writes nothing
outside `--out`, never over a file and never half a folder; names and file names reach a CSV cell or a terminal
harmless.

Before the fix: a names.json name `../../../victim` put pool images beside `--out`; a cluster named like a known
class whose file names repeat copied pool images over the known class's images; a 300-character name passed
`infosieve name` (then export ended in ENAMETOOLONG with a half-written folder); a failed export left its half;
`--out ~/x` made a folder named `~`; a `=` name reached a CSV cell as a formula; an escape sequence in a file name
reached the terminal."""

from __future__ import annotations

import csv
import errno
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from infosieve_fast import cli
from infosieve_fast.commands import export
from infosieve_fast.commands.export import link_or_copy
from infosieve_fast.commands.predict import FIELDS, _write
from infosieve_fast.common.file_names import name_problem
from infosieve_fast.common.labels import NO_LABEL
from infosieve_fast.common.shown_text import csv_safe, terminal_safe
from infosieve_fast.config.settings import load_config
from infosieve_fast.data.writing.layouts import read_dataset
from infosieve_fast.data.writing.shards import make_shards
from tests.test_discovery import _layout

N_OLD, NOVEL = 2, 2  # classes a, b; every pool image in cluster novel-2


@pytest.fixture
def finished(tmp_path) -> tuple[Path, Path]:
    """A finished run on a discovery folder, by hand: the folder's shards (export reads the folder from their
    manifest), a checkpoint with its config and centres, and the final clustering (every pool image in cluster 2)."""
    root = _layout(tmp_path / "mine")
    (root / "unlabelled" / "day1" / "0.png").rename(root / "unlabelled" / "0.jpg")  # a pool file named like a known one
    names = read_dataset("discovery", root).train_names
    shards = tmp_path / "shards"
    make_shards("discovery", root, shards, resize=32, workers=1, progress=False)
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config("configs/demo.yaml", [f"data.shards={shards}"])
    state = {"config": cfg.to_dict(), "epoch": 1, "class_names": ["a", "b"], "centers": torch.zeros(3, 4)}
    torch.save(state, run / "checkpoint.pt")
    targets = np.array([NO_LABEL if n.startswith("unlabelled/") else "ab".index(n.split("/")[1]) for n in names])
    preds = np.where(targets == NO_LABEL, NOVEL, targets)
    np.savez(run / "clustering.npz", uq=np.arange(len(names)), targets=targets, preds=preds, n_old=N_OLD)
    return root, run


def named(run: Path, name: str) -> None:
    """A names.json written by hand (as a downloaded or edited run holds it), bypassing `infosieve name`."""
    (run / "names.json").write_text(json.dumps({f"novel-{NOVEL}": name}))


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_name_that_climbs_out_is_refused_where_it_is_read(finished, tmp_path, capsys):
    _, run = finished
    named(run, "../../../victim")
    before = files_under(tmp_path)
    out = tmp_path / "deep" / "er" / "round2"
    assert cli.main(["export", "--run", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {run / 'names.json'}: novel-2='../../../victim' cannot be a folder name (it starts with a dot (`.` "
        "and `..` name folders; a leading dot hides a file)); rename it with "
        f"`infosieve name --run {run} novel-2=NAME`\n"
    )
    assert files_under(tmp_path) == before  # nothing written anywhere: no victim folder beside --out, no --out


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("x" * 300, "it is 300 bytes long in UTF-8 (at most 255)"),
        ("é" * 128, "it is 256 bytes long in UTF-8 (at most 255)"),  # 128 characters, 256 bytes
        ("a/b", "it holds / (path separators"),
        ("..", "it starts with a dot"),
        ("Jay\x1b[2J", "it holds a control character"),
        ("Jay:adult", "it holds : (path separators"),
        ("Jay.", "it ends in a space or a dot"),
        ("nul.txt", "nul is a device name on Windows"),
    ],
)
def test_name_refuses_what_some_file_system_refuses(finished, name, problem, capsys):
    _, run = finished
    assert cli.main(["name", "--run", str(run), f"novel-2={name}"]) == 2
    err = capsys.readouterr().err
    assert problem in err and err.count("\n") == 1 and "\x1b" not in err
    assert not (run / "names.json").exists()


def test_the_portable_rule_by_hand():
    assert name_problem("Blue Jay (juvenile)") is None
    assert name_problem("é" * 127) is None  # 254 bytes
    assert name_problem("x" * 255) is None and name_problem("x" * 256) is not None
    assert name_problem("con") is not None and name_problem("console") is None


def test_export_never_writes_over_a_file(finished, tmp_path, capsys):
    """novel-2 named `a`, a known class (a hand-edited names.json): the pool's 0.jpg and the class's 0.jpg would meet
    at labelled/a/0.jpg. The known image is not replaced and no folder is left."""
    root, run = finished
    named(run, "a")
    known = (root / "labelled" / "a" / "0.jpg").read_bytes()
    out = tmp_path / "round2"
    assert cli.main(["export", "--run", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: export: ") and "labelled/a/0.jpg would be written twice" in err
    assert err.count("\n") == 1
    assert not out.exists() and not list(tmp_path.glob(".round2*"))  # no half folder, no temporary one
    assert (root / "labelled" / "a" / "0.jpg").read_bytes() == known


def test_a_failed_export_leaves_no_half_folder(finished, tmp_path, monkeypatch, capsys):
    """The disk fills after five files: one line and exit 1, --out is as it was (here: absent), and nothing is left
    beside it."""
    _, run = finished
    named(run, "Blue Jay")
    written = []

    def five_then_full(source: Path, target: Path) -> None:
        if len(written) == 5:
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        link_or_copy(source, target)
        written.append(target)

    monkeypatch.setattr(export, "link_or_copy", five_then_full)
    out = tmp_path / "round2"
    assert cli.main(["export", "--run", str(run), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "No space left on device (errno 28); free space there" in err, err
    assert len(written) == 5 and not out.exists() and not list(tmp_path.glob(".round2*"))


def test_export_writes_the_whole_folder_at_once_and_expands_the_home_folder(finished, tmp_path, monkeypatch, capsys):
    root, run = finished
    named(run, "Blue Jay")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["export", "--run", str(run), "--out", "~/round2"]) == 0
    out = tmp_path / "home" / "round2"
    summary = json.loads(capsys.readouterr().out)
    assert summary == {"out": str(out), "labelled": 10, "named": {"Blue Jay": 4}, "unlabelled": 0}
    pool = sorted(str(p.relative_to(root / "unlabelled")) for p in (root / "unlabelled").rglob("*.*"))
    assert files_under(out / "labelled" / "Blue Jay") == sorted({*pool, "day1"})
    assert not (tmp_path / "~").exists() and not list((tmp_path / "home").glob(".round2*"))


def test_csv_cells_are_never_formulas(tmp_path):
    records = [
        dict(zip(FIELDS, (p, 3, n, 0.5, "0101", "01", ["0", "01"]), strict=True))
        for p, n in (("-2+3.png", '=HYPERLINK("http://x")'), ("ok.png", "@SUM(A1)"), ("b.png", "+1"), ("c.png", "Jay"))
    ]
    _write(tmp_path / "p.csv", records)
    rows = list(csv.DictReader((tmp_path / "p.csv").open()))
    assert [(r["path"], r["name"]) for r in rows] == [
        ("'-2+3.png", '\'=HYPERLINK("http://x")'),
        ("ok.png", "'@SUM(A1)"),
        ("b.png", "'+1"),
        ("c.png", "Jay"),
    ]
    assert rows[0]["cluster"] == "3" and rows[0]["margin"] == "0.5" and rows[0]["tree_path"] == "0/01"
    assert csv_safe(-1.5) == -1.5  # numbers are not text: left as they are


def test_control_characters_never_reach_the_terminal(tmp_path, capsys):
    assert terminal_safe("a\x1b]0;owned\x07b\nc\x9b2J\x7f é") == "a\\x1b]0;owned\\x07b\\nc\\x9b2J\\x7f é"
    run = tmp_path / "r\x1b[2Jx"
    assert cli.main(["eval", "--run", str(run)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "r\\x1b[2Jx: no such folder" in err and err.count("\n") == 1
    root = _layout(tmp_path / "mine")
    (root / "unlabelled" / "bad\x1b[31m.jpg").write_bytes(b"not an image")
    argv = ["make-shards", "--dataset", "discovery", "--root", str(root), "--out", str(tmp_path / "shards")]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "make-shards: skipped unlabelled/bad\\x1b[31m.jpg" in err and "\x1b" not in err
