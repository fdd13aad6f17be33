"""An epoch's peak memory for its log line: the CUDA allocator's on a GPU, the process's resident set on the CPU."""

from __future__ import annotations

from pathlib import Path

import torch


def reset_peak_memory(device: torch.device) -> bool:
    """Start an epoch's peak memory: the CUDA allocator's peak on a GPU, this process's peak resident set (Linux's
    VmHWM) on the CPU. False where the peak cannot be reset (then no peak is logged: it would not be the epoch's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # "5" resets VmHWM to the current resident set
    except OSError:  # not Linux, or not permitted here
        return False
    return True


def peak_memory(device: torch.device) -> dict:
    """The log line's peak memory of this process since `reset_peak_memory`: `peak_gpu_bytes`
    (torch.cuda.max_memory_allocated) on a GPU, `peak_rss_bytes` (VmHWM) on the CPU. Under DDP: rank 0's."""
    if device.type == "cuda":
        return {"peak_gpu_bytes": torch.cuda.max_memory_allocated(device)}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return {"peak_rss_bytes": int(line.split()[1]) * 1024}  # the kernel reports kB (KiB)
    return {}
