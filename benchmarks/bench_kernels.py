#!/usr/bin/env python3
"""Forward+backward time and peak memory of the fused Triton kernels against the eager and the `torch.compile`d
PyTorch reference (issue 3, "Benchmarks"). Writes JSON; no thresholds are asserted here.

Cases:
- code head (`kernels.code_head`): pre-activations [N, L], L = 40, N in {256, 1,024, 4,096, 16,384, 65,536, 1M};
  the backward takes a gradient on every output (code_raw, mask, code, trunc_code and the three loss terms);
- contrastive: InfoNCE (T = 1, smoothing 0.5) + SupCon (tau = 0.07, labels with -1 = unlabelled rows) on features
  [N, D], N in {256, ..., 65,536}, D in {40, 256, 65,536}, where they fit: a combination whose estimated memory or
  time does not fit is recorded as {"skipped": reason}, and so is one that runs out of memory.

Variants: `fused` (the Triton modules `kernels/code_head_triton.py` and `kernels/contrastive_triton.py`, called
directly), `eager` (`kernels.reference`), `compiled` (`torch.compile(reference)`), and two checks that the fused
kernels can be captured: `fused_graph` (the fused forward+backward captured once in a CUDA graph and replayed: the
device's time with no host work per call) and `fused_compiled` (`torch.compile` around the fused call, at the
training shapes only; `graph_breaks` counts where dynamo fell back to Python, `graph_break_reasons` says why). Both
report `max_rel_diff_vs_fused` against the eager fused gradients. On the CPU only `eager` runs (Triton-interpreter
timings mean nothing; `--quick` is the CPU smoke run). A missing Triton module is reported as "unavailable: ...",
never a crash. A time budget (`--budget-s`, default 210 s on CUDA) keeps the whole run short: the training shapes of
both groups run first (code head N = 256; contrastive N = 256 at D = 40 and 65,536), then the code head at N = 1M
and the contrastive losses at N = 65,536, D = 256; cases left when it is spent are "skipped: time budget spent".

Each timed variant reports `ms` (device time per forward+backward), `host_ms` (the host's time to issue one call:
close to `ms`, the call is overhead-bound), `launches` (device operations per call, from the CUDA profiler) and,
against each case's `work` (`benchmarks/kernel_roofline.py`: the bytes and FLOPs any implementation must move and
do), `gb_per_s` and `hbm_util` (share of the card's datasheet HBM bandwidth), plus `tflops` and `tf32_peak_util`
for the contrastive losses (their products run as TF32 on tensor cores).

    python -m benchmarks.bench_kernels --device cuda --json benchmarks/results/nvidia-h200-kernels.json
    python -m benchmarks.bench_kernels --device cpu --quick --json /tmp/kernels-cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import infosieve_kernels as kernels
from benchmarks import datasheet, kernel_roofline, smoke
from benchmarks.harness import Stopwatch, call_times, sync, timed
from benchmarks.tools.provenance import device_name, emit_json, versions
from infosieve_fast.common.precision import set_cuda_matmul_tf32
from infosieve_kernels import reference

L = 40
CODE_N = [256, 1024, 4096, 16384, 65536, 1 << 20]
CON_N = [256, 1024, 4096, 16384, 65536]
CON_D = [40, 256, 65536]
QUICK_CODE_N = [256, 4096]
QUICK_CON = [(64, 40), (256, 256)]
TRAINING_CODE_N = [256]  # 2 views x 128 samples
TRAINING_CON = [(256, 40), (256, 65536)]  # the code branch (L = 40) and the projection (65,536)
LARGE_FIRST = [("code_head", 1 << 20), ("contrastive", (65536, 256))]  # memory- and compute-bound, run next
EAGER_NN_FLOATS = 32  # N x N fp32 temporaries alive at the eager contrastive peak (forward + backward), an upper guess
MEM_FRACTION = 0.8  # of the free GPU memory a case may plan to use
# pessimistic, for skipping slow cases
SUSTAINED_FLOPS = {"fused": 150e12, "fused_compiled": 150e12, "compiled": 40e12, "eager": 40e12}
MAX_CASE_S = 20.0  # estimated seconds a variant of one case may take (warm-up + timed runs)


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.clock = seconds, Stopwatch()

    def left(self) -> float:
        return self.seconds - self.clock.seconds()


@dataclass(frozen=True)
class Bench:
    """What every case runs under: the device, the time budget left, the command's timing settings, the card's
    datasheet figures (None on the CPU or for a card not tabulated)."""

    device: torch.device
    budget: Budget
    args: argparse.Namespace
    card: datasheet.Card | None


def fused_status(module: str) -> str | None:
    """None if `kernels.<module>` imports, else why it is unavailable."""
    try:
        importlib.import_module(f"infosieve_kernels.{module}")
    except Exception as exc:  # a missing or broken module is a result, not a crash
        return f"unavailable: kernels/{module}.py: {type(exc).__name__}: {exc}"
    return None


def measure(step, device: torch.device, budget: Budget, reps: int, min_time_s: float) -> dict:
    """Warm up (compiles happen here), then time `step` (forward+backward), the host's time to issue it, its launches
    and its peak memory."""
    with timed(device) as first:
        step()

    def enough(seconds: list[float]) -> bool:
        return sum(seconds) >= min_time_s and len(seconds) >= 3 or budget.left() < 0

    # a second warm-up call: autotuners and allocator settle
    calls = call_times(step, device, warmup=1, repeats=reps, until=enough)
    return {
        "ms": statistics.median(calls.seconds) * 1e3,
        "ms_min": min(calls.seconds) * 1e3,
        "host_ms": statistics.median(calls.host_seconds) * 1e3,
        "runs": len(calls.seconds),
        "first_call_s": round(first.seconds, 3),
        "peak_mib": peak_mib(step, device),
        "launches": kernel_roofline.count_launches(step, device),
    }


def peak_mib(step, device: torch.device) -> float | None:
    """The memory one call allocates beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    sync(device)
    return round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 2)


