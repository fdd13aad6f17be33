"""`benchmarks/bench_epoch_scale.py` run tiny on the CPU: the window, the loader and the projection arithmetic, and
the JSON written after every phase."""

import json

import pytest

from benchmarks import bench_epoch_scale
from benchmarks.bench_epoch_scale import IMAGENET1K_TRAIN, main

PHASES = [
    "shards", "loader", "compile", "feature_pass", "kmeans_at_this_n", "window", "projection", "loader_other_decode"
]  # fmt: skip

TINY = [
    "--device", "cpu", "--n", "96", "--classes", "8", "--size", "64", "--crop", "32", "--batch", "16",
    "--feature-batch", "32", "--steps", "8", "--warmup", "2", "--loader-batches", "4", "--backbone", "resnet10t",
    "--workers", "1", "--set", "model.grad_from_block=null", "--set", "model.proj_out_dim=256",
    "--set", "model.proj_hidden_dim=128", "--set", "model.proj_bottleneck_dim=64", "--set", "kmeans.n_init=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("epoch") / "shards"  # written by the first run, reused by the second


def test_tiny_run_projects_an_imagenet_epoch(tmp_path, shards_dir):
    kmeans = tmp_path / "kmeans.json"
    runs = [{"distance_precision": "bf16", "seconds": 2.0}, {"distance_precision": "fp32", "seconds": 7.5}]
    kmeans.write_text(json.dumps({"runs": runs}))
    out = tmp_path / "epoch.json"
    res = main([*TINY, "--shards-dir", str(shards_dir), "--kmeans-json", str(kmeans), "--json", str(out)])
    assert json.loads(out.read_text()) == res and res["complete"] and res["phases_done"] == PHASES
    assert res["loader_other_decode"] is None  # the CPU has no nvJPEG to compare with
    w, p, s = res["window"], res["projection"], res["summary"]
    assert w["steps"] == 8 and w["epochs_spanned"] >= 2  # 96 // 16 = 6 steps per epoch: the window spans epochs
    assert res["loader"]["images"] == 4 * 16 and res["feature_pass"]["images"] == 96
    assert res["compile"]["compile"] == "eager" and "CPU" in res["compile"]["compile_reason"]  # auto, on the CPU
    assert p["steps"] == IMAGENET1K_TRAIN // 16
    assert p["steps_s"] == pytest.approx(p["steps"] * w["ms_per_step"] / 1000, abs=0.06)
    assert p["feature_pass_s"] == pytest.approx(IMAGENET1K_TRAIN / res["feature_pass"]["images_per_s"], abs=0.06)
    assert p["kmeans_s"] == 7.5 and s["projection_includes_kmeans"]
    assert s["projected_epoch_minutes"] == pytest.approx((p["feature_pass_s"] + p["steps_s"] + 7.5) / 60, abs=0.01)
    assert 0 <= s["loader_wait_fraction"] < 1 and s["gpu_utilisation_mean_percent"] is None
    assert s["loader_vs_train"] == pytest.approx(s["loader_images_per_s"] / s["train_images_per_s"], rel=0.01)


def test_a_run_cut_short_keeps_the_phases_it_finished(tmp_path, shards_dir, monkeypatch):
    def killed(*args):
        raise KeyboardInterrupt("the step's timeout (simulated)")

    monkeypatch.setattr(bench_epoch_scale, "training_window", killed)
    out = tmp_path / "epoch.json"
    with pytest.raises(KeyboardInterrupt):
        main([*TINY, "--shards-dir", str(shards_dir), "--json", str(out)])
    kept = json.loads(out.read_text())
    assert kept["phases_done"] == PHASES[:5] and not kept["complete"] and "window" not in kept
    assert kept["data"]["n_train"] == 96 and kept["feature_pass"]["images"] == 96 and kept["loader"]["images"] == 4 * 16
    assert "loader_other_decode" not in kept and kept["kmeans_at_this_n_s"] >= 0


def test_the_decode_comparison_failing_costs_only_itself(tmp_path, monkeypatch):
    """The comparison runs after the projection is written; an error there is recorded in its own entry."""

    class Source:
        gpu_decode = True  # the run decoded on the GPU: the comparison is the CPU path

    class Trainer:
        source, device = Source(), "cuda"

    def broken(*args, **kwargs):
        raise OSError("/dev/shm: No space left on device (faked)")

    monkeypatch.setattr(bench_epoch_scale, "ShardSource", broken)
    args = bench_epoch_scale.parse_args(TINY)
    got = bench_epoch_scale.other_decode_rate(Trainer(), tmp_path, args)
    assert got == {"decode": "cpu", "error": "OSError: /dev/shm: No space left on device (faked)"}
