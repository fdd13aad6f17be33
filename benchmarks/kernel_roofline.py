"""What one call of a kernel does on the device, for `bench_kernels.py`: the launches it issues, the rate it reaches
against the work it must do (bytes moved, FLOPs) and that rate's share of the card's datasheet, and the call
captured once in a CUDA graph and replayed, which shows the device's time with no host work per call.

The work is a model, the least any implementation must do: every input read once and every output written once
per pass, and the FLOPs of the matrix products. Time spent above it is overhead: launches, host work, re-reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from benchmarks.datasheet import Card
from benchmarks.harness import sync

# per mode: [N, L] arrays moved by the code head: x, y in, raw, mask, code, trunc out; x, y and 4 grads in, dx, dy out
CODE_HEAD_ARRAYS = {"forward": 6, "backward": 8}
# [N, D] passes over both contrastive losses: each reads F forward, reads F and writes dF backward
CONTRASTIVE_FEATURE_PASSES = {"forward": 2, "backward": 4}
# N x N x D products over both contrastive losses: each the Gram forward and one product backward
CONTRASTIVE_GEMMS = {"forward": 2, "backward": 2}


def in_mode(counts: dict[str, int], mode: str) -> int:
    """A count of one mode, "forward", "backward" or "full" (forward + backward)."""
    return counts["forward"] + counts["backward"] if mode == "full" else counts[mode]


def code_head_work(n: int, length: int, element_bytes: int = 4, mode: str = "full") -> dict:
    arrays = in_mode(CODE_HEAD_ARRAYS, mode)
    return {
        "bytes": arrays * n * length * element_bytes,
        "flops": None,
        "model": f"{arrays} [N, L] arrays read or written once ({mode}); elementwise math only",
    }


def contrastive_work(n: int, d: int, element_bytes: int = 4, mode: str = "full") -> dict:
    passes, gemms = in_mode(CONTRASTIVE_FEATURE_PASSES, mode), in_mode(CONTRASTIVE_GEMMS, mode)
    return {
        "bytes": passes * n * d * element_bytes,
        "flops": gemms * 2 * n * n * d,
        "model": f"InfoNCE + SupCon ({mode}): {passes} [N, D] passes (each loss reads F forward, reads F and writes "
        f"dF backward); {gemms} Gram-sized products (each loss one forward, one backward), 2 N^2 D FLOPs each",
    }


def achieved(work: dict, ms: float, card: Card | None) -> dict:
    """The rates `ms` per call reaches on `work`, and their shares of the card's HBM bandwidth and TF32 peak (null
    without a datasheet entry)."""
    seconds = ms / 1e3
    gb_per_s = work["bytes"] / seconds / 1e9
    hbm = card.hbm_gb_per_s if card else None
    rates = {"gb_per_s": round(gb_per_s, 2), "hbm_util": round(gb_per_s / hbm, 4) if hbm else None}
    if work["flops"]:
        tflops = work["flops"] / seconds / 1e12
        rates["tflops"] = round(tflops, 3)
        rates["tf32_peak_util"] = round(tflops / card.tf32_tflops, 4) if card else None
    return rates


def count_launches(call: Callable[[], object], device: torch.device) -> int | None:
    """Device operations (kernels, copies, fills) one call issues, as the CUDA profiler records them; None on the
    CPU, where there are none."""
    if device.type != "cuda":
        return None
    activity = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[activity.CPU, activity.CUDA]) as prof:
        call()
        sync(device)
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def captured(grads_of: Callable[[], list[Tensor]], device: torch.device) -> tuple[Callable[[], None], list[Tensor]]:
    """`grads_of` captured in a CUDA graph after a warm-up on the side stream the capture then uses (so that per-stream
    library handles and workspaces exist before capture): (a replay callable, the tensors each replay writes its
    gradients into)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            grads_of()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static = grads_of()
    return graph.replay, static


def max_rel_diff(got: list[Tensor], want: list[Tensor]) -> float:
    """The largest |got - want| over the largest |want|, across the gradients."""
    scale = max(float(w.abs().max()) for w in want) or 1.0
    return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) / scale
