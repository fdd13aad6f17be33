"""The runner under `bench_kernels.py`'s case declarations: each `Case` is an `Op` (a fused kernel call and its PyTorch
twin) at one shape; the runner times its variants in three modes and writes the JSON after every case.

Variants: `fused` (the Triton call), `eager` (the twin) and `compiled` (`torch.compile(twin)`, CUDA only), each in the
modes `forward`, `backward` (the backward alone, replayed on one retained graph) and `full` (forward + backward); then
two checks that the fused call can be captured, full mode only: `fused_graph` (forward + backward captured once in a
CUDA graph and replayed: the device's time with no host work per call) and `fused_compiled` (`torch.compile` around
the fused call, at the training shapes only; `graph_breaks` counts where dynamo fell back to Python,
`graph_break_reasons` says why), each with `max_rel_diff_vs_fused` against the fused gradients. On the CPU only
`eager` runs (Triton-interpreter timings mean nothing).

Timing: `triton.testing.do_bench` on CUDA (the median, min and count of its runs, the L2 cache flushed before each;
`host_ms` from a few more calls by the host's clock), `benchmarks/harness.py`'s CPU timer otherwise. A variant's
fields are its full mode's: `ms`, `ms_min`, `host_ms`, `runs`, `first_call_s`, `peak_mib`, `launches` and, against the
case's `work` (`benchmarks/kernel_roofline.py`: the bytes and FLOPs any implementation must move and do),
`gb_per_s`, `hbm_util` and, for matrix products, `tflops` and `tf32_peak_util`; its `forward` and `backward` entries
hold the same fields against their own mode's work. A case whose estimated time or memory does not fit, or that runs
out of memory, is recorded as {"skipped": reason}; a time budget (`--budget-s`) skips what is left once it is spent.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton.testing

import infosieve_kernels as kernels
from benchmarks import datasheet, kernel_roofline, smoke
from benchmarks.harness import Stopwatch, call_times, sync, timed
from benchmarks.tools.provenance import device_name, emit_json, versions
from infosieve_fast.common.precision import set_cuda_matmul_tf32

MODES = ("forward", "backward", "full")
TIMED = ("fused", "eager", "compiled")  # timed in every mode; a failure of one fails the run
CAPTURE_CHECKS = ("fused_graph", "fused_compiled")  # full mode; a failure is a finding, kept in the JSON
CALLS_PER_VARIANT = 16  # a slow case's calls of one full step: first call, do_bench's estimate, warm-up and timed runs
MAX_CASE_S = 20.0  # estimated seconds a variant of one case may take
MEM_FRACTION = 0.8  # of the free GPU memory a case may plan to use
HOST_CALLS = 5  # CUDA: calls timed by the host's clock for `host_ms`


@dataclass
class Inputs:
    args: tuple  # the op's arguments
    wrt: list[torch.Tensor]  # what the gradients are taken for
    grads: list[torch.Tensor] | None  # the upstream gradient of each output (None: a scalar loss)


@dataclass(frozen=True)
class Op:
    """A fused kernel call and its PyTorch twin, each `fn(*Inputs.args)` -> a tensor or a tuple of tensors."""

    group: str  # the JSON list its cases land in
    fused: Callable
    reference: Callable
    inputs: Callable[..., Inputs]  # (device, **shape)
    work: Callable[..., dict]  # (mode, **shape): the work model of `kernel_roofline`
    cost: Callable[..., tuple[float, float]]  # (variant, **shape): (estimated seconds per full step, bytes)


@dataclass(frozen=True)
class Case:
    op: Op
    shape: dict  # {"N": 256, "L": 40}: the case's keys in the JSON
    training: bool = False  # a training shape: the only ones `fused_compiled` runs at


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.clock = seconds, Stopwatch()

    def left(self) -> float:
        return self.seconds - self.clock.seconds()


@dataclass(frozen=True)
class Bench:
    """What every case runs under: the device, the time budget left, the command's settings, the card's datasheet
    figures (None on the CPU or for a card not tabulated), and each op's compiled twin (None where none runs)."""

    device: torch.device
    budget: Budget
    args: argparse.Namespace
    card: datasheet.Card | None
    compiled: dict[str, Callable | None]


