"""The data, in two sides: `writing/` (make-shards: datasets in their native layouts -> WebDataset shards) and
`reading/` (shards or the embedded digits demo -> the trainer's batches), with what both agree on beside them
(`splits.py`, `shard_manifest.py`, `shard_format.py`). Here: the training source a config names."""

from __future__ import annotations

import numpy as np
import torch

from ..config.settings import DataConfig, TrainConfig
from .reading.base import Batch, GCDSource
from .reading.memory import InMemoryGCD, digits

__all__ = ["Batch", "GCDSource", "InMemoryGCD", "build_source", "digits", "held_out_labelled"]


def build_source(data: DataConfig, train: TrainConfig, device: torch.device | None = None) -> GCDSource:
    """The train set named by `data.source`, cut to `train.train_subset` samples when set (smoke runs); shard batches
    are delivered on `device` (the training device: it also decides GPU decoding and a GPU cache)."""
    if data.source == "digits":
        d = data.digits
        source = digits(d.known_classes, d.labelled_prop, d.split_seed, d.image_size, data.labelled_share)
        if train.train_subset is not None:
            source = source.subset(train.train_subset)
        return source
    if not data.shards:
        raise ValueError(
            "data.source=shards needs data.shards: a folder written by `infosieve make-shards`, or WebDataset shards "
            "(a folder, a brace pattern, a glob or a list)"
        )
    if train.train_subset is not None:
        raise ValueError("train.train_subset applies to in-memory sources only; make smaller shards instead")
    from .reading.stream import ReadOptions, ShardSource

    return ShardSource(data.shards, ReadOptions.of_config(data, train.seed), device=device)


def held_out_labelled(source: GCDSource) -> np.ndarray:
    """uq (ascending) of `source`'s held-out labelled images: the labelled images of known classes that shards of your
    own images (`make-shards --dataset discovery --holdout SHARE`) serve as unlabelled, their class kept as the target
    to score them against. Empty for every other source."""
    held_out = getattr(source, "held_out", None)  # a ShardSource method; in-memory sources hold none
    return np.zeros(0, np.int64) if held_out is None else held_out()
