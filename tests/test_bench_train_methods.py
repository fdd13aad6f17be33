"""bench_train's method rows (`--methods`, `benchmarks/method_steps.py`) on a tiny CPU case: each method's fast step
computes its published step's loss on the same batch and weights, and the report's rows and ratios (SelEx's row: each
row builds its models three times, and SelEx's has the most parts)."""

import json
import math

import pytest

from benchmarks import bench_train, method_steps
from tests.test_bench_train import TINY, json_path


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "train_methods.json"
    methods = ["--variants", "none", "--methods", "selex"]
    out = bench_train.main([*TINY, "--batch", "8", "--steps", "1", "--warmup", "0", *methods, "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    return out


@pytest.mark.parametrize("method", method_steps.METHODS)
def test_each_methods_fast_step_computes_its_published_loss(method):
    """The first step of both sides, on the same batch, views and weights, in fp32 (the CPU's default): the same loss,
    so the row compares the same method's work."""
    args = bench_train.parse_args([*TINY, "--batch", "8"])
    batch, pseudo, n_old = bench_train.step_batch(args, args.device)
    make = bench_train.method_step_functions(method)
    losses = []
    for variant in ("fast_default", "published_fp32"):
        step, finish, _ = make(args, args.device, variant, batch, pseudo, n_old)
        step()
        losses.append(finish())
    assert math.isfinite(losses[0]) and losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_a_method_has_its_fast_and_published_rows_and_their_speedups(report):
    assert report["step"] == {"flops_per_step": None, "variants": {}}  # --variants none: InfoSieve's rows not run
    assert list(report["methods"]) == ["selex"]
    for method, entry in report["methods"].items():
        assert list(entry["variants"]) == ["fast_default", "published_bf16", "published_fp32"], method
        assert entry["flops_per_step"] > 0
        for name, row in entry["variants"].items():
            assert row["ms_per_step"] > 0 and math.isfinite(row["last_loss"]), (method, name)
            assert row["mfu_measured_gemm"] == pytest.approx(
                entry["flops_per_step"] / (row["ms_per_step"] / 1e3) / (report["bf16_gemm_tflops"] * 1e12)
            )
        assert entry["variants"]["fast_default"]["compile"] == "eager"
        for base in ("published_bf16", "published_fp32"):
            r = entry["summary"][f"step_speedup_vs_{base}"]
            assert r["numerator"] == f"methods.{method}.variants.{base}.ms_per_step"
            assert r["value"] == json_path(report, r["numerator"]) / json_path(report, r["denominator"])


def test_an_unknown_method_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--device", "cpu", "--methods", "gcd,simclr"])
    assert "unknown method(s) ['simclr'] in --methods" in capsys.readouterr().err
