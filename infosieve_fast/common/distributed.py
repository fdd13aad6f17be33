"""Small, generic helpers over ``torch.distributed``.

Every helper is a no-op (or the obvious single-process answer) when no process group is initialised, so callers write
one code path for one process and for many. Tensors must live where the backend wants them (CPU for gloo, CUDA for
NCCL); the helpers do not move them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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
    """True on the rank that writes files and prints (rank 0; the only process without a group)."""
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


def broadcast_(t: torch.Tensor, src: int, chunk_bytes: int = 256 * 2**20) -> None:
    """Overwrite ``t`` in place with rank ``src``'s (no-op with one process). A CPU tensor under NCCL travels through
    the current CUDA device in chunks of ``chunk_bytes``."""
    if get_world_size() == 1:
        return
    if t.device.type == "cpu" and dist.get_backend() == "nccl":
        flat = t.view(-1).view(torch.uint8)
        for start in range(0, flat.numel(), chunk_bytes):
            part = flat[start : start + chunk_bytes]
            staged = part.to("cuda")
            dist.broadcast(staged, src=src)
            part.copy_(staged)
        return
    dist.broadcast(t, src=src)


def barrier() -> None:
    """Wait for every rank (no-op with one process)."""
    if get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (``obj`` itself with one process)."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` with one process)."""
    if get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Overwrite every buffer of ``module`` with rank ``src``'s (e.g. BatchNorm running statistics, which DDP only
    broadcasts at the start of a training forward, so each rank's last forward leaves its own)."""
    if get_world_size() > 1:
        for buf in module.buffers():
            dist.broadcast(buf, src=src)


def env_world_size() -> int:
    """``WORLD_SIZE`` as set by torchrun (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """``LOCAL_RANK`` as set by torchrun: this process's GPU index on its machine (0 when not launched by it)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_from_env(use_cuda: bool) -> bool:
    """Start the process group torchrun asks for (env ``WORLD_SIZE`` > 1): NCCL with this process on
    ``cuda:LOCAL_RANK`` when ``use_cuda``, else gloo. Returns True when it started one (the caller then owns it and
    ends it with :func:`destroy`); False with one process or when a group already exists."""
    if is_distributed() or env_world_size() <= 1:
        return False
    if use_cuda:
        torch.cuda.set_device(local_rank())
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return True


def destroy() -> None:
    if is_distributed():
        dist.destroy_process_group()


@contextmanager
def process_group_from_env(use_cuda: bool) -> Iterator[None]:
    """:func:`init_from_env` for the block, ended on the way out if this block started it."""
    owned = init_from_env(use_cuda)
    try:
        yield
    finally:
        if owned:
            destroy()


def rank_seed(seed: int) -> int:
    """`seed` on rank 0 (so one process draws exactly as before), a different stream on every other rank."""
    return (seed + get_rank() * 7_919_000_003) % (2**63)
