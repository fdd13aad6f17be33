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
directly), `eager` (`kernels.reference`), `compiled` (`torch.compile(reference)`). On the CPU only `eager` runs
(Triton-interpreter timings mean nothing; `--quick` is the CPU smoke run). A missing Triton module is reported as
"unavailable: ...", never a crash. A time budget (`--budget-s`, default 210 s on CUDA) keeps the whole run short:
cases left when it is spent are "skipped: time budget spent".

    python -m benchmarks.bench_kernels --device cuda --json benchmarks/results/nvidia-h200-kernels.json
    python -m benchmarks.bench_kernels --device cpu --quick --json /tmp/kernels-cpu.json
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import time

import torch

import infosieve_kernels as kernels
from benchmarks import smoke
from benchmarks.harness import sync
from benchmarks.provenance import emit_json
from infosieve_fast.precision import set_cuda_matmul_tf32
from infosieve_kernels import reference

L = 40
CODE_N = [256, 1024, 4096, 16384, 65536, 1 << 20]
CON_N = [256, 1024, 4096, 16384, 65536]
CON_D = [40, 256, 65536]
QUICK_CODE_N = [256, 4096]
QUICK_CON = [(64, 40), (256, 256)]
PRIORITY_CON = [(256, 65536), (65536, 256)]  # the target shapes run first
EAGER_NN_FLOATS = 32  # N x N fp32 temporaries alive at the eager contrastive peak (forward + backward), an upper guess
MEM_FRACTION = 0.8  # of the free GPU memory a case may plan to use
SUSTAINED_FLOPS = {"fused": 150e12, "compiled": 40e12, "eager": 40e12}  # pessimistic, for skipping slow cases
MAX_CASE_S = 20.0  # estimated seconds a variant of one case may take (warm-up + timed runs)


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()


def fused_status(module: str) -> str | None:
    """None if `kernels.<module>` imports, else why it is unavailable."""
    try:
        importlib.import_module(f"infosieve_kernels.{module}")
    except Exception as exc:  # a missing or broken module is a result, not a crash
        return f"unavailable: kernels/{module}.py: {type(exc).__name__}: {exc}"
    return None


def measure(step, device: torch.device, budget: Budget, reps: int, min_time_s: float) -> dict:
    """Warm up (compiles happen here), then time `step` (forward+backward) and take its peak memory."""
    t0 = time.perf_counter()
    step()
    sync(device)
    first_s = time.perf_counter() - t0
    step()  # a second warm-up: autotuners and allocator settle
    sync(device)
    times = []
    if device.type == "cuda":
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            if sum(times) / 1e3 >= min_time_s and len(times) >= 3 or budget.left() < 0:
                break
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        peak_mib = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        for _ in range(reps):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
            if sum(times) / 1e3 >= min_time_s and len(times) >= 3 or budget.left() < 0:
                break
        peak_mib = None
    return {
        "ms": statistics.median(times),
        "ms_min": min(times),
        "runs": len(times),
        "first_call_s": round(first_s, 3),
        "peak_mib": None if peak_mib is None else round(peak_mib, 2),
    }


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


def run_variant(step, device, budget: Budget, args) -> dict:
    if budget.left() <= 0:
        return {"skipped": "time budget spent"}
    try:
        return measure(step, device, budget, args.reps, args.min_time_s)
    except torch.OutOfMemoryError as exc:
        return {"skipped": f"out of memory: {str(exc).splitlines()[0]}"}
    except Exception as exc:  # report the failure of one variant and go on with the rest
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_case(result: dict, plan: dict, estimates: dict, make_inputs, device, budget: Budget, args) -> dict:
    """Skip what cannot run, make the inputs only if something can, run the rest; add the ratios."""
    reasons = {name: why or precheck(device, budget, *estimates[name]) for name, why in plan.items()}
    steps = make_inputs() if any(why is None for why in reasons.values()) else {}
    for name, why in reasons.items():
        result["variants"][name] = {"skipped": why} if why else run_variant(steps[name], device, budget, args)
    result["ratios"] = ratios(result)
    return result


def ratios(result: dict) -> dict:
    fused = result["variants"].get("fused", {})
    out = {}
    for other in ("eager", "compiled"):
        o = result["variants"].get(other, {})
        if "ms" in fused and "ms" in o and fused["ms"] > 0:
            out[f"{other}_over_fused_time"] = round(o["ms"] / fused["ms"], 3)
        if fused.get("peak_mib") and o.get("peak_mib"):
            out[f"{other}_over_fused_memory"] = round(o["peak_mib"] / fused["peak_mib"], 3)
    return out


def variants_for(device: torch.device, fused_missing: str | None, compile_ok: bool) -> dict[str, str | None]:
    """{variant: None to run it, or why it is skipped}."""
    cpu = device.type != "cuda"
    return {
        "fused": "CPU run: Triton-interpreter timings mean nothing" if cpu else fused_missing,
        "eager": None,
        "compiled": ("CPU run: reference timings only" if cpu else None) if compile_ok else "--no-compile",
    }


# ---------------------------------------------------------------------------------------------- code head


