"""What the benchmark scripts share to time work on a device: `sync` waits for the device's queued work, `timed`
measures a block's wall seconds with that work included. Provenance and JSON output are in `benchmarks/provenance.py`
(`stamp`, `emit_json`, `device_name`); sizes for CI in `benchmarks/smoke.py`. A CPU benchmark's JSON opens with
`cpu_report` (provenance, the command, the machine and its load) and is closed by `finish_cpu_report`.

Every benchmark runs from the repository root as a module: `python -m benchmarks.<name> ...`.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from benchmarks.provenance import device_name, emit_json, stamp


def sync(device: torch.device) -> None:
    """Wait until the work queued on `device` has run (CUDA kernels run after the call that queued them returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    seconds: float = 0.0  # set when the timed block ends


@contextmanager
def timed(device: torch.device) -> Iterator[Timing]:
    """Wall seconds of the block, with the device synchronised before and after it, so that neither the work queued
    before the block nor the work the block queued is missed:

        with timed(device) as clock:
            work()
        clock.seconds
    """
    timing = Timing()
    sync(device)
    start = time.perf_counter()
    yield timing
    sync(device)
    timing.seconds = time.perf_counter() - start


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
        "torch": torch.__version__,
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_at_start": round(os.getloadavg()[0], 2),
            "platform": platform.platform(),
        },
    }


def finish_cpu_report(report: dict, summary: dict, started: float, out: str | None) -> dict:
    """`report` (from `cpu_report`) completed: the load average at the end, the total seconds since `started`
    (`time.perf_counter()`), and `summary` right after commit, dirty and device; printed, and written to `out`."""
    report["summary"] = summary
    report["machine"]["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    report = {k: report[k] for k in ("commit", "dirty", "device", "summary")} | report
    emit_json(report, out)
    return report