def precheck(device, budget: Budget, est_s: float, est_bytes: float) -> str | None:
    """Why a variant should not run (before its inputs exist), or None."""
    if budget.left() <= 0:
        return "time budget spent"
    if est_s * (2 + 3) > min(MAX_CASE_S, budget.left()):
        return f"too slow for the time budget: about {est_s:.2g} s per step estimated"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if est_bytes > MEM_FRACTION * free:
            return f"does not fit: about {est_bytes / 2**30:.1f} GiB estimated, {free / 2**30:.1f} GiB free"
    return None


def run_variant(name: str, grads_of: dict, bench: Bench) -> dict:
    """Time one variant; the capture checks also compare their gradients with the eager fused call's."""
    device, args = bench.device, bench.args
    if bench.budget.left() <= 0:
        return {"skipped": "time budget spent"}
    try:
        if name == "fused_graph":
            step, got = kernel_roofline.captured(grads_of["fused"], device)
        else:
            step, got = grads_of[name], None
        breaks_before = graph_breaks()
        result = measure(step, device, bench.budget, args.reps, args.min_time_s)
        if name == "fused_compiled":
            result.update(breaks_since(breaks_before))
            got = step()
        if got is not None:
            result["max_rel_diff_vs_fused"] = kernel_roofline.max_rel_diff(got, grads_of["fused"]())
        return result
    except torch.OutOfMemoryError as exc:
        return {"skipped": f"out of memory: {str(exc).splitlines()[0]}"}
    except Exception as exc:  # report the failure of one variant and go on with the rest
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks so far in this process, by reason."""
    return dict(torch._dynamo.utils.counters["graph_break"])


def breaks_since(before: dict[str, int]) -> dict:
    """The graph breaks added since `before`: their count, and the first reasons (what to fix for a whole graph)."""
    added = {reason: n - before.get(reason, 0) for reason, n in graph_breaks().items() if n > before.get(reason, 0)}
    return {"graph_breaks": sum(added.values()), "graph_break_reasons": [r[:300] for r in list(added)[:5]]}


def run_case(result: dict, plan: dict, estimates: dict, make_inputs, bench: Bench) -> dict:
    """Skip what cannot run, make the inputs only if something can, run the rest; add the rates and ratios."""
    reasons = {name: why or precheck(bench.device, bench.budget, *estimates[name]) for name, why in plan.items()}
    grads_of = make_inputs() if any(why is None for why in reasons.values()) else {}
    for name, why in reasons.items():
        variant = {"skipped": why} if why else run_variant(name, grads_of, bench)
        if "ms" in variant:
            variant.update(kernel_roofline.achieved(result["work"], variant["ms"], bench.card))
        result["variants"][name] = variant
    result["ratios"] = ratios(result)
    return result


def ratios(result: dict) -> dict:
    fused = result["variants"].get("fused", {})
    out = {}
    for other in ("eager", "compiled", "fused_compiled", "fused_graph"):
        o = result["variants"].get(other, {})
        if "ms" in fused and "ms" in o and fused["ms"] > 0:
            out[f"{other}_over_fused_time"] = round(o["ms"] / fused["ms"], 3)
        if fused.get("peak_mib") and o.get("peak_mib"):
            out[f"{other}_over_fused_memory"] = round(o["peak_mib"] / fused["peak_mib"], 3)
    return out


def variants_for(
    device: torch.device, fused_missing: str | None, compile_ok: bool, training_shape: bool
) -> dict[str, str | None]:
    """{variant: None to run it, or why it is skipped}, in the order they run: the quick ones first, the two that
    compile last, so that a time budget spent on compiling costs the fewest measurements."""
    if device.type != "cuda":
        return {
            "fused": "CPU run: Triton-interpreter timings mean nothing",
            "fused_graph": "CPU run: CUDA graphs need CUDA",
            "eager": None,
            "compiled": "CPU run: reference timings only" if compile_ok else "--no-compile",
            "fused_compiled": "CPU run: the fused kernels need CUDA",
        }
    compiled_fused = None if training_shape else "run at the training shapes only (it compiles for each shape)"
    return {
        "fused": fused_missing,
        "fused_graph": fused_missing,
        "eager": None,
        "compiled": None if compile_ok else "--no-compile",
        "fused_compiled": fused_missing or (compiled_fused if compile_ok else "--no-compile"),
    }


def same_estimate(estimates: dict) -> dict:
    """The capture checks cost what the fused call costs."""
    return {**estimates, "fused_graph": estimates["fused"], "fused_compiled": estimates["fused"]}


# ---------------------------------------------------------------------------------------------- code head


def code_head_case(n: int, bench: Bench, plan: dict, compiled_fn) -> dict:
    device = bench.device

    def fused(*a):
        return importlib.import_module("infosieve_kernels.code_head_triton").code_head(*a)

    fns = {"fused": fused, "eager": reference.code_head, "compiled": compiled_fn}
    fns["fused_compiled"] = torch.compile(fused)

    def make_inputs():
        gen = torch.Generator(device=device).manual_seed(n)
        code_feat = torch.randn(n, L, generator=gen, device=device).requires_grad_(True)
        mask_feat = torch.randn(n, L, generator=gen, device=device).requires_grad_(True)
        code_weight = kernels.positional_weights(L, 1.5, device=device)
        length_weight = kernels.positional_weights(L, 2.0, device=device)
        grads = [torch.randn(n, L, generator=gen, device=device) for _ in range(4)]
        grads += [torch.ones((), device=device)] * 3  # the three loss terms

        def make(fn):
            def grads_of():
                out = fn(code_feat, mask_feat, 1.0, code_weight, length_weight)  # age 1
                return list(torch.autograd.grad(list(out), [code_feat, mask_feat], grads))

            return grads_of

        return {name: make(fn) for name, fn in fns.items()}

    est_bytes = 4 * n * L * 20  # inputs, 4 outputs, their gradients and saved tensors, generously
    estimates = same_estimate(dict.fromkeys(fns, (est_bytes / 1e12 + 1e-4, est_bytes)))
    result = {"N": n, "L": L, "work": kernel_roofline.code_head_work(n, L), "variants": {}}
    return run_case(result, plan, estimates, make_inputs, bench)


# ---------------------------------------------------------------------------------------------- contrastive


def contrastive_loss(info_nce, supcon):
    def loss(features, labels):
        return info_nce(features, 1.0, 0.5, False) + supcon(features, labels, 0.07, 0.07, False)

    return loss


def contrastive_case(n: int, d: int, bench: Bench, plan: dict, compiled_fn) -> dict:
    device = bench.device
    fused = contrastive_loss(
        lambda *a: importlib.import_module("infosieve_kernels.contrastive_triton").info_nce_loss(*a),
        lambda *a: importlib.import_module("infosieve_kernels.contrastive_triton").supcon_loss(*a),
    )
    fns = {
        "fused": fused,
        "eager": contrastive_loss(reference.info_nce_loss, reference.supcon_loss),
        "compiled": compiled_fn,
        "fused_compiled": torch.compile(fused),
    }

    def make_inputs():
        gen = torch.Generator(device=device).manual_seed(n * 7 + d)
        b = n // 2
        labels = torch.randint(0, max(b // 8, 2), (b,), generator=gen, device=device)
        labels[torch.rand(b, generator=gen, device=device) < 0.4] = -1  # unlabelled: out of this SupCon term
        labels = labels.repeat(2)
        features = torch.randn(n, d, generator=gen, device=device)
        features = torch.nn.functional.normalize(features, dim=1).requires_grad_(True)

        def make(fn):
            def grads_of():
                return list(torch.autograd.grad(fn(features, labels), [features]))

            return grads_of

        return {name: make(fn) for name, fn in fns.items()}

    feat_bytes = 4 * n * d
    gram_flops = 2.0 * n * n * d
    estimates = {
        name: (
            6 * gram_flops / SUSTAINED_FLOPS[name] + 1e-4,  # 2 losses x (1 forward + 2 backward) Gram-sized GEMMs
            4 * feat_bytes + (64 * 4 * n if name.startswith("fused") else EAGER_NN_FLOATS * 4 * n * n),
        )
        for name in fns
    }
    result = {"N": n, "D": d, "work": kernel_roofline.contrastive_work(n, d), "variants": {}}
    return run_case(result, plan, same_estimate(estimates), make_inputs, bench)


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="OUT", help="write the results here, after every case (else printed)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run (CPU)")
    parser.add_argument("--budget-s", type=float, default=None, help="time budget (default 210 s on CUDA, 60 s on CPU)")
    parser.add_argument("--reps", type=int, default=20, help="timed runs per case at most (default 20)")
    parser.add_argument(
        "--min-time-s", type=float, default=0.2, help="stop timing a case after this much (with 3 runs)"
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: 1 with --quick, else torch's)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 in the eager/compiled matmuls (default: off)")
    parser.add_argument("--only", choices=["code_head", "contrastive"], help="run one of the two groups")
    args = smoke.shrink(parser.parse_args(argv), quick=True, budget_s=5.0, reps=3, no_compile=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU")
    return args


def run_meta(args, device: torch.device, argv, forced: str | None) -> dict:
    """What the run measured on and how."""
    return {
        "device": device_name(device),
        **versions("triton"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:] if argv is None else argv,
        "quick": args.quick,
        "cpu_threads": torch.get_num_threads(),
        "allow_tf32_eager": args.tf32,
        "ignored_env": {kernels.ENV_VAR: forced} if forced else {},
        "timing": "median of CUDA-event times of forward+backward after 2 warm-up calls"
        if device.type == "cuda"
        else "median wall time of forward+backward after 2 warm-up calls",
        "peak_mib": "torch.cuda.max_memory_allocated during one step, minus what was allocated before it",
        "datasheet_source": datasheet.SOURCE,
    }


def run_cases(bench: Bench, results: dict, on_case: Callable[[], None]) -> None:
    """Every case in `case_order`, appended to its group's list as it finishes; `on_case()` after each."""
    args, device = bench.args, bench.device
    groups = [g for g in ("code_head", "contrastive") if args.only in (None, g)]
    compile_reference = device.type == "cuda" and not args.no_compile
    compiled = {g: torch.compile(REFERENCES[g]) if compile_reference else None for g in groups}
    for group, shape in case_order(args.quick):
        if group not in groups:
            continue
        training = shape in (TRAINING_CODE_N if group == "code_head" else TRAINING_CON)
        plan = variants_for(device, fused_status(f"{group}_triton"), not args.no_compile, training)
        if group == "code_head":
            results[group].append(code_head_case(shape, bench, plan, compiled[group]))
        else:
            results[group].append(contrastive_case(*shape, bench, plan, compiled[group]))
        _progress(results[group][-1])
        on_case()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    forced = os.environ.pop(kernels.ENV_VAR, None)  # each variant names its backend; an override would blur them
    set_cuda_matmul_tf32(args.tf32)
    if args.threads or args.quick:  # a few busy shared cores: OpenMP spinning can make tiny CPU ops 100x slower
        torch.set_num_threads(args.threads or 1)
    budget = Budget(args.budget_s if args.budget_s is not None else (210.0 if device.type == "cuda" else 60.0))
    meta = run_meta(args, device, argv, forced)
    bench = Bench(device, budget, args, datasheet.card(meta["device"]) if device.type == "cuda" else None)
    meta["datasheet"] = dataclasses.asdict(bench.card) if bench.card else None
    results = {"meta": meta, "code_head": [], "contrastive": []}

    def write_so_far() -> None:  # a run cut short by a time limit keeps every case it finished
        meta["budget_left_s"] = round(budget.left(), 1)
        if args.json:
            emit_json(results, args.json, indent=2, echo=False)

    run_cases(bench, results, write_so_far)
    meta["budget_left_s"] = round(budget.left(), 1)

    emit_json(results, args.json, indent=2, echo=not args.json)
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if measurement_failed(results) else 0


