"""A GCD train set held in memory as one uint8 tensor (small datasets, the demo)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from ...common.distributed import get_rank, get_world_size
from ..splits import gcd_split
from .base import Batch
from .sampler import sample_epoch


class InMemoryGCD:
    """`GCDSource` over tensors: images uint8 [N, C, H, W], remapped targets, labelled mask; uq = row index.

    Under `torch.distributed` (or with explicit `rank`/`world_size`) each rank gets its share: the feature pass walks
    the contiguous rows `[N·r/W, N·(r+1)/W)`, so the shares concatenated in rank order are the uq order and the
    distributed k-means sees the points exactly as one process does; training draws one global epoch order (same
    seeded generator on every rank) and rank r takes rows `[r·B, (r+1)·B)` of each global batch of `B·W`, so ranks
    never share a sample within a step and all run `N // (B·W)` steps. `B` (`batch_size`) is per rank.
    """

    def __init__(
        self,
        images: Tensor,
        targets: Tensor,
        labelled: Tensor,
        n_old: int,
        labelled_share: float | None,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be uint8 [N, C, H, W], got {images.dtype} {tuple(images.shape)}")
        if not (len(images) == len(targets) == len(labelled)):
            raise ValueError(
                f"images, targets, labelled differ in length: {len(images)}, {len(targets)}, {len(labelled)}"
            )
        if bool((targets[labelled] >= n_old).any()):
            raise ValueError("a labelled sample has a novel-class target: labelled samples must be known classes")
        self.images, self.targets, self.labelled = images, targets.long(), labelled.bool()
        self.n_train, self.n_old = len(images), n_old
        self.n_classes = int(self.targets.max()) + 1
        self.class_names = [str(c) for c in range(self.n_classes)]  # target order (the digits' own names)
        self.labelled_share = labelled_share
        if (rank is None) != (world_size is None) or (rank is not None and not 0 <= rank < world_size):
            raise ValueError(f"rank and world_size go together, 0 <= rank < world_size: got {rank}, {world_size}")
        self._rank, self._world_size = rank, world_size
        self.present = torch.ones(len(images), dtype=torch.bool)  # False: excluded from training draws

    @property
    def rank(self) -> int:
        return self._rank if self._rank is not None else get_rank()

    @property
    def world_size(self) -> int:
        return self._world_size if self._world_size is not None else get_world_size()

    def _batch(self, idx: Tensor) -> Batch:
        return Batch(self.images[idx], self.targets[idx], idx, self.labelled[idx])

    def to(self, device: torch.device | str) -> InMemoryGCD:
        """The same set held on `device` (on a GPU its batches are then gathered there: no copy per step)."""
        return InMemoryGCD(
            self.images.to(device),
            self.targets.to(device),
            self.labelled.to(device),
            self.n_old,
            self.labelled_share,
            self._rank,
            self._world_size,
        )

    def feature_batches(self, batch_size: int) -> Iterator[Batch]:
        """This rank's contiguous share of the train set once, in uq order (all of it with one process)."""
        n, r, w = self.n_train, self.rank, self.world_size
        lo, hi = n * r // w, n * (r + 1) // w
        for start in range(lo, hi, batch_size):
            yield self._batch(torch.arange(start, min(start + batch_size, hi), device=self.images.device))

    def train_batches(self, batch_size: int, epoch: int, seed: int, skip: int = 0) -> Iterator[Batch]:
        """`n_train // (batch_size * world_size)` batches of `batch_size`: this rank's slice of each global batch (from
        batch `skip` on)."""
        gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
        n = int(self.present.sum())
        order = sample_epoch(self.labelled, n, self.labelled_share, gen, self.present).to(self.images.device)
        step = batch_size * self.world_size
        for start in range(skip * step + self.rank * batch_size, n - step + 1 + self.rank * batch_size, step):
            yield self._batch(order[start : start + batch_size])

    def unreadable(self) -> list[int]:
        return []  # tensors in memory: every sample reads

    def exclude(self, uq: list[int]) -> None:
        self.present[torch.as_tensor(uq, dtype=torch.long)] = False

    def subset(self, n: int) -> InMemoryGCD:
        """The first `n` samples (uq renumbered 0..n-1), for smoke runs."""
        if not 0 < n <= self.n_train:
            raise ValueError(f"subset size must be in 1..{self.n_train}, got {n}")
        return InMemoryGCD(
            self.images[:n],
            self.targets[:n],
            self.labelled[:n],
            self.n_old,
            self.labelled_share,
            self._rank,
            self._world_size,
        )


def digits(
    known_classes: int = 5, prop: float = 0.5, seed: int = 0, size: int = 32, labelled_share: float | None = None
) -> InMemoryGCD:
    """scikit-learn's bundled handwritten digits (1,797 real 8x8 images), upscaled to `size`, GCD-split.

    Digits 0..known_classes-1 are known; `prop` of their images are labelled (`RandomState(seed)`).
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    pixels = torch.from_numpy(data.images.astype(np.float32) / 16.0)[:, None]  # [N, 1, 8, 8] in [0, 1]
    pixels = torch.nn.functional.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False)
    images = (pixels.clamp(0, 1) * 255).round().to(torch.uint8)
    labelled, targets = gcd_split(data.target, list(range(known_classes)), prop, seed)
    return InMemoryGCD(images, torch.from_numpy(targets), torch.from_numpy(labelled), known_classes, labelled_share)
