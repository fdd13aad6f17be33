"""What the benchmark scripts share to time work on a device: `sync` waits for the device's queued work, `timed`
measures a block's wall seconds with that work included. Provenance and JSON output are in `benchmarks/provenance.py`
(`stamp`, `emit_json`, `device_name`); sizes for CI in `benchmarks/smoke.py`.

Every benchmark runs from the repository root as a module: `python -m benchmarks.<name> ...`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


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


def throughput(images: int, seconds: float) -> dict:
    """The JSON record of `images` processed in `seconds`."""
    return {"images": images, "seconds": round(seconds, 3), "images_per_s": round(images / seconds, 1)}
