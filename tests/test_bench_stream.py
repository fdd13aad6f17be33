"""`benchmarks/bench_stream.py` run tiny: the summary, exactly-once feature passes, the labelled share recomputed from
the saved draws and the shards themselves, the memory samples, the shard cache. No timing asserts."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from benchmarks import bench_stream
from infosieve_fast.data.reading.sampler import reference_labelled_share

N, CLASSES, BATCH, WORLD, EPOCHS = 1200, 10, 32, 2, 2
TINY = [
    "--n", str(N), "--classes", str(CLASSES), "--shard-size-mb", "0.5", "--batch-size", str(BATCH),
    "--feature-batch-size", "64", "--world", str(WORLD), "--workers", "2", "--epochs", str(EPOCHS),
    "--rss-interval", "0.05", "--pss-interval", "0.2",
]  # fmt: skip
FAST = ["--rank-start", "fork"]  # the default, spawn, costs a fresh interpreter + torch import per rank
SUMMARY = {"exactly_once", "labelled_share_error", "max_rss_mb"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    argv = [
        *TINY,
        *FAST,
        "--shards-dir",
        str(d / "shards"),
        "--out",
        str(d / "stream.json"),
        "--draws",
        str(d / "draws.npz"),
    ]
    report = bench_stream.main(argv)
    return report, d, np.load(d / "draws.npz")


def _shard_truth(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """(labelled flag, target) by uq, read from the tar shards with the standard library."""
    manifest = json.loads((folder / "manifest.json").read_text())
    n = manifest["splits"]["train"]["n"]
    lab, cls = np.full(n, -1), np.full(n, -1)
    for rec in manifest["splits"]["train"]["shards"]:
        fields: dict[str, dict[str, int]] = {}
        with tarfile.open(folder / rec["name"]) as tar:
            for m in tar:
                key, ext = m.name.split(".", 1)
                if ext in ("uq", "lab", "cls"):
                    fields.setdefault(key, {})[ext] = int(tar.extractfile(m).read())
        for f in fields.values():
            lab[f["uq"]], cls[f["uq"]] = f["lab"], f["cls"]
    assert (lab >= 0).all() and (cls >= 0).all()
    return lab.astype(bool), cls


def test_summary_and_provenance(run):
    report, d, _ = run
    assert set(report["summary"]) == SUMMARY
    assert list(report)[:4] == ["commit", "dirty", "device", "summary"]
    assert json.loads((d / "stream.json").read_text()) == json.loads(json.dumps(report))  # the file is what was printed
    assert report["commit"] == "unknown" or len(report["commit"]) == 40
    assert report["dirty"] in (True, False, None) and report["device"].startswith("cpu")
    assert report["summary"]["exactly_once"] is True


def test_every_sample_once_per_feature_pass(run):
    _, _, draws = run
    for e in range(EPOCHS):
        per_rank = [draws[f"feature_uq_e{e}_r{r}"] for r in range(WORLD)]
        assert not set(per_rank[0].tolist()) & set(per_rank[1].tolist())
        assert sorted(np.concatenate(per_rank).tolist()) == list(range(N))


def test_labelled_share_error_recomputed_from_the_draws(run):
    report, _, draws = run
    folder = Path(report["shards"]["dir"])
    lab, cls = _shard_truth(folder)
    target = reference_labelled_share(int(lab.sum()), int((~lab).sum()))
    assert report["stream"]["labelled_share_target"] == pytest.approx(target)
    errors = []
    for e in range(EPOCHS):
        uq = np.concatenate([draws[f"train_uq_e{e}_r{r}"] for r in range(WORLD)])
        flags = np.concatenate([draws[f"train_labelled_e{e}_r{r}"] for r in range(WORLD)])
        targets = np.concatenate([draws[f"train_targets_e{e}_r{r}"] for r in range(WORLD)])
        assert (flags == lab[uq]).all() and (targets == cls[uq]).all()  # the draws carry the shards' bookkeeping
        assert len(uq) == N // (BATCH * WORLD) * BATCH * WORLD
        errors.append(abs(flags.mean() - target))
        assert report["stream"]["epochs"][e]["train"]["labelled_share_error"] == pytest.approx(errors[-1])
    assert report["summary"]["labelled_share_error"] == pytest.approx(max(errors))


def test_ranks_get_the_same_full_batches(run):
    report, _, draws = run
    want = N // (BATCH * WORLD)
    for e in range(EPOCHS):
        sizes = [draws[f"train_batch_sizes_e{e}_r{r}"] for r in range(WORLD)]
        assert [len(s) for s in sizes] == [want] * WORLD and all((s == BATCH).all() for s in sizes)
    checks = report["checks"]
    assert checks["equal_train_batches"] and checks["expected_train_batches"] and checks["full_train_batches"]
    assert checks["metadata_consistent"] and checks["images_match_targets"] and checks["source_sizes"]


def test_memory_is_sampled(run):
    report, _, _ = run
    mem = report["memory"]
    assert report["summary"]["max_rss_mb"] == mem["rss_mb"] > 0
    assert 0 < mem["pss_mb"] <= mem["rss_mb"] and mem["samples"] > 0
    assert mem["processes"] >= 1 + WORLD  # this process and the ranks (workers come and go)
    assert len(mem["epoch_max_rss_mb"]) == EPOCHS and all(x > 0 for x in mem["epoch_max_rss_mb"])
    assert mem["flat"] in (True, False)


def test_shards_are_reused(run, tmp_path):
    """A second run on the same --shards-dir reuses the shards (verified); it starts its ranks the default way."""
    report, d, _ = run
    assert report["shards"]["reused"] is False and report["shards"]["n_shards"] >= 4  # enough to split by shard
    again = bench_stream.main([*TINY, "--shards-dir", str(d / "shards"), "--epochs", "1",
                               "--out", str(tmp_path / "again.json")])  # fmt: skip
    assert again["shards"]["reused"] is True and again["shards"]["dir"] == report["shards"]["dir"]
    assert again["summary"]["exactly_once"] is True and again["stream"]["rank_start"] == "spawn"
    assert again["checks"]["equal_train_batches"] and again["checks"]["metadata_consistent"]
