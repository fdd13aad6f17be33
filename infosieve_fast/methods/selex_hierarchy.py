"""SelEx's per-epoch cluster hierarchy (docs/reference.md §12.3): level 0 is the epoch's balanced SS-k-means; each
further level halves the known and the new clusters, groups level 0's known-class centres into the fewer known
clusters, and clusters the train set again with the samples of a known level-0 cluster labelled by their group.

The clustering itself is the engine's (`ClusterFn`, balanced SS-k-means over the run's shares), so this module only
decides the sizes, the labelled samples and their targets, and (published) the order bug of the levels' labels.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

# How a level >= 1's labels reach the samples: "published" reads the SS-k-means output (labelled samples first, then
# the rest) as if it were in loader order (the originally labelled samples first), so most samples get another
# sample's labels (docs/reference.md §12.3, surprise 4); "uq": every sample gets its own.
LEVEL_ORDERS = ("published", "uq")
# sklearn's KMeans grouping the known centres: random_state 0 as published; n_init 10, sklearn's default before 1.4
# (the published code leaves it unset; 1.4 changed the default to "auto").
GROUPING_SEED, GROUPING_INITS = 0, 10

# (labelled [n], targets [n] (-1 where not labelled), K) -> (labels [n], centres [K, F]): a balanced SS-k-means of the
# train set, every table indexed by uq, -1 for a sample no rank could read
ClusterFn = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]]


def level_sizes(n_old: int, n_new: int) -> list[tuple[int, int]]:
    """(known, new) clusters of each level: level 0's, then both halved (integer division, at least 1) while the
    known ones are more than 1. CUB (100, 100): K = 200, 100, 50, 24, 12, 6, 2."""
    sizes = [(n_old, n_new)]
    while sizes[-1][0] > 1:
        old, new = sizes[-1]
        sizes.append((max(old // 2, 1), max(new // 2, 1)))
    return sizes


def group_known_centres(known_centres: Tensor, n_groups: int) -> Tensor:
    """[n_old] the group (0..n_groups-1) of each known class's level-0 centre: sklearn KMeans, as published."""
    from sklearn.cluster import KMeans

    centres = known_centres.detach().double().cpu().numpy()
    groups = KMeans(n_groups, random_state=GROUPING_SEED, n_init=GROUPING_INITS).fit_predict(centres)
    return torch.as_tensor(groups.astype(np.int64), device=known_centres.device)


def build_hierarchy(
    labels: Tensor, centres: Tensor, labelled: Tensor, n_old: int, cluster: ClusterFn, order: str = "published"
) -> tuple[Tensor, list[Tensor]]:
    """Every level's labels [levels, n] (level 0: `labels`) and centres (level 0: `centres`, [K, F], clusters
    0..n_old-1 the known classes). `labelled`: [n] the train samples labelled in the data."""
    if order not in LEVEL_ORDERS:
        raise ValueError(f"selex.level_order must be one of {LEVEL_ORDERS}, got {order!r}")
    readable = labels >= 0
    known = readable & (labels < n_old)  # the samples of a known level-0 cluster: each level's labelled set
    tables, level_centres = [labels], [centres]
    for old, new in level_sizes(n_old, centres.shape[0] - n_old)[1:]:
        group = group_known_centres(centres[:n_old], old)
        targets = torch.where(known, group[labels.clamp(0, n_old - 1)], -1)
        level_labels, level_centre = cluster(known, targets, old + new)
        if order == "published":
            level_labels = read_in_loader_order(level_labels, labelled & readable, known, readable)
        tables.append(level_labels)
        level_centres.append(level_centre)
    return torch.stack(tables), level_centres


def read_in_loader_order(labels: Tensor, labelled: Tensor, level_labelled: Tensor, readable: Tensor) -> Tensor:
    """The published lookup of a level's labels: its SS-k-means returns them for the level's labelled samples, then
    the others (each part in loader order), and the step reads that array at each sample's loader position, the
    data's labelled samples first. The sample at loader position p gets the labels of the p-th sample of the
    SS-k-means order."""

    def first(mask: Tensor) -> Tensor:
        return torch.cat([(mask & readable).nonzero().squeeze(1), (~mask & readable).nonzero().squeeze(1)])

    read = labels.clone()
    read[first(labelled)] = labels[first(level_labelled)]
    return read
