"""bench_kernels' pieces that the CPU can run: the work model, the rates against a datasheet, the case order, and a
capture check's comparison with the fused call (with the PyTorch twins standing in for the kernels)."""

import argparse

import pytest
import torch

from benchmarks import bench_kernels, datasheet, kernel_roofline
from infosieve_kernels import reference


def test_rates_against_the_work_and_the_datasheet_by_hand():
    work = {"bytes": 6.7e9, "flops": 2.4735e12}  # 1 ms at 6,700 GB/s and 2,473.5 TFLOP/s
    h100 = datasheet.card("NVIDIA H100 80GB HBM3")
    rates = kernel_roofline.achieved(work, 2.0, h100)  # 2 ms: half those rates
    assert rates == {"gb_per_s": 3350.0, "hbm_util": 1.0, "tflops": 1236.75, "tf32_peak_util": 2.5}
    assert kernel_roofline.achieved({"bytes": 1e9, "flops": None}, 1.0, None) == {"gb_per_s": 1000.0, "hbm_util": None}


def test_code_head_work_counts_every_array_the_op_reads_and_writes():
    """Forward: x, y read, the reference's [N, L] outputs written; backward: two saved [N, L] arrays read back (x and y,
    or what stands for them), one gradient per output read, dx and dy written."""
    n, length = 8, 5
    x, y = torch.randn(n, length), torch.randn(n, length)
    w = reference.positional_weights(length, 1.5)
    outputs = [o for o in reference.code_head(x, y, 1.0, w, w) if o.shape == (n, length)]
    arrays = (2 + len(outputs)) + (2 + len(outputs) + 2)
    assert kernel_roofline.code_head_work(n, length)["bytes"] == arrays * n * length * 4


def test_training_shapes_run_first_and_every_case_runs_once():
    order = bench_kernels.case_order(quick=False)
    training = [("code_head", n) for n in bench_kernels.TRAINING_CODE_N]
    training += [("contrastive", c) for c in bench_kernels.TRAINING_CON]
    assert order[: len(training)] == training
    expected = {("code_head", n) for n in bench_kernels.CODE_N}
    expected |= {("contrastive", (n, d)) for n in bench_kernels.CON_N for d in bench_kernels.CON_D}
    assert len(order) == len(set(order)) and set(order) == expected


def code_head_grads(scale: float):
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(16, 6, generator=gen).requires_grad_(True) for _ in range(2))
    w = reference.positional_weights(6, 1.5)
    grads = [torch.randn(16, 6, generator=gen) for _ in range(4)] + [torch.ones(())] * 3

    def grads_of():
        out = reference.code_head(x, y, 1.0, w, w)
        return [scale * g for g in torch.autograd.grad(list(out), [x, y], grads)]

    return grads_of


@pytest.mark.parametrize(("scale", "diff"), [(1.0, 0.0), (2.0, 1.0)])
def test_a_capture_check_reports_its_distance_from_the_fused_gradients(scale, diff):
    """A stand-in "compiled" call equal to the fused one differs by 0; one giving twice the gradients by 1 (|2g - g|
    over max |g|)."""
    args = argparse.Namespace(reps=3, min_time_s=0.0)
    bench = bench_kernels.Bench(torch.device("cpu"), bench_kernels.Budget(60.0), args, None)
    grads_of = {"fused": code_head_grads(1.0), "fused_compiled": code_head_grads(scale)}
    result = bench_kernels.run_variant("fused_compiled", grads_of, bench)
    assert result["max_rel_diff_vs_fused"] == pytest.approx(diff, abs=1e-12)
    assert result["graph_breaks"] == 0 and result["graph_break_reasons"] == []
    assert result["runs"] == 3 and result["launches"] is None


def test_graph_breaks_are_counted_with_their_reasons(monkeypatch):
    counters = {"graph_break": {"a reason": 2}}
    monkeypatch.setattr(torch._dynamo.utils, "counters", counters)
    before = bench_kernels.graph_breaks()
    counters["graph_break"] = {"a reason": 3, "another reason": 1}
    assert bench_kernels.breaks_since(before) == {
        "graph_breaks": 2,
        "graph_break_reasons": ["a reason", "another reason"],
    }



@pytest.mark.parametrize(("variant", "failed"), [("fused", True), ("compiled", True), ("fused_graph", False)])
def test_only_a_failed_timing_fails_the_run(variant, failed):
    ok = {"ms": 1.0}
    case = {"variants": {"fused": ok, "eager": ok, "compiled": ok, "fused_graph": ok, "fused_compiled": ok}}
    case["variants"][variant] = {"error": "RuntimeError: capture failed"}
    assert bench_kernels.measurement_failed({"code_head": [case], "contrastive": []}) is failed