def outputs_of(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


def steps(fn: Callable, inputs: Inputs) -> dict[str, Callable[[], object]]:
    """{mode: the call that mode times}; the backward replays one forward's graph, kept alive until the next call of
    `steps`."""
    retained = []

    def forward():
        return fn(*inputs.args)

    def backward():
        if not retained:
            retained.append(outputs_of(forward()))
        return torch.autograd.grad(retained[0], inputs.wrt, inputs.grads, retain_graph=True)

    def full():
        return list(torch.autograd.grad(outputs_of(forward()), inputs.wrt, inputs.grads))

    return {"forward": forward, "backward": backward, "full": full}


def measure(step: Callable[[], object], bench: Bench) -> dict:
    """Time `step` after its first call (compiles happen there): do_bench on CUDA, the CPU timer otherwise; then its
    host time, peak memory and launches."""
    device, args = bench.device, bench.args
    with timed(device) as first:
        step()
    if device.type == "cuda":
        ms = triton.testing.do_bench(step, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="all")
        host_s = call_times(step, device, warmup=0, repeats=HOST_CALLS).host_seconds
    else:
        enough = lambda s: sum(s) * 1e3 >= args.rep_ms and len(s) >= 3 or bench.budget.left() < 0  # noqa: E731
        calls = call_times(step, device, warmup=1, repeats=args.reps, until=enough)
        ms, host_s = [s * 1e3 for s in calls.seconds], calls.host_seconds
    return {
        "ms": statistics.median(ms),
        "ms_min": min(ms),
        "host_ms": statistics.median(host_s) * 1e3,
        "runs": len(ms),
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


def precheck(bench: Bench, est_s: float, est_bytes: float) -> str | None:
    """Why a variant should not run (before its inputs exist), or None."""
    if bench.budget.left() <= 0:
        return "time budget spent"
    if est_s * CALLS_PER_VARIANT > min(MAX_CASE_S, bench.budget.left()):
        return f"too slow for the time budget: about {est_s:.2g} s per step estimated"
    if bench.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(bench.device)
        if est_bytes > MEM_FRACTION * free:
            return f"does not fit: about {est_bytes / 2**30:.1f} GiB estimated, {free / 2**30:.1f} GiB free"
    return None


def plan(case: Case, bench: Bench) -> dict[str, str | None]:
    """{variant: None to run it, or why it is skipped}, in the order they run: the compiling ones last, so that a
    time budget spent on compiling costs the fewest measurements."""
    no_compile = "--no-compile" if bench.args.no_compile else None
    if bench.device.type != "cuda":
        return {
            "fused": "CPU run: Triton-interpreter timings mean nothing",
            "fused_graph": "CPU run: CUDA graphs need CUDA",
            "eager": None,
            "compiled": no_compile or "CPU run: reference timings only",
            "fused_compiled": "CPU run: the fused kernels need CUDA",
        }
    shapes = None if case.training else "run at the training shapes only (it compiles for each shape)"
    return {
        "fused": None,
        "fused_graph": None,
        "eager": None,
        "compiled": no_compile,
        "fused_compiled": no_compile or shapes,
    }


def callables(case: Case, bench: Bench) -> dict[str, Callable]:
    op = case.op
    return {
        "fused": op.fused,
        "eager": op.reference,
        "compiled": bench.compiled[op.group],
        "fused_compiled": torch.compile(op.fused),
    }


def run_variant(name: str, fn: Callable, inputs: Inputs, fused_grads: Callable | None, bench: Bench) -> dict:
    """One variant: every mode of a timed one, the full step of a capture check (compared with the fused gradients)."""
    try:
        if name in TIMED:
            by_mode = {mode: measure(step, bench) for mode, step in steps(fn, inputs).items()}
            return {**by_mode.pop("full"), **by_mode}
        if name == "fused_graph":
            step, got = kernel_roofline.captured(fused_grads, bench.device)
            result = measure(step, bench)
        else:
            before = graph_breaks()
            step = steps(fn, inputs)["full"]
            result = measure(step, bench)
            result.update(breaks_since(before))
            got = step()
        return result | {"max_rel_diff_vs_fused": kernel_roofline.max_rel_diff(got, fused_grads())}
    except torch.OutOfMemoryError as exc:
        return {"skipped": f"out of memory: {str(exc).splitlines()[0]}"}
    except Exception as exc:  # report the failure of one variant and go on with the rest
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    finally:
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks so far in this process, by reason."""
    return dict(torch._dynamo.utils.counters["graph_break"])


def breaks_since(before: dict[str, int]) -> dict:
    """The graph breaks added since `before`: their count, and the first reasons (what to fix for a whole graph)."""
    added = {reason: n - before.get(reason, 0) for reason, n in graph_breaks().items() if n > before.get(reason, 0)}
    return {"graph_breaks": sum(added.values()), "graph_break_reasons": [r[:300] for r in list(added)[:5]]}


def with_rates(result: dict, case: Case, card: datasheet.Card | None) -> dict:
    """`result` with each timed mode's rates against that mode's work."""
    if "ms" in result:
        result.update(kernel_roofline.achieved(case.op.work("full", **case.shape), result["ms"], card))
    for mode in ("forward", "backward"):
        if "ms" in result.get(mode, {}):
            result[mode].update(kernel_roofline.achieved(case.op.work(mode, **case.shape), result[mode]["ms"], card))
    return result


def run_case(case: Case, bench: Bench) -> dict:
    """Skip what cannot run, make the inputs only if something can, run the rest; add the rates and ratios."""
    reasons = {
        name: why or precheck(bench, *case.op.cost(name, **case.shape)) for name, why in plan(case, bench).items()
    }
    result = {**case.shape, "work": case.op.work("full", **case.shape), "variants": {}}
    inputs = case.op.inputs(bench.device, **case.shape) if any(why is None for why in reasons.values()) else None
    fns = callables(case, bench)
    fused_grads = steps(case.op.fused, inputs)["full"] if inputs is not None else None
    for name, why in reasons.items():
        if why is None and bench.budget.left() <= 0:
            why = "time budget spent"
        variant = {"skipped": why} if why else run_variant(name, fns.get(name), inputs, fused_grads, bench)
        result["variants"][name] = with_rates(variant, case, bench.card)
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


def measurement_failed(results: dict) -> bool:
    """Whether the timing of a timed variant failed. A capture check that failed is a finding, kept in the JSON, and
    fails nothing."""
    cases = [r for group in ("code_head", "contrastive") for r in results[group]]
    return any("error" in r["variants"].get(v, {}) for r in cases for v in TIMED)


def parse_args(argv, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="OUT", help="write the results here, after every case (else printed)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run (CPU)")
    parser.add_argument("--budget-s", type=float, default=None, help="time budget (default 210 s on CUDA, 60 s on CPU)")
    # shorter than do_bench's 25 / 100 ms: gpu_check's kernels step has 15 s for 5 variants x 3 modes per case
    parser.add_argument("--warmup-ms", type=float, default=10.0, help="do_bench's warm-up time per mode (CUDA)")
    parser.add_argument("--rep-ms", type=float, default=50.0, help="time of the timed runs per mode (default 50)")
    parser.add_argument("--reps", type=int, default=20, help="CPU: timed runs per mode at most (default 20)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: 1 with --quick, else torch's)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 in the eager/compiled matmuls (default: off)")
    parser.add_argument("--only", choices=["code_head", "contrastive"], help="run one of the two groups")
    args = smoke.shrink(parser.parse_args(argv), quick=True, budget_s=5.0, reps=3, rep_ms=1.0, no_compile=True)
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
        "modes": "a variant's fields time forward + backward; its forward and backward entries time each alone "
        "(the backward replayed on one retained graph)",
        "timing": "median of triton.testing.do_bench's runs (L2 flushed before each) after the first call"
        if device.type == "cuda"
        else "median wall time after 2 warm-up calls",
        "peak_mib": "torch.cuda.max_memory_allocated during one call, minus what was allocated before it",
        "datasheet_source": datasheet.SOURCE,
    }


def main(cases: Callable[[bool], list[Case]], argv=None, description: str = "") -> int:
    """Run `cases(quick)` in order, each group's results appended to its list and the JSON written after every case."""
    args = parse_args(argv, description)
    device = torch.device(args.device)
    forced = os.environ.pop(kernels.ENV_VAR, None)  # each variant names its backend; an override would blur them
    set_cuda_matmul_tf32(args.tf32)
    if args.threads or args.quick:  # a few busy shared cores: OpenMP spinning can make tiny CPU ops 100x slower
        torch.set_num_threads(args.threads or 1)
    budget = Budget(args.budget_s if args.budget_s is not None else (210.0 if device.type == "cuda" else 60.0))
    selected = [c for c in cases(args.quick) if args.only in (None, c.op.group)]
    compile_twins = device.type == "cuda" and not args.no_compile
    compiled = {c.op.group: torch.compile(c.op.reference) if compile_twins else None for c in selected}
    meta = run_meta(args, device, argv, forced)
    bench = Bench(device, budget, args, datasheet.card(meta["device"]) if device.type == "cuda" else None, compiled)
    meta["datasheet"] = dataclasses.asdict(bench.card) if bench.card else None
    results = {"meta": meta, **{group: [] for group in ("code_head", "contrastive")}}
    for case in selected:
        results[case.op.group].append(run_case(case, bench))
        progress(results[case.op.group][-1])
        meta["budget_left_s"] = round(budget.left(), 1)
        if args.json:  # a run cut short by a time limit keeps every case it finished
            emit_json(results, args.json, indent=2, echo=False)
    emit_json(results, args.json, indent=2, echo=not args.json)
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if measurement_failed(results) else 0


def progress(result: dict) -> None:
    shape = " ".join(f"{k}={v}" for k, v in result.items() if k in ("N", "L", "D"))
    cells = []
    for name, v in result["variants"].items():
        if "ms" in v:
            modes = "/".join(f"{v[m]['ms']:.3f}" if "ms" in v.get(m, {}) else "-" for m in ("forward", "backward"))
            mem = f", {v['peak_mib']:.0f} MiB" if v.get("peak_mib") is not None else ""
            cells.append(
                f"{name} {v['ms']:.3f} ms (fwd/bwd {modes}){mem}" if name in TIMED else f"{name} {v['ms']:.3f} ms"
            )
        else:
            cells.append(f"{name}: {v.get('skipped') or v.get('error')}")
    ratio = " ".join(f"{k}={v}" for k, v in result.get("ratios", {}).items())
    print(f"{shape}: " + "; ".join(cells) + (f" [{ratio}]" if ratio else ""), file=sys.stderr, flush=True)
