"""GCD splits: which classes are known, which of their images are labelled (REFERENCE.md §7)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def labelled_subset(n: int, prop: float = 0.5, seed: int = 0) -> np.ndarray:
    """The reference's `subsample_instances`: `RandomState(seed).permutation(n)[:int(prop * n)]`."""
    return np.random.RandomState(seed).permutation(n)[: int(prop * n)]


def gcd_split(
    targets: Sequence[int] | np.ndarray, known_classes: Sequence[int], prop: float = 0.5, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(labelled mask, remapped targets) of a train set, in the dataset's native order.

    Labelled = `prop` of the known-class images chosen by `labelled_subset` over the known-class images in native
    order. Targets are remapped known classes first (in `known_classes` order), then the rest in ascending order.
    """
    targets = np.asarray(targets)
    known = list(known_classes)
    if len(set(known)) != len(known):
        raise ValueError(f"known_classes has duplicates: {known}")
    missing = sorted(set(known) - set(targets.tolist()))
    if missing:
        raise ValueError(f"known classes {missing} have no images in the train set: check --known-classes")
    novel = sorted(set(targets.tolist()) - set(known))
    remap = {c: i for i, c in enumerate(known + novel)}
    known_idx = np.flatnonzero(np.isin(targets, known))
    labelled = np.zeros(len(targets), dtype=bool)
    labelled[known_idx[labelled_subset(len(known_idx), prop, seed)]] = True
    return labelled, np.array([remap[t] for t in targets.tolist()], dtype=np.int64)
