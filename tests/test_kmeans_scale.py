"""Semi-supervised k-means at scale: no allocation grows with N x K or N x D beyond the row-chunk budget, k-means++
batching across restarts does not change the seeds, and the benchmark's ``time_round`` and ``--scale cpu200k`` round
measure the library call."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import infosieve_fast.kmeans as km
from benchmarks import bench_kmeans
from benchmarks.bench_kmeans import scale_features, time_round
from infosieve_fast.kmeans import semi_supervised_kmeans

N, D, K = 6000, 32, 40
MODES = {
    "plain": {},
    "reference_unbalanced": {"balance": "reference"},
    "reference": {"balanced": True, "balance": "reference"},
    "capacity": {"balanced": True},
}


def largest_allocation(fn) -> int:
    """Bytes of the largest allocation made by any single torch op while ``fn`` runs (CPU profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


@pytest.fixture(scope="module")
def half_features():
    return scale_features(N, D, K, "cpu", torch.float16, noise=0.1)


@pytest.mark.parametrize("mode", list(MODES))
def test_no_allocation_of_order_n_k_or_of_the_upcast_features(monkeypatch, half_features, mode):
    # the large-problem paths (no stored [N, K] matrix), 500-row chunks: the largest allocation is k-means++'s
    # [N, n_init] fp64 work array (capped by _KPP_ARRAY_BYTES), the balancing passes' sort of the n_init restarts'
    # [n_init * N] labels (int64 keys and indices) or a [chunk, max(K, D)] block, never [N, K] nor the upcast (or any
    # copy) of the half-precision features
    monkeypatch.setattr(km, "_CAPACITY_MATRIX_MAX", 0)
    u, l, t = half_features
    n_u, n_init, chunk = u.shape[0], 3, 500
    kw = dict(n_init=n_init, max_iter=3, seed=0, chunk_size=chunk, **MODES[mode])
    biggest = largest_allocation(lambda: semi_supervised_kmeans(u, l, t, K, **kw))
    assert biggest <= max(n_u * n_init * 16, chunk * max(K, D) * 8)
    assert biggest < min(n_u * K * 4, n_u * D * 2)


@pytest.mark.parametrize("mode", ["plain", "reference"])
def test_kpp_batching_across_restarts_keeps_the_seeds(monkeypatch, half_features, mode):
    # restarts share k-means++ passes kpp_batch at a time; one restart per pass must give the same clustering
    u, l, t = half_features
    kw = dict(n_init=3, max_iter=3, seed=4, **MODES[mode])
    together = semi_supervised_kmeans(u, l, t, K, **kw)
    monkeypatch.setattr(km, "_KPP_ARRAY_BYTES", 1)  # -> one restart per k-means++ pass
    alone = semi_supervised_kmeans(u, l, t, K, **kw)
    assert torch.equal(together.labels, alone.labels) and together.inertia == alone.inertia


RSS_COUNTER_SLACK = 2**20  # bytes


def test_time_round_measures_the_library_call():
    rec = time_round(3000, 16, 20, "cpu", n_init=2, max_iter=3, distance_precision="bf16")
    u, l, t = scale_features(3000, 16, 20, "cpu", torch.float16)  # the same synthetic features (same seed)
    ref = semi_supervised_kmeans(u, l, t, 20, n_init=2, max_iter=3, balanced=True, balance="reference",
                                 distance_precision="bf16")  # fmt: skip
    json.dumps(rec)
    assert (rec["n"], rec["n_unlabelled"], rec["n_labelled"], rec["feature_bytes"]) == (
        3000, len(u), len(l), 3000 * 16 * 2,
    )  # fmt: skip
    assert (rec["inertia"], rec["n_iter"], rec["rechecked_rows"]) == (ref.inertia, ref.n_iter, ref.rechecked_rows)
    # the kernel syncs each thread's RSS count lazily, so the CPU's measure of a call that adds next to nothing can
    # fall a few pages below zero (-12,288 bytes once in CI); far more than that would be a wrong measure
    assert rec["seconds"] > 0 and rec["peak_bytes_beyond_features"] >= -RSS_COUNTER_SLACK


def test_the_cpu200k_round_reports_its_seconds_and_peak_memory(tmp_path):
    """docs/scale.md's k-means round (`--scale cpu200k --n-init 1`: balanced reference, fp32 search), at a tiny
    --shape: one run, the library's clustering, its seconds and memory in the JSON file."""
    argv = ["--scale", "cpu200k", "--shape", "2000,16,20", "--n-init", "1", "--max-iter", "3",
            "--json", str(tmp_path / "km.json")]  # fmt: skip
    (run,) = bench_kmeans.main(argv)["runs"]
    assert (run["n_init"], run["k"], run["max_iter"], run["d"]) == (1, 20, 3, 16)
    assert (run["balanced"], run["balance"], run["distance_precision"]) == (True, "reference", "fp32")
    u, l, t = scale_features(2000, 16, 20, "cpu", torch.float16)  # the same synthetic features (same seed)
    ref = semi_supervised_kmeans(u, l, t, 20, n_init=1, max_iter=3, balanced=True, balance="reference")
    assert (run["inertia"], run["n_iter"]) == (ref.inertia, ref.n_iter)
    assert run["seconds"] > 0 and run["peak_bytes_beyond_features"] >= 0
    assert json.loads((tmp_path / "km.json").read_text())["runs"] == [json.loads(json.dumps(run))]