def measurement_failed(results: dict) -> bool:
    """Whether a timing failed. A capture check that failed is a finding, kept in the JSON, and fails nothing."""
    measured = ("fused", "eager", "compiled")
    cases = [r for group in ("code_head", "contrastive") for r in results[group]]
    return any("error" in r["variants"].get(v, {}) for r in cases for v in measured)


REFERENCES = {
    "code_head": reference.code_head,
    "contrastive": contrastive_loss(reference.info_nce_loss, reference.supcon_loss),
}


def case_order(quick: bool) -> list[tuple[str, object]]:
    """(group, shape) in the order they run: the training shapes of both groups first, then the rest."""
    if quick:
        return [("code_head", n) for n in QUICK_CODE_N] + [("contrastive", c) for c in QUICK_CON]
    first = [("code_head", n) for n in TRAINING_CODE_N] + [("contrastive", c) for c in TRAINING_CON] + LARGE_FIRST
    rest = [("code_head", n) for n in CODE_N] + [("contrastive", (n, d)) for n in CON_N for d in CON_D]
    return first + [case for case in rest if case not in first]


def _progress(result: dict) -> None:
    shape = " ".join(f"{k}={result[k]}" for k in ("N", "L", "D") if k in result)
    cells = []
    for name, v in result["variants"].items():
        if "ms" in v:
            mem = f", {v['peak_mib']:.0f} MiB" if v.get("peak_mib") is not None else ""
            cells.append(f"{name} {v['ms']:.3f} ms{mem}")
        else:
            cells.append(f"{name}: {v.get('skipped') or v.get('error')}")
    ratio = " ".join(f"{k}={v}" for k, v in result.get("ratios", {}).items())
    print(f"{shape}: " + "; ".join(cells) + (f" [{ratio}]" if ratio else ""), file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
