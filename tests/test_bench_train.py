"""`benchmarks/bench_train.py` on a tiny CPU case: the JSON people and scripts compare runs by, and its numbers."""

import json
import math

import pytest

from benchmarks import bench_train

TINY = [
    "--device", "cpu", "--backbone", "vit_tiny_patch16_224", "--backbone-kwargs", '{"img_size": 32}',
    "--image-size", "40", "--crop", "32", "--proj-out-dim", "256", "--n-classes", "4", "--steps", "2", "--warmup", "1",
    "--variants", "published_fp32,published_bf16,fast_default",
]  # fmt: skip
SUMMARY = (
    "step_speedup_vs_published_fp32 step_speedup_vs_published_bf16 peak_memory_ratio_vs_published_fp32 step_mfu "
    "epoch_seconds published_epoch_seconds projected_200_epochs_minutes"
).split()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "train.json"
    epoch = ["--epoch", "--n-train", "40", "--feature-batch", "16", "--published-feature-batch", "8"]
    out = bench_train.main([*TINY, "--batch", "4", *epoch, "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))  # the file is what was printed
    return out


def test_report_names_its_commit_device_and_summary(report):
    assert set(SUMMARY) <= set(report["summary"])
    assert report["commit"] == "unknown" or len(report["commit"]) == 40
    assert isinstance(report["dirty"], bool) and report["device"].startswith("cpu")
    s, v = report["summary"], report["step"]["variants"]
    assert s["peak_memory_ratio_vs_published_fp32"] is None  # no allocator statistics on the CPU
    assert s["step_speedup_vs_published_fp32"] == v["published_fp32"]["ms_per_step"] / v["fast_default"]["ms_per_step"]
    assert s["step_speedup_vs_published_bf16"] == v["published_bf16"]["ms_per_step"] / v["fast_default"]["ms_per_step"]
    for name, r in v.items():
        assert 0 < r["ms_per_step_min"] <= r["ms_per_step"] <= r["ms_per_step_max"], name
        assert r["images_per_s"] == pytest.approx(4 / (r["ms_per_step"] / 1e3)), name
        assert math.isfinite(r["last_loss"]), name
    flops_per_s = report["step"]["flops_per_step"] / (v["fast_default"]["ms_per_step"] / 1e3)
    assert s["step_mfu"] == pytest.approx(flops_per_s / (report["bf16_gemm_tflops"] * 1e12))


def test_epoch_runs_every_step_on_both_sides(report):
    (epoch,) = report["epoch"]
    assert epoch["steps"] == epoch["published_steps"] == 40 // 4  # drop_last batches of the whole set
    assert report["summary"]["epoch_seconds"] == epoch["epoch_seconds"] > 0
    assert epoch["published_epoch_seconds"] >= epoch["published_epoch_measured_seconds"] > 0  # 1 of 10 restarts run
    assert report["summary"]["projected_200_epochs_minutes"] == pytest.approx(200 * epoch["epoch_seconds"] / 60)


def test_step_flops_are_counted_from_the_model(report):
    """Every matmul of the step scales with the rows it sees, so twice the batch is about twice the FLOPs (the N x N
    contrastive Grams are the only super-linear part, and tiny here)."""
    args = bench_train.parse_args([*TINY, "--batch", "8"])
    batch, pseudo, n_old = bench_train.step_batch(args, args.device)
    double = bench_train.count_step_flops(args, args.device, batch, pseudo, n_old)
    assert double / report["step"]["flops_per_step"] == pytest.approx(2.0, rel=0.02)
