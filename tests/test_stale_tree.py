"""A tree.json of an older checkpoint (`infosieve tree`, then `train --resume` further) is not shown as the run's:
`report` and `compare` name it stale and say how to refresh it; the report's notes to act on reach the console; the
confusion matrix labels its rows by class name; counts agree in number."""

import html
import io
import json
import shutil
from contextlib import redirect_stdout

import numpy as np
import pytest

from infosieve_fast import cli
from infosieve_fast.analysis.run_results import read_run, saved_tree
from infosieve_fast.commands import compare
from infosieve_fast.commands.report import confusion_figure, pyplot
from infosieve_fast.common.wording import counted
from infosieve_fast.data.writing.layout_discovery import read_discovery
from infosieve_fast.training.checkpoint import load_checkpoint
from tests.test_sweep import SMALL


@pytest.fixture(scope="module")
def stale(tmp_path_factory):
    """A run whose tree.json was written at epoch 2 and which then trained on to epoch 3; and a copy of it whose
    tree.json is refreshed."""
    base = tmp_path_factory.mktemp("stale")
    run = base / "run"
    sets = [a for s in SMALL for a in ("--set", s)]
    assert cli.main(["train", "--config", "configs/demo.yaml", *sets, "--out", str(run)]) == 0
    with redirect_stdout(io.StringIO()) as printed:  # the report before `infosieve tree`: checked below
        assert cli.main(["report", "--run", str(run)]) == 0
    (base / "report-before-tree.txt").write_text(printed.getvalue())
    shutil.copy(run / "report.html", base / "report-before-tree.html")
    assert cli.main(["tree", "--run", str(run)]) == 0
    assert cli.main(["train", "--resume", str(run), "--set", "schedule.epochs=3"]) == 0
    fresh = base / "fresh"
    shutil.copytree(run, fresh)
    assert cli.main(["tree", "--run", str(fresh)]) == 0
    return base, run, fresh


def test_a_tree_of_an_older_checkpoint_is_named_stale(stale):
    _, run, fresh = stale
    assert json.loads((run / "tree.json").read_text())["checkpoint"] == "last, epoch 2"
    assert load_checkpoint(run)["epoch"] == 3
    tree, note = saved_tree(run)
    assert tree is None
    assert note == (
        f"{run / 'tree.json'} is stale: it is of the checkpoint 'last, epoch 2', the run's is now 'last, epoch 3'; "
        f"run `infosieve tree --run {run}` to refresh it"
    )
    tree, note = saved_tree(fresh)
    assert (
        note is None
        and tree == json.loads((fresh / "tree.json").read_text())
        and tree["checkpoint"] == ("last, epoch 3")
    )
    (fresh / "tree.json").rename(fresh / "moved.json")
    assert saved_tree(fresh) == (None, None)  # no tree.json: nothing to show, nothing stale
    (fresh / "moved.json").rename(fresh / "tree.json")


def test_a_tree_that_records_no_checkpoint_is_shown_with_its_age_unknown(stale, tmp_path):
    _, _, fresh = stale
    old = tmp_path / "old"
    shutil.copytree(fresh, old)
    tree = json.loads((old / "tree.json").read_text())
    del tree["checkpoint"]
    (old / "tree.json").write_text(json.dumps(tree))
    read, note = saved_tree(old)
    assert read == tree and "does not record its checkpoint" in note and "'last, epoch 3'" in note
    result = read_run(old).record()
    assert result["codes"] == tree["measures"] and result["codes_note"] == note


def test_compare_leaves_a_stale_trees_numbers_out(stale, tmp_path, capsys):
    _, run, fresh = stale
    result = compare.compare([run, fresh], tmp_path / "page.html")
    records = {e["label"]: e["runs"][0] for e in result["entries"]}
    assert records["run"]["codes"] is None and "is stale" in records["run"]["codes_note"]
    measures = json.loads((fresh / "tree.json").read_text())["measures"]
    assert records["fresh"]["codes"] == measures and records["fresh"]["codes_note"] is None
    detail = result["tables"][1]
    rows = {row[0]: row for row in detail["rows"]}
    assert rows["run"][2:6] == ["stale (see the note)"] * 4
    assert rows["fresh"][2:4] == [f"{measures['all']:.4f}", f"{measures['purity_8']:.4f}"]
    assert rows["run"][-2] == rows["fresh"][-2] == "last, epoch 3"
    assert f"run: left out of the code columns: {saved_tree(run)[1]}" in detail["notes"]
    assert "the run's is now 'last, epoch 3'" in capsys.readouterr().out  # the table's notes are printed too


def test_report_says_the_tree_is_stale_and_does_not_draw_it(stale, tmp_path, capsys):
    _, run, fresh = stale
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    assert cli.main(["report", "--run", str(copy)]) == 0
    printed = capsys.readouterr().out.splitlines()
    note = saved_tree(copy)[1]
    assert printed == [f"note: the category tree is not drawn: {note}", f"wrote {copy / 'report.html'}"]
    page = (copy / "report.html").read_text()
    assert "checkpoint: <b>last, epoch 3</b>" in page and "is stale: it is of the checkpoint" in page
    assert "implicit category tree" not in page and page.count("data:image/png;base64,") == 4
    assert cli.main(["report", "--run", str(fresh)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"wrote {fresh / 'report.html'}"]  # nothing to act on
    assert (fresh / "report.html").read_text().count("data:image/png;base64,") == 5


def test_report_before_tree_says_so_on_the_console(stale):
    base, run, _ = stale
    note = f"no tree.json: run `infosieve tree --run {run}` first"
    assert html.unescape((base / "report-before-tree.html").read_text()).count(note) == 1
    printed = (base / "report-before-tree.txt").read_text().splitlines()
    assert printed == [f"note: {note}", f"wrote {run / 'report.html'}"]


def test_confusion_matrix_ticks_are_classes_and_clusters():
    plt = pyplot()
    targets = np.array([0, 0, 1, 1, 2, 2, 2])
    preds = np.array([2, 2, 0, 0, 1, 1, 0])  # class 0 -> cluster 2, 1 -> 0, 2 -> 1
    names = ["Blue Jay", "Cardinal", "a $name$ with a long tail"]
    fig = confusion_figure(targets, preds, 3, names)
    ax = fig.axes[0]
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["Blue Jay", "Cardinal", "a \\$name\\$ with a "]
    assert list(ax.get_yticks()) == [0, 1, 2] and list(ax.get_xticks()) == [0, 1, 2]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "0", "1"]  # the matched clusters' numbers
    assert ax.get_ylabel() == "true class" and not ax.lines  # every class known: no line, none mentioned
    np.testing.assert_allclose(ax.images[0].get_array(), [[1, 0, 0], [0, 1, 0], [0, 1 / 3, 2 / 3]])
    plt.close(fig)
    fig = confusion_figure(targets, preds, 2, None)
    ax = fig.axes[0]
    fig.canvas.draw()
    assert ax.get_ylabel() == "true class (known above the line)" and list(ax.lines[0].get_ydata()) == [1.5, 1.5]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2"]
    plt.close(fig)


def test_counts_agree_in_number(tmp_path):
    assert [counted(1, "known class"), counted(2, "class"), counted(1200, "labelled image")] == [
        "1 known class", "2 classes", "1,200 labelled images"]  # fmt: skip
    for folder, image in (("labelled/Blue Jay", "a.png"), ("unlabelled", "b.png")):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / image).write_bytes(b"")
    (note,) = read_discovery(tmp_path).notes
    assert note.startswith("discovery: 1 known class (1 labelled image), 1 unlabelled image; ")
