"""bench_kernels and its runner, the pieces the CPU can run: the work model per mode, the rates against a datasheet,
the case order, the three modes, a capture check's comparison with the fused call (with the PyTorch twins standing in
for the kernels), and the JSON written after every case."""

import argparse
import json

import pytest
import torch

from benchmarks import bench_kernels, datasheet, kernel_roofline, kernel_runner
from infosieve_kernels import reference


def test_rates_against_the_work_and_the_datasheet_by_hand():
    work = {"bytes": 6.7e9, "flops": 2.4735e12}  # 1 ms at 6,700 GB/s and 2,473.5 TFLOP/s
    h100 = datasheet.card("NVIDIA H100 80GB HBM3")
    rates = kernel_roofline.achieved(work, 2.0, h100)  # 2 ms: half those rates
    assert rates == {"gb_per_s": 3350.0, "hbm_util": 1.0, "tflops": 1236.75, "tf32_peak_util": 2.5}
    assert kernel_roofline.achieved({"bytes": 1e9, "flops": None}, 1.0, None) == {"gb_per_s": 1000.0, "hbm_util": None}


def test_code_head_work_counts_every_array_the_op_reads_and_writes():
    """Forward: x, y read, the reference's [N, L] outputs written; backward: two saved [N, L] arrays read back (x and y,
    or what stands for them), one gradient per output read, dx and dy written; full: both."""
    n, length = 8, 5
    x, y = torch.randn(n, length), torch.randn(n, length)
    w = reference.positional_weights(length, 1.5)
    outputs = [o for o in reference.code_head(x, y, 1.0, w, w) if o.shape == (n, length)]
    arrays = {"forward": 2 + len(outputs), "backward": 2 + len(outputs) + 2}
    arrays["full"] = arrays["forward"] + arrays["backward"]
    for mode, count in arrays.items():
        assert kernel_roofline.code_head_work(n, length, mode=mode)["bytes"] == count * n * length * 4, mode
    assert kernel_roofline.code_head_work(n, length) == kernel_roofline.code_head_work(n, length, mode="full")


def test_contrastive_work_splits_into_forward_and_backward():
    """Each of the two losses reads F and does one Gram-sized product forward; reads F, writes dF and does one
    product backward."""
    n, d = 6, 3
    fwd, bwd, full = (kernel_roofline.contrastive_work(n, d, mode=m) for m in ("forward", "backward", "full"))
    assert (fwd["bytes"], bwd["bytes"], full["bytes"]) == (2 * n * d * 4, 4 * n * d * 4, 6 * n * d * 4)
    assert (fwd["flops"], bwd["flops"], full["flops"]) == (2 * 2 * n * n * d, 2 * 2 * n * n * d, 4 * 2 * n * n * d)


def test_training_shapes_run_first_and_every_case_runs_once():
    order = [(c.op.group, tuple(c.shape.values())) for c in bench_kernels.cases(quick=False)]
    training = [("code_head", (256, 40)), ("contrastive", (256, 40)), ("contrastive", (256, 65536))]
    assert order[:3] == training
    assert [c.training for c in bench_kernels.cases(quick=False)] == [True] * 3 + [False] * (len(order) - 3)
    expected = {("code_head", (n, 40)) for n in bench_kernels.CODE_N}
    expected |= {("contrastive", (n, d)) for n in bench_kernels.CON_N for d in bench_kernels.CON_D}
    assert len(order) == len(set(order)) and set(order) == expected


def cpu_bench() -> kernel_runner.Bench:
    args = argparse.Namespace(reps=3, rep_ms=0.0, warmup_ms=0.0, no_compile=True)
    return kernel_runner.Bench(torch.device("cpu"), kernel_runner.Budget(60.0), args, None, {})


def small_code_head() -> kernel_runner.Inputs:
    return bench_kernels.code_head_inputs(torch.device("cpu"), N=16, L=40)


