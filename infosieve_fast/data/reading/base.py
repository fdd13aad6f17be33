"""What the trainer consumes from any data source: batches of uint8 images with their GCD bookkeeping."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass
class Batch:
    """B samples at their stored size; augmentation (crop, flip, normalise) happens on the device."""

    images: Tensor  # uint8 [B, C, H, W]
    targets: Tensor  # long [B], class index with the known classes first (0..n_old-1); -1 (NO_LABEL): none at all
    uq: Tensor  # long [B], the sample's unique index 0..n_train-1 (indexes the pseudo-label table)
    labelled: Tensor  # bool [B], True where the sample's label may be used for training
    # long [B, 2] on the host: each image's (height, width) when the images differ in size; they are then padded,
    # top-left aligned, into `images` [B, C, max h, max w]. None: every image fills `images`.
    sizes: Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch with its tensors on `device`, but `sizes`: they stay on the host, where the augmentation reads
        their minimum (a device copy would make the host wait for the device at every batch)."""
        return Batch(
            *(t.to(device, non_blocking=non_blocking) for t in (self.images, self.targets, self.uq, self.labelled)),
            self.sizes,
        )


class GCDSource(Protocol):
    """A GCD train set: labelled samples of the known classes plus unlabelled samples of all classes."""

    n_train: int  # samples in the train set (labelled + unlabelled); uq runs over 0..n_train-1
    n_old: int  # known classes
    n_classes: int | None  # known + novel classes; None when unknown (your own images: set kmeans.n_clusters)
    class_names: list[str]  # by target (known classes first)

    def feature_batches(self, batch_size: int) -> Iterator[Batch]:
        """Every train sample exactly once (on this rank), in a fixed order, for the per-epoch feature pass."""
        ...

    def train_batches(self, batch_size: int, epoch: int, seed: int, skip: int = 0) -> Iterator[Batch]:
        """One epoch of training batches, drawn with the configured labelled share, full batches only; never a sample
        passed to `exclude`. `skip`: start after that many of the epoch's batches (none of them is read), as a run
        resumed mid-epoch does."""
        ...

    def unreadable(self) -> list[int]:
        """uq of the samples this rank found unreadable so far (they are left out of its feature passes)."""
        ...

    def exclude(self, uq: list[int]) -> None:
        """Never draw these samples for training (the unreadable ones of every rank; the same list on every rank)."""
        ...
