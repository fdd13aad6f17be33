"""The frozen prefix's tokens of the un-augmented (test-view) passes, kept and replayed.

The test view of an image never changes, and neither does the frozen prefix (embedding and blocks < grad_from_block)
when it keeps no running statistics (`Backbone.prefix_is_pure`). So the passes that see the test view (the
evaluations before and after training, every `train.eval_every`, the code measures) can run the frozen prefix once:
the first such pass over a split records each batch's tokens with its labels and ids, and later passes replay them
through the trained blocks only, with no decoding, augmenting or prefix at all. The replayed features equal the
recomputed ones (the same tokens, the same batches). `train.token_cache: auto` keeps them on the GPU when they fit a
quarter of its free memory, else in RAM below `data.memory_threshold_mb`, else nowhere (the passes recompute).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..common.notices import notice
from ..data.reading.base import Batch
from ..data.reading.cache import cache_device

GPU_SHARE = 0.25  # of the free GPU memory when the first batch is seen: training needs the rest


@dataclass
class CachedBatch:
    tokens: Tensor
    targets: Tensor
    labelled: Tensor
    uq: Tensor


class TokenCache:
    """Per split ("train", "test"): this rank's test-view batches as frozen-prefix tokens, or nothing yet."""

    def __init__(self, setting: str, device: torch.device, memory_threshold_mb: float):
        self.enabled = setting == "auto"
        self.device, self.memory_threshold_mb = device, memory_threshold_mb
        self.splits: dict[str, list[CachedBatch]] = {}
        self.placement: dict[str, str] = {}  # split -> "cuda" | "cpu" | "recompute", decided on its first batch

    def replay(self, split: str) -> list[CachedBatch] | None:
        """The split's recorded batches (on the compute device one at a time), or None when not recorded."""
        return self.splits.get(split)

    def recorder(self, split: str, expected_samples: int) -> Recorder | None:
        """A recorder for the split's next pass, or None when caching is off or was ruled out for this split."""
        if not self.enabled or self.placement.get(split) == "recompute":
            return None
        return Recorder(self, split, expected_samples)

    def clear(self) -> None:
        """Forget every token: the frozen weights changed (a checkpoint was loaded)."""
        self.splits.clear()
        self.placement.clear()


class Recorder:
    """Collects one pass's batches; `finish` stores them once the pass has seen every batch."""

    def __init__(self, cache: TokenCache, split: str, expected_samples: int):
        self.cache, self.split, self.expected = cache, split, expected_samples
        self.store: torch.device | None = None
        self.decided = False
        self.batches: list[CachedBatch] = []

    def add(self, tokens: Tensor, batch: Batch) -> None:
        if not self.decided:
            self.store, self.decided = self._placement(tokens), True
        if self.store is None:
            return
        self.batches.append(
            CachedBatch(
                tokens.to(self.store, non_blocking=True),
                batch.targets.to(self.store),
                batch.labelled.to(self.store),
                batch.uq.to(self.store),
            )
        )

    def finish(self) -> None:
        if self.store is not None:
            self.cache.splits[self.split] = self.batches

    def _placement(self, tokens: Tensor) -> torch.device | None:
        per_sample = tokens[0].numel() * tokens.element_size()
        needed_mb = self.expected * per_sample / 2**20
        c = self.cache
        where = cache_device("auto", c.device, needed_mb, GPU_SHARE, c.memory_threshold_mb)
        c.placement[self.split] = "recompute" if where is None else where.type
        place = {"cuda": "on the GPU", "cpu": "in RAM", "recompute": "nowhere: recomputed every pass"}
        notice(
            f"test-view tokens of the {self.split} split ({needed_mb:,.0f} MiB per rank) are kept "
            f"{place[c.placement[self.split]]}"
        )
        return where