def code_head_case(n: int, device, budget: Budget, args, plan: dict, compiled_fn) -> dict:
    fns = {
        "fused": lambda *a: importlib.import_module("infosieve_kernels.code_head_triton").code_head(*a),
        "eager": reference.code_head,
        "compiled": compiled_fn,
    }

    def make_inputs():
        gen = torch.Generator(device=device).manual_seed(n)
        code_feat = torch.randn(n, L, generator=gen, device=device).requires_grad_(True)
        mask_feat = torch.randn(n, L, generator=gen, device=device).requires_grad_(True)
        code_weight = kernels.positional_weights(L, 1.5, device=device)
        length_weight = kernels.positional_weights(L, 2.0, device=device)
        grads = [torch.randn(n, L, generator=gen, device=device) for _ in range(4)]
        grads += [torch.ones((), device=device)] * 3  # the three loss terms

        def make(fn):
            def step():
                out = fn(code_feat, mask_feat, 1.0, code_weight, length_weight)  # age 1
                torch.autograd.backward(list(out), grads)
                code_feat.grad = mask_feat.grad = None  # freed before the next step's memory baseline

            return step

        return {name: make(fn) for name, fn in fns.items()}

    est_bytes = 4 * n * L * 20  # inputs, 4 outputs, their gradients and saved tensors, generously
    estimates = dict.fromkeys(fns, (est_bytes / 1e12 + 1e-4, est_bytes))
    return run_case({"N": n, "L": L, "variants": {}}, plan, estimates, make_inputs, device, budget, args)


# ---------------------------------------------------------------------------------------------- contrastive


def contrastive_loss(info_nce, supcon):
    def loss(features, labels):
        return info_nce(features, 1.0, 0.5, False) + supcon(features, labels, 0.07, 0.07, False)

    return loss


def contrastive_case(n: int, d: int, device, budget: Budget, args, plan: dict, compiled_fn) -> dict:
    fns = {
        "fused": contrastive_loss(
            lambda *a: importlib.import_module("infosieve_kernels.contrastive_triton").info_nce_loss(*a),
            lambda *a: importlib.import_module("infosieve_kernels.contrastive_triton").supcon_loss(*a),
        ),
        "eager": contrastive_loss(reference.info_nce_loss, reference.supcon_loss),
        "compiled": compiled_fn,
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
            def step():
                fn(features, labels).backward()
                features.grad = None  # freed before the next step's memory baseline

            return step

        return {name: make(fn) for name, fn in fns.items()}

    feat_bytes = 4 * n * d
    gram_flops = 2.0 * n * n * d
    estimates = {
        name: (
            6 * gram_flops / SUSTAINED_FLOPS[name] + 1e-4,  # 2 losses x (1 forward + 2 backward) Gram-sized GEMMs
            4 * feat_bytes + (64 * 4 * n if name == "fused" else EAGER_NN_FLOATS * 4 * n * n),
        )
        for name in fns
    }
    return run_case({"N": n, "D": d, "variants": {}}, plan, estimates, make_inputs, device, budget, args)


# ---------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="OUT", help="write the results here (also printed)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run (CPU)")
    parser.add_argument("--budget-s", type=float, default=None, help="time budget (default 210 s on CUDA, 60 s on CPU)")
    parser.add_argument("--reps", type=int, default=20, help="timed runs per case at most (default 20)")
    parser.add_argument(
        "--min-time-s", type=float, default=0.2, help="stop timing a case after this much (with 3 runs)"
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: 1 with --quick, else torch's)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 in the eager/compiled matmuls (default: off)")
    parser.add_argument("--only", choices=["code_head", "contrastive"], help="run one of the two groups")
    args = smoke.shrink(parser.parse_args(argv), quick=True, budget_s=5.0, reps=3, no_compile=True)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU")
    forced = os.environ.pop(kernels.ENV_VAR, None)  # each variant names its backend; an override would blur them
    set_cuda_matmul_tf32(args.tf32)
    if args.threads or args.quick:  # a few busy shared cores: OpenMP spinning can make tiny CPU ops 100x slower
        torch.set_num_threads(args.threads or 1)
    budget = Budget(args.budget_s if args.budget_s is not None else (210.0 if device.type == "cuda" else 60.0))

    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": platform.python_version(),
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
    }
    results = {"meta": meta, "code_head": [], "contrastive": []}
    code_n = QUICK_CODE_N if args.quick else CODE_N
    con = (
        QUICK_CON if args.quick else PRIORITY_CON + [(n, d) for n in CON_N for d in CON_D if (n, d) not in PRIORITY_CON]
    )

    if args.only in (None, "code_head"):
        plan = variants_for(device, fused_status("code_head_triton"), not args.no_compile)
        compiled = torch.compile(reference.code_head) if plan["compiled"] is None else None
        for n in code_n:
            results["code_head"].append(code_head_case(n, device, budget, args, plan, compiled))
            _progress(results["code_head"][-1])
    if args.only in (None, "contrastive"):
        plan = variants_for(device, fused_status("contrastive_triton"), not args.no_compile)
        compiled = (
            torch.compile(contrastive_loss(reference.info_nce_loss, reference.supcon_loss))
            if plan["compiled"] is None
            else None
        )
        for n, d in con:
            results["contrastive"].append(contrastive_case(n, d, device, budget, args, plan, compiled))
            _progress(results["contrastive"][-1])
    meta["budget_left_s"] = round(budget.left(), 1)

    emit_json(results, args.json, indent=2, echo=not args.json)
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    errors = [v for group in ("code_head", "contrastive") for r in results[group] for v in r["variants"].values()]
    return 1 if any("error" in v for v in errors) else 0


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:
        return None


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
