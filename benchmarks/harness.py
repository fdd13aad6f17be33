"""What the benchmark scripts share to time work, the one place their timing code lives:

- `call_times(fn, device, warmup, repeats)`: per-call times of a repeated call after its warm-up; on CUDA between
  CUDA events (`cuda_call_times`), on the CPU by the host's wall clock (`cpu_call_times`);
- `timed(device)`: a block's wall seconds, the device synchronised before and after it (`sync`);
- `Stopwatch`: the host's wall clock since a start, for what is not one block (a deadline, a running total).

Per-call times are taken here rather than with `triton.testing.do_bench` (which `kernel_runner.py` uses for the kernel
calls on CUDA, and this CPU timer elsewhere): the timed calls here are whole training steps and k-means rounds, do_bench
flushes the L2 cache before every call (a cold-cache figure), picks its repeat count from a time target instead of a
benchmark's `--reps` and time budget, and gives no host-side issue time.

Provenance and JSON output: `benchmarks/tools/provenance.py` (`stamp`, `emit_json`, `device_name`, `versions`); sizes
for CI in `benchmarks/smoke.py`. A CPU benchmark's JSON opens with `cpu_report` (provenance, the command, the machine
and its load) and is closed by `finish_cpu_report`.

Every benchmark runs from the repository root as a module: `python -m benchmarks.<name> ...`.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from benchmarks.tools.provenance import device_name, emit_json, stamp, versions


def sync(device: torch.device) -> None:
    """Wait until the work queued on `device` has run (CUDA kernels run after the call that queued them returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """The host's wall clock (`time.perf_counter`) since the stopwatch was made."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.started


@dataclass
class Timing:
    seconds: float = 0.0  # set when the timed block ends


@contextmanager
def timed(device: torch.device | None = None) -> Iterator[Timing]:
    """Wall seconds of the block, with the device synchronised before and after it, so that neither the work queued
    before the block nor the work the block queued is missed (no device: the host's clock alone):

        with timed(device) as clock:
            work()
        clock.seconds
    """
    timing = Timing()
    if device is not None:
        sync(device)
    clock = Stopwatch()
    yield timing
    if device is not None:
        sync(device)
    timing.seconds = clock.seconds()


@dataclass
class CallTimes:
    seconds: list[float]  # per call: between CUDA events on a GPU, the host's wall clock on the CPU
    host_seconds: list[float]  # per call: the host's time to issue it (on the CPU, the same as `seconds`)


Until = Callable[[list[float]], bool] | None  # `until(seconds per call so far)`: True ends the timing early


def call_times(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int, until: Until = None
) -> CallTimes:
    """`warmup` calls of `fn` (compiles, autotuners and the allocator settle there), then `repeats` timed calls, or
    fewer once `until(seconds per call so far)` is true: a `CallTimes`."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        return cuda_call_times(fn, device, repeats, until)
    return cpu_call_times(fn, repeats, until)


def cpu_call_times(fn: Callable[[], object], repeats: int, until: Until = None) -> CallTimes:
    """Each call's wall seconds by the host's clock."""
    seconds: list[float] = []
    for _ in range(repeats):
        clock = Stopwatch()
        fn()
        seconds.append(clock.seconds())
        if until is not None and until(seconds):
            break
    return CallTimes(seconds, seconds)


def cuda_call_times(fn: Callable[[], object], device: torch.device, repeats: int, until: Until = None) -> CallTimes:
    """Each call's seconds between the CUDA events recorded before and after it, and the host's time to issue it.
    Without `until` the calls are queued back to back (one call's end event is the next one's start) and the host
    waits once, at the end: the steady state of a loop. With `until` the host waits for each call to read its time,
    so every call starts on an idle device and its time includes the wait for its first launch."""
    seconds: list[float] = []
    host: list[float] = []
    pairs = []
    start = None
    for _ in range(repeats):
        end = torch.cuda.Event(enable_timing=True)
        if start is None:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        clock = Stopwatch()
        fn()
        host.append(clock.seconds())
        end.record()
        pairs.append((start, end))
        start = end if until is None else None
        if until is not None:
            end.synchronize()
            seconds.append(pairs[-1][0].elapsed_time(end) / 1e3)
            if until(seconds):
                break
    sync(device)
    return CallTimes([a.elapsed_time(b) / 1e3 for a, b in pairs], host)


class ItemLog:
    """The losses a published loop reads with `loss.item()` after every step (a host sync each, as published);
    `last()` checks every one finite and returns the last. `what` names the loop in the error."""

    def __init__(self, what: str):
        self.what, self.values = what, []

    def record(self, loss: torch.Tensor) -> None:
        self.values.append(loss.item())

    def last(self) -> float:
        if not all(math.isfinite(v) for v in self.values):
            raise RuntimeError(f"{self.what}: non-finite loss")
        return self.values[-1]


def at(report: dict, path: str):
    """The value at a dotted `path` of a result (nested dicts), None where it is absent."""
    value = report
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def throughput(images: int, seconds: float) -> dict:
    """The JSON record of `images` processed in `seconds`."""
    return {"images": images, "seconds": round(seconds, 3), "images_per_s": round(images / seconds, 1)}


def cpu_report(script: str, argv: list[str] | None) -> dict:
    """The opening of a CPU benchmark's JSON: provenance, the device, the command as run (`argv`, or this process's
    arguments when None), torch's version and the machine with its load average at the start."""
    args = sys.argv[1:] if argv is None else argv
    return {
        **stamp(),
        "device": device_name(torch.device("cpu")),
        "command": " ".join(["python", "-m", f"benchmarks.{script}", *args]),
        "torch": versions()["torch"],
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_at_start": round(os.getloadavg()[0], 2),
            "platform": platform.platform(),
        },
    }


def finish_cpu_report(report: dict, summary: dict, started: Stopwatch, out: str | None) -> dict:
    """`report` (from `cpu_report`) completed: the load average at the end, the total seconds on `started` (made
    when the benchmark began), and `summary` right after commit, dirty and device; printed, and written to `out`."""
    report["summary"] = summary
    report["machine"]["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    report["total_seconds"] = round(started.seconds(), 1)
    report = {k: report[k] for k in ("commit", "dirty", "device", "summary")} | report
    emit_json(report, out)
    return report