def test_the_backward_mode_replays_one_forward_and_gives_the_full_modes_gradients():
    inputs = small_code_head()
    calls = []

    def counted(*args):
        calls.append(1)
        return reference.code_head(*args)

    steps = kernel_runner.steps(counted, inputs)
    full = steps["full"]()
    assert len(calls) == 1 and all(x.grad is None for x in inputs.wrt)  # gradients returned, never accumulated
    for _ in range(3):
        backward = steps["backward"]()
    assert len(calls) == 2  # one forward for every backward call
    for got, want in zip(backward, full, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert isinstance(steps["forward"](), reference.CodeHead) and len(calls) == 3


def test_a_timed_variant_has_every_mode_with_its_own_rates():
    case = bench_kernels.code_head_case(16)
    inputs = small_code_head()
    result = kernel_runner.run_variant("eager", reference.code_head, inputs, None, cpu_bench())
    result = kernel_runner.with_rates(result, case, None)
    for mode, entry in (("full", result), ("forward", result["forward"]), ("backward", result["backward"])):
        assert entry["runs"] == 3 and entry["ms_min"] <= entry["ms"], mode
        want = kernel_roofline.code_head_work(16, 40, mode=mode)["bytes"] / (entry["ms"] / 1e3) / 1e9
        assert entry["gb_per_s"] == pytest.approx(want, abs=0.006), mode  # rounded to 2 places


@pytest.mark.parametrize(("scale", "diff"), [(1.0, 0.0), (2.0, 1.0)])
def test_a_capture_check_reports_its_distance_from_the_fused_gradients(scale, diff):
    """A stand-in "compiled" call equal to the fused one differs by 0; one giving twice the gradients by 1 (|2g - g|
    over max |g|)."""
    inputs = small_code_head()
    fused_grads = kernel_runner.steps(reference.code_head, inputs)["full"]

    def scaled(*args):
        return tuple(scale * o for o in reference.code_head(*args))

    result = kernel_runner.run_variant("fused_compiled", scaled, inputs, fused_grads, cpu_bench())
    assert result["max_rel_diff_vs_fused"] == pytest.approx(diff, abs=1e-12)
    assert result["graph_breaks"] == 0 and result["graph_break_reasons"] == []
    assert result["runs"] == 3 and result["launches"] is None and "forward" not in result


def test_graph_breaks_are_counted_with_their_reasons(monkeypatch):
    counters = {"graph_break": {"a reason": 2}}
    monkeypatch.setattr(torch._dynamo.utils, "counters", counters)
    before = kernel_runner.graph_breaks()
    counters["graph_break"] = {"a reason": 3, "another reason": 1}
    assert kernel_runner.breaks_since(before) == {
        "graph_breaks": 2,
        "graph_break_reasons": ["a reason", "another reason"],
    }


@pytest.mark.parametrize(("variant", "failed"), [("fused", True), ("compiled", True), ("fused_graph", False)])
def test_only_a_failed_timing_fails_the_run(variant, failed):
    ok = {"ms": 1.0}
    case = {"variants": {"fused": ok, "eager": ok, "compiled": ok, "fused_graph": ok, "fused_compiled": ok}}
    case["variants"][variant] = {"error": "RuntimeError: capture failed"}
    assert kernel_runner.measurement_failed({"code_head": [case], "contrastive": []}) is failed


def test_the_json_is_written_after_every_case(tmp_path, monkeypatch):
    """Each case's results reach the file as soon as it ends (a run cut by a time limit keeps them), under its group
    with its shape keys; the final write holds them all."""
    small = [bench_kernels.code_head_case(8), bench_kernels.contrastive_case(8, 4)]
    writes = []
    real_emit = kernel_runner.emit_json

    def emit(results, path, **kw):
        real_emit(results, path, **kw)
        writes.append(json.loads(open(path).read()))

    monkeypatch.setattr(kernel_runner, "emit_json", emit)
    out = tmp_path / "kernels.json"
    argv = ["--device", "cpu", "--json", str(out), "--reps", "3", "--rep-ms", "0", "--no-compile"]
    assert kernel_runner.main(lambda quick: small, argv) == 0
    assert [(len(w["code_head"]), len(w["contrastive"])) for w in writes] == [(1, 0), (1, 1), (1, 1)]
    final = writes[-1]
    assert {k: final["code_head"][0][k] for k in ("N", "L")} == {"N": 8, "L": 40}
    assert {k: final["contrastive"][0][k] for k in ("N", "D")} == {"N": 8, "D": 4}
    assert "ms" in final["contrastive"][0]["variants"]["eager"]["backward"]
    assert final["meta"]["argv"] == argv and "commit" in final and "tree_hash" in final
