"""The decoded split kept whole on a GPU or in RAM: decoded once, then every pass gathers its batches from it with no
decoding at all (`stream.ShardSource` fills and serves it).

The images lie back to back in one uint8 tensor in index-row (storage) order, so each rank's share of the rows is one
contiguous byte range: each rank decodes only its share, then the ranks broadcast their shares to each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import Tensor

from ...common import distributed as dist
from .base import Batch
from .decode import pad_into
from .pools import BufferPool, cpu_threads


def cache_device(
    cache: str, device: torch.device, decoded_mb: float, gpu_cache_share: float, memory_threshold_mb: float
) -> torch.device | None:
    """Where a split of `decoded_mb` is kept: `device` (a GPU), the CPU, or nowhere (None: streamed every pass).
    `cache="auto"`: on the GPU when it fits `gpu_cache_share` of the free memory, else in RAM below
    `memory_threshold_mb`."""
    on_gpu = device.type == "cuda"
    if cache == "gpu" and not on_gpu:
        raise ValueError(f"cache='gpu' needs a CUDA device, got device={device}: use cache='cpu' or 'auto'")
    free_mb = torch.cuda.mem_get_info(device)[0] / 2**20 if on_gpu and cache in ("gpu", "auto") else 0.0
    if cache == "gpu" and decoded_mb > free_mb:
        raise ValueError(
            f"cache='gpu': the decoded split takes {decoded_mb:,.0f} MiB but {device} has {free_mb:,.0f} MiB free: use "
            "cache='auto' (the GPU only when it fits gpu_cache_share of the free memory) or 'cpu'"
        )
    if cache == "gpu" or (cache == "auto" and on_gpu and decoded_mb <= gpu_cache_share * free_mb):
        return device
    if cache == "cpu" or (cache == "auto" and decoded_mb <= memory_threshold_mb):
        return torch.device("cpu")
    return None


class DecodedCache:
    """Every index row's image at its served size `hw[row]`, on `device`."""

    def __init__(self, hw: np.ndarray, device: torch.device):
        self.hw = torch.from_numpy(hw)  # [rows, 2]
        nbytes = 3 * self.hw[:, 0] * self.hw[:, 1]
        self.offset = torch.cumsum(nbytes, 0) - nbytes
        self.flat = torch.zeros(int(nbytes.sum()), dtype=torch.uint8, device=device)
        self.uniform = tuple(int(v) for v in hw[0]) if len(hw) and (hw == hw[0]).all() else None
        self._pool = BufferPool(3)  # CPU batches: the caller's current and previous ones, the next one

    def image(self, row: int) -> Tensor:
        h, w = (int(v) for v in self.hw[row])
        a = int(self.offset[row])
        return self.flat[a : a + 3 * h * w].view(3, h, w)

    def fill(self, batches: Iterable[Batch], row_of_uq: np.ndarray) -> list[tuple[int, tuple, tuple]]:
        """Copy decoded batches into their rows; returns (uq, decoded size, expected size) of every image whose size
        disagrees with its header (left out: the caller counts it unreadable)."""
        wrong = []
        for batch in batches:
            sizes = batch.sizes.tolist() if batch.sizes is not None else [batch.images.shape[-2:]] * len(batch.uq)
            for img, (h, w), u in zip(batch.images, sizes, batch.uq.tolist(), strict=True):
                row = int(row_of_uq[u])
                expected = tuple(self.hw[row].tolist())
                if expected != (h, w):
                    wrong.append((u, (h, w), expected))
                    continue
                self.image(row).copy_(img[:, :h, :w])
        return wrong

    def share_across_ranks(self, world_size: int) -> None:
        """Rank r filled the r-th contiguous share of the rows; afterwards every rank holds all of them."""
        n = len(self.hw)
        for r in range(world_size):
            lo, hi = n * r // world_size, n * (r + 1) // world_size
            if lo < hi:
                end = int(self.offset[hi - 1]) + 3 * int(self.hw[hi - 1].prod())
                dist.broadcast_(self.flat[int(self.offset[lo]) : end], src=r)

    def gather(self, rows: Tensor) -> tuple[Tensor, Tensor | None]:
        """(images, sizes) of the given rows: one indexing op when every image has the same size. The sizes stay on
        the host (`Batch.sizes`)."""
        dev = self.flat.device
        if self.uniform is not None:
            whole = self.flat.view(-1, 3, *self.uniform)
            if dev.type == "cpu":  # into a reused buffer: a fresh 25 MB tensor per batch costs more than the copy
                out = self._pool.get((len(rows), 3, *self.uniform), torch.uint8)
                return torch.index_select(whole, 0, rows, out=out), None
            return whole[rows.to(dev)], None
        images = [self.image(int(r)) for r in rows]
        sizes = self.hw[rows]
        hm, wm = (int(v) for v in sizes.max(0).values)
        out = self._pool.get((len(rows), 3, hm, wm), torch.uint8) if dev.type == "cpu" else None
        return pad_into(images, out)[0], sizes

    def serve(
        self,
        uq_batches: Iterable[Tensor],
        row_of_uq: np.ndarray,
        cls: np.ndarray,
        labelled: np.ndarray,
        device: torch.device,
    ) -> Iterator[Batch]:
        """Batches of the given uq, moved to `device`. In RAM the next batch is gathered in a background thread while
        the caller works on the current one (the gather is a visible share of an in-memory training step)."""
        dev = self.flat.device

        def batch(uq: Tensor) -> Batch:
            u = uq.numpy()
            rows = row_of_uq[u]
            images, sizes = self.gather(torch.from_numpy(rows))
            meta = (torch.from_numpy(cls[rows]), uq, torch.from_numpy(labelled[u]))
            return Batch(images, *(t.to(dev) for t in meta), sizes).to(device, non_blocking=True)

        threads = cpu_threads(1) if dev.type == "cpu" else None
        if threads is None:
            yield from map(batch, uq_batches)
            return
        pending = None
        for uq in uq_batches:
            nxt = threads.submit(batch, uq)
            if pending is not None:
                yield pending.result()
            pending = nxt
        if pending is not None:
            yield pending.result()
