"""Hostile names stay text: a class named like an HTML element with a script, and file and folder names with quotes
and angle brackets, show as text in report.html and in the comparison page, rendered by headless Chromium, and no
script they carry runs. A checkpoint or weights file carrying a pickled payload is refused unread."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from infosieve_fast.commands import compare
from infosieve_fast.commands.report import write_report
from infosieve_fast.common.files import CheckpointError
from infosieve_fast.common.labels import NO_LABEL
from infosieve_fast.network.model import load_backbone_weights
from infosieve_fast.training.checkpoint import load_checkpoint
from infosieve_fast.training.run_folder import train
from tests.test_compare import fake_shards, restage
from tests.test_engine import smoke_config

# each would mark <body> with data-pwned if the page ran it as HTML
CLASS = "<img src=x onerror=\"document.body.setAttribute('data-pwned','class')\">"
FILE = "cat \"q\" 'a' <b>bold</b><script>document.body.setAttribute('data-pwned','file')</script>.png"
FOLDER = "run \"q\" 'a' <i>it</i><svg onload=\"document.body.setAttribute('data-pwned','folder')\">"
DATASET = "birds<script>document.body.setAttribute('data-pwned','dataset')</script>"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished smoke run in a folder of a hostile name, its first class renamed `CLASS`, with an unlabelled pool
    and a predictions file naming `FILE`."""
    base = tmp_path_factory.mktemp("hostile")
    run = base / FOLDER
    train(smoke_config("schedule.epochs=1", "train.train_subset=128"), run)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    state["class_names"] = [CLASS, *state["class_names"][1:]]
    torch.save(state, run / "checkpoint.pt")
    with np.load(run / "clustering.npz") as z:
        clustering = {k: z[k] for k in z.files}
    clustering["targets"] = np.where(np.arange(len(clustering["targets"])) % 2 == 0, NO_LABEL, clustering["targets"])
    np.savez(run / "clustering.npz", **clustering)
    record = {"path": f"images/{FILE}", "cluster": 0, "margin": 0.25}
    (run / "predictions.jsonl").write_text(json.dumps(record) + "\n")
    return run


def text_of(dom: str) -> str:
    """The DOM's text, its tags dropped and its entities decoded (what a reader sees)."""
    import html

    return html.unescape(re.sub(r"<[^>]*>", "", dom))


def assert_inert(dom: str, *names: str) -> None:
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert "data-pwned" not in body, body  # no script of a name ran
    for tag in ('<img src="x"', "<script>", "<svg", "<b>bold", "<i>it"):
        assert tag not in dom  # no element made from a name
    seen = text_of(dom)
    for name in names:
        assert name in seen, name  # every name shows as the text it is


def test_hostile_names_show_as_text_in_the_report(run, rendered_dom):
    page = write_report(run)
    dom = rendered_dom(page)
    assert_inert(dom, CLASS, FILE, FOLDER)
    assert f"<td>{CLASS}</td>" not in page.read_text()


def test_hostile_names_show_as_text_on_the_comparison_page(run, tmp_path, rendered_dom):
    shards = fake_shards(tmp_path / "shards", DATASET, "ok")
    other = restage(run, tmp_path / FOLDER.replace("run", "other"), shards)
    out = tmp_path / "page.html"
    compare.compare([run, other], out)
    dom = rendered_dom(out)
    assert_inert(dom, FOLDER, FOLDER.replace("run", "other"), DATASET)


class Payload:
    """Unpickling this runs `touch MARKER`: what a hostile checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch '{self.marker}'",)


def test_a_checkpoint_carrying_a_pickled_payload_is_refused_unread(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    marker = tmp_path / "payload-ran"
    torch.save({"epoch": 1, "model": Payload(marker)}, run / "checkpoint.pt")
    with pytest.raises(CheckpointError, match=r"holds objects other than tensors.*\(it holds posix\.system\)"):
        load_checkpoint(run)
    assert not marker.exists()
    shutil.copy(run / "checkpoint.pt", tmp_path / "weights.pt")  # model.pretrained: torch.load(weights_only=True)
    with pytest.raises(CheckpointError, match=r"holds objects other than tensors.*\(it holds posix\.system\)"):
        load_backbone_weights(torch.nn.Linear(1, 1), tmp_path / "weights.pt")
    assert not marker.exists()
