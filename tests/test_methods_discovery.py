"""The own-images loop for the methods without codes (GCD, SimGCD, SelEx): one tiny run each on a discovery folder of
real CIFAR-10 images (2 known classes, 2 novel), whose report has the cluster gallery and the novel clusters' nearest
known classes in the features (no code tree, said in one line), and whose named clusters `infosieve export` writes
as the next round's known classes. SimGCD's clusters are its head's argmax, everyone else's SS-k-means."""

from __future__ import annotations

import contextlib
import html
import io
import json
import re

import numpy as np
import pytest

from infosieve_fast import cli
from infosieve_fast.analysis.gallery import AT_MARGIN, NEAREST
from infosieve_fast.analysis.run_reader import trainer_from_run
from infosieve_fast.common.labels import NO_LABEL
from infosieve_fast.config.settings import load_config
from infosieve_fast.data.writing.layout_discovery import read_discovery
from infosieve_fast.training.checkpoint import load_checkpoint, save_checkpoint
from infosieve_fast.training.run_folder import train
from tests.test_engine import SMOKE
from tests.test_own_images_route import KNOWN, NOVEL, own_images

METHODS = ("gcd", "simgcd", "selex")
PROTOTYPES = "method_heads.prototypes.last_layer.weight_v"


@pytest.fixture(scope="module")
def folder(realdata, tmp_path_factory):
    """(the discovery folder, its shards): test_own_images_route's `own_images`, 2 known and 2 novel classes."""
    base = tmp_path_factory.mktemp("methods-discovery")
    own_images(realdata, base)
    return base / "mine", base / "shards"


def _config(method: str, shards, epochs: int):
    return load_config(
        "configs/demo.yaml",
        [*SMOKE[3:], f"schedule.epochs={epochs}", "data.source=shards", f"data.shards={shards}", "data.batch_size=32",
         "model.backbone_kwargs={in_chans: 3}", "kmeans.n_clusters=4", "data.mean=[0.5, 0.5, 0.5]",
         "data.std=[0.25, 0.25, 0.25]", "train.device=cpu", "train.max_steps_per_epoch=1",
         "checkpoint.best=kmeans_objective", f"method={method}"],
    )  # fmt: skip


@pytest.fixture(scope="module", params=METHODS)
def run(request, folder, tmp_path_factory):
    """(method, its finished run on `folder`). A from-scratch network puts every image on one SimGCD prototype after a
    few steps, so its run is stopped after epoch 1 of 2, its prototypes set to the features of one image of each
    class (2 labelled, 2 from the pool) and resumed: its final clusters are its head's, in known and novel clusters."""
    method, (root, shards) = request.param, folder
    path = tmp_path_factory.mktemp(method) / "run"
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with quiet[0], quiet[1]:
        if method != "simgcd":
            train(_config(method, shards, 1), path)
            return method, path
        train(_config(method, shards, 2), path, stop_after=lambda epoch: epoch == 0)
        names = read_discovery(root).train_names
        picks = [names.index(next(n for n in names if n.startswith(p))) for p in
                 (*(f"labelled/{c}/" for c in KNOWN), *(f"unlabelled/more/{c}_" for c in NOVEL))]  # fmt: skip
        fs = trainer_from_run(path).evaluator.features("test")
        state = load_checkpoint(path)
        state["model"][PROTOTYPES] = fs.feats[[fs.uq.tolist().index(u) for u in picks]].clone()
        save_checkpoint(path, state)
        train(load_config(path / "config.yaml"), path, resume=True)
    return method, path


def _pool(path) -> dict[int, int]:
    """{uq: final cluster} of the pool images (clustering.npz)."""
    with np.load(path / "clustering.npz") as z:
        pool = z["targets"] == NO_LABEL
        return dict(zip(z["uq"][pool].tolist(), z["preds"][pool].tolist(), strict=True))


