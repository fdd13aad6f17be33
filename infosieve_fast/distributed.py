"""Small, generic helpers over ``torch.distributed``.

Every helper is a no-op (or the obvious single-process answer) when no process group is initialised, so callers write
one code path for one process and for many. Tensors must live where the backend wants them (CPU for gloo, CUDA for
NCCL); the helpers do not move them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group is initialised with more than zero ranks."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all ranks, in place; returns ``t``."""
    if get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of ``t`` over all ranks, in place; returns ``t``."""
    if get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_reduce_any(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True when ``flag`` is True on any rank (every rank gets the same answer)."""
    if get_world_size() == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    return bool(all_reduce_max(t).item())


def all_gather_cat(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Concatenate ``t`` (first dimension may differ between ranks) over ranks in rank order.

    Returns ``(gathered, offset)`` where ``gathered[offset : offset + len(t)]`` is this rank's ``t``. With one process
    it returns ``(t, 0)`` without copying.
    """
    world = get_world_size()
    if world == 1:
        return t, 0
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes_l = [int(s.item()) for s in sizes]
    n_max = max(sizes_l)
    padded = t.new_zeros((n_max, *t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    gathered = torch.cat([p[:s] for p, s in zip(parts, sizes_l, strict=True)], dim=0)
    rank = get_rank()
    return gathered, sum(sizes_l[:rank])
