"""A GCD train set held in memory as one uint8 tensor (small datasets, the demo)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from .base import Batch
from .sampler import sample_epoch
from .splits import gcd_split


class InMemoryGCD:
    """`GCDSource` over tensors: images uint8 [N, C, H, W], remapped targets, labelled mask; uq = row index."""

    def __init__(self, images: Tensor, targets: Tensor, labelled: Tensor, n_old: int, labelled_share: float | None):
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
        self.labelled_share = labelled_share

    def _batch(self, idx: Tensor) -> Batch:
        return Batch(self.images[idx], self.targets[idx], idx, self.labelled[idx])

    def feature_batches(self, batch_size: int) -> Iterator[Batch]:
        for start in range(0, self.n_train, batch_size):
            yield self._batch(torch.arange(start, min(start + batch_size, self.n_train)))

    def train_batches(self, batch_size: int, epoch: int, seed: int) -> Iterator[Batch]:
        gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = sample_epoch(self.labelled, self.n_train, self.labelled_share, gen)
        for start in range(0, self.n_train - batch_size + 1, batch_size):
            yield self._batch(order[start : start + batch_size])

    def subset(self, n: int) -> InMemoryGCD:
        """The first `n` samples (uq renumbered 0..n-1), for smoke runs."""
        if not 0 < n <= self.n_train:
            raise ValueError(f"subset size must be in 1..{self.n_train}, got {n}")
        return InMemoryGCD(self.images[:n], self.targets[:n], self.labelled[:n], self.n_old, self.labelled_share)


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