def test_the_report_shows_every_cluster_and_the_nearest_known_classes_without_a_tree(run, capsys):
    method, path = run
    fs = trainer_from_run(path).evaluator.features("test")  # L2-normalised backbone features, test view
    feats = dict(zip(fs.uq.tolist(), fs.feats.double().numpy(), strict=True))
    state = load_checkpoint(path)
    centers = state["centers"].double().numpy()
    pool = _pool(path)
    if method == "simgcd":  # the head's clusters: the largest cosine to a prototype; the prototypes are the centres
        weight = state["model"][PROTOTYPES].double().numpy()
        prototypes = weight / np.linalg.norm(weight, axis=1, keepdims=True)
        assert np.allclose(centers, prototypes, atol=1e-6)
        assert all(pool[u] == int(np.argmax(prototypes @ feats[u])) for u in pool)
    members = {k: sorted(u for u in pool if pool[u] == k) for k in set(pool.values())}
    novel = sorted((k for k in members if k >= len(KNOWN)), key=lambda k: (-len(members[k]), k))
    assert novel, f"{method}: no novel cluster holds a pool image, so the test shows no hint"
    capsys.readouterr()
    assert cli.main(["report", "--run", str(path)]) == 0
    assert "note:" not in capsys.readouterr().out  # nothing to act on: no tree to ask for, the gallery drawn
    page = (path / "report.html").read_text()
    sections = re.findall(r'<section class="cluster" id="cluster-(\d+)">(.*?)</section>', page)
    assert [int(k) for k, _ in sections] == novel + sorted(k for k in members if k < len(KNOWN))
    for k, body in sections:  # the thumbnails, computed here from the features and the centres
        k = int(k)
        dist = {u: np.linalg.norm(feats[u] - centers, axis=1) for u in members[k]}
        near = sorted(members[k], key=lambda u: (dist[u][k], u))[:NEAREST]
        margin = {u: np.delete(dist[u], k).min() - dist[u][k] for u in members[k]}
        rest = sorted((u for u in members[k] if u not in near), key=lambda u: (margin[u], u))[:AT_MARGIN]
        assert [int(u) for u in re.findall(r'src="report/thumbs/(\d{8})\.jpg"', body)] == near + rest
    for k in novel:  # the hints: the known classes by centre distance, by hand
        dist = np.linalg.norm(centers[: len(KNOWN)] - centers[k], axis=1)
        hint = ", ".join(f"{KNOWN[c]} {dist[c]:.2f}" for c in np.argsort(dist, kind="stable"))
        want = f"novel: {len(members[k])} pool images; nearest known (feature centres): {hint}</p>"
        assert want in dict(sections)[str(k)]
    assert "; prefix " not in page and "implicit category tree" not in page  # no place in a tree, no tree drawn
    assert not (path / "report" / "tree.png").exists()
    assert html.escape(f"Method {method} learns no codes, so no cluster has a place in the category tree") in page
    assert html.escape(f"no category tree: method {method} learns no codes") in page
    made = f"method {method}'s prototype head" if method == "simgcd" else "SS-k-means on the L2-normalised backbone"
    assert html.escape(f"The clusters come from {made}") in page


@pytest.mark.parametrize("run", ["gcd"], indirect=True)  # one method: the best checkpoint's read is shared code
def test_the_report_of_the_best_checkpoint_has_its_gallery_and_no_tree(run):
    method, path = run
    best = trainer_from_run(path, "best").evaluate_full().unlabelled_table(len(KNOWN))
    pool = best["targets"] == NO_LABEL
    clusters = sorted(set(best["preds"][pool].tolist()))
    assert cli.main(["report", "--run", str(path), "--checkpoint", "best"]) == 0
    page = (path / "report.html").read_text()
    shown = sorted(int(k) for k in re.findall(r'<section class="cluster" id="cluster-(\d+)">', page))
    assert shown == clusters and "checkpoint: <b>best (kmeans_objective" in page
    assert "implicit category tree" not in page


def test_named_clusters_are_exported_as_the_next_rounds_known_classes(run, folder, tmp_path, capsys):
    method, path = run
    root, _ = folder
    pool = _pool(path)
    sizes = {k: sum(c == k for c in pool.values()) for k in range(len(KNOWN), 4)}
    named = max(sizes, key=lambda k: (sizes[k], -k))  # the largest novel cluster
    assert cli.main(["name", "--run", str(path), f"novel-{named}=Sparrow"]) == 0
    out = tmp_path / "next"
    capsys.readouterr()
    assert cli.main(["export", "--run", str(path), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    names = read_discovery(root).train_names
    moved = sorted(names[u].removeprefix("unlabelled/") for u, k in pool.items() if k == named)
    nxt = read_discovery(out)
    assert nxt.class_names == sorted([*KNOWN, "Sparrow"])
    assert sorted(n.removeprefix("labelled/Sparrow/") for n in nxt.train_names if "/Sparrow/" in n) == moved
    left = sorted(n for n in names if n.startswith("unlabelled/") and n.removeprefix("unlabelled/") not in moved)
    assert sorted(n for n in nxt.train_names if n.startswith("unlabelled/")) == left
    assert summary["named"] == {"Sparrow": len(moved)} and summary["unlabelled"] == len(left) == 48 - len(moved)
