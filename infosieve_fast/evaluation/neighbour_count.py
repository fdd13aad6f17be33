"""The number of categories from the unlabelled images without labelled neighbours (`estimate-k --rule neighbours`).

GCD's score (estimate_k.py) sees only the labelled images: a new class merged into a known cluster costs it nothing,
so on weak features it answers low (cub100 at 112 px, CIFAR-10). This count reads the unlabelled images instead.

The labelled images of a known class c are a random share of its images. So an unlabelled image of class c has, on
average, the share of labelled images among its `NEIGHBOURS` nearest neighbours (cosine similarity on L2-normalised
features, the image itself left out) that a labelled image of c has, once that image's absence from its own
neighbours is allowed for (of the class's other images a labelled one sees L - 1 labelled of n - 1, an unlabelled
one L of n - 1), and its labelled neighbours are, mostly, of c. So the unlabelled images of class c number about

    U_c = (labelled neighbours of class c, summed over the unlabelled images, / NEIGHBOURS)
          / (the labelled images of c's mean share of labelled neighbours x L / (L - 1)),

the rest of the unlabelled images are new, and with the new classes as large on average as the known ones (L_c + U_c
images) they make `new images / mean size` classes. Where classes mix, an image's labelled neighbours of other
classes raise the share of the labelled images and of the unlabelled ones alike, which is why the share counts every
labelled neighbour. Reading each class's own share keeps the count right where the known classes are labelled in
different proportions: a discovery loop's second round, where the classes named in round 1 are labelled whole and
the first known ones by half, or a person's own labelled folders beside a pool that holds more of some known classes
than of others (one share for all would count the unlabelled images of a sparsely labelled class as new). A share
read off few labelled images is noisy, and the count divides by it, so each class's is drawn towards the share pooled
over the known classes, as if `PRIOR_IMAGES` more labelled images had shown that (`expected_labelled_share`).

Assumptions, each a way to fail:
- the new classes are about as large, on average, as the known ones: a pool of many small new classes counts too
  few, a few large ones too many;
- a class's labelled images are drawn at random from it (not, say, its clearest images);
- a new class's images have each other as nearest neighbours: where the features mix a new class into a known one,
  its images pass for that class's unlabelled images, and the count is low.

The answer allows for that mixing as far as the images show it (`mixing_read_off_new_images`): the unlabelled images
without a single labelled neighbour are surely new, and how often labelled images turn up among their
`WIDE_NEIGHBOURS` nearest, against how often the known classes' labelled images see each other's, says how much the
new classes mix with the known ones. Where the known classes were drawn as a block of related ones (a dataset's first
classes: cub100's species are in CUB's order, related ones side by side) they mix with each other more than with the
new ones and the allowance is small; where they were drawn at random the new ones mix about as much, and the
allowance nears `k_if_mixed`, the count had every new image mixed as much as the known classes do (the range's upper
end).

Chosen on cub100 species 0-39 only (sets of 10 to 40 species, a third to three quarters known, 224 and 112 px
EfficientNet-Lite0 features, each labelled by GCD's split and with each class in its own share; docs/kmeans.md has
the commands, the table and the measurement on other species, at other scales and on CIFAR-10): of 3, 5 and 10
neighbours and 0, 3, 10, 30 or all images' worth of the pool, only 3 and 5 neighbours with 10 images were within 10%
of the true K on every answer of both labellings, and 5 has the smaller mean error (with the mixing allowance below,
5 with 10 images alone is). A class with one labelled image is read by the pool alone. The mixing is read on 10
wide neighbours (of 10, 20 and 30, on the same sets, also with the known classes drawn at random): the only one that
keeps every answer of the sets with their first classes known within 10%, as the count alone was, while it lifts the
random-known answers within 10% from 82% to 92% (GCD's split) and from 90% to 96% (each class labelled in its own
share); 20 and 30 overshoot the first by up to 12.5% (docs/kmeans.md, "The new images' own mixing").

Costs one [rows, points] similarity block at a time. Above `MAX_POINTS` points, `SUBSAMPLES` uniform random
subsamples (seeded) are counted, which keeps every share in expectation, and their counts averaged: a set of many
classes leaves few images of each in a subsample, and one subsample's count of cub100 at 20 images per class moved by
up to 5 from the count on all the images, four averaged by up to 2 (docs/kmeans.md, "Subsamples of a large set").
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

NEIGHBOURS = 5
WIDE_NEIGHBOURS = 10
PRIOR_IMAGES = 10.0
MAX_POINTS = 20000
SUBSAMPLES = 4
CHUNK_ROWS = 2048
UNLABELLED = -1


def nearest_neighbours(x: torch.Tensor, neighbours: int) -> np.ndarray:
    """[N, neighbours]: each row of L2-normalised `x` [N, D]'s most similar other rows (itself left out), one block of
    rows at a time."""
    found = []
    for start in range(0, len(x), CHUNK_ROWS):
        sim = x[start : start + CHUNK_ROWS] @ x.T
        rows = torch.arange(len(sim), device=x.device)
        sim[rows, rows + start] = -float("inf")
        found.append(sim.topk(neighbours, dim=1).indices.cpu())
    return torch.cat(found).numpy()


def count_by_neighbours(
    x: torch.Tensor,
    targets: np.ndarray,
    labelled: np.ndarray,
    n_old: int,
    *,
    neighbours: int = NEIGHBOURS,
    wide_neighbours: int = WIDE_NEIGHBOURS,
    seed: int = 0,
    prior_images: float = PRIOR_IMAGES,
    max_points: int = MAX_POINTS,
    subsamples: int = SUBSAMPLES,
) -> dict:
    """The count for L2-normalised features `x` [N, D], `targets` [N] (read on the labelled points only; classes
    0..n_old-1) and the labelled mask (module docstring): `k` (n_old plus the rounded count of new classes, allowing
    for the mixing the new images show), `k_unrounded`, `k_count` (before that allowance, unrounded), `k_range`
    (`size_spread_range`'s about the count, its upper end raised to that about `k_if_mixed` where higher),
    `novel_share` and `novel_images` of the unlabelled images (counted, before the allowance), `class_size` (the
    known classes' mean), `same_class_share` (the share of the labelled images' neighbours that are labelled images of
    their own class, pooled), `labelled_purity` (`labelled_purity`), `mixing` and `k_if_mixed`
    (`new_classes_if_mixed`, unrounded), `new_mixing_share` (`mixing_read_off_new_images`: the share of `mixing` the
    new images show; 0 where the count finds under half a class new), the `points` counted in each of the
    `subsamples`, the `neighbours` and `wide_neighbours` (at most the other points). Above `max_points` points,
    `subsamples` uniform subsamples drawn with `seed` are counted and their counts averaged, in the whole set's
    images. `prior_images`: `expected_labelled_share`'s (others than `PRIOR_IMAGES`, `WIDE_NEIGHBOURS`, `MAX_POINTS`
    and `SUBSAMPLES` only to compare, benchmarks/bench_k_neighbours.py)."""
    lab = np.asarray(labelled, bool)
    if len(x) - 1 < neighbours:
        raise ValueError(f"{len(x)} points are too few for {neighbours} neighbours each: add images, or give K")
    wide_neighbours = min(wide_neighbours, len(x) - 1)
    classes = np.where(lab, np.asarray(targets), UNLABELLED)
    settings = (n_old, neighbours, wide_neighbours, prior_images)
    if len(x) <= max_points:
        points, counts = len(x), [count_points(x, classes, *settings)]
    else:
        draw = np.random.RandomState(seed)
        points, counts = max_points, []
        for _ in range(subsamples):
            rows = np.sort(draw.choice(len(x), max_points, replace=False))
            x_rows = x[torch.from_numpy(rows).to(x.device)]
            counts.append(count_points(x_rows, classes[rows], *settings))
    to_whole_set = len(x) / points
    novel = to_whole_set * float(np.mean([count.novel_images for count in counts]))
    sizes = to_whole_set * np.mean([count.class_sizes for count in counts], axis=0)
    class_size = float(sizes.mean())
    new_classes = novel / class_size
    n_unlab = int((~lab).sum())
    purity = float(np.mean([count.labelled_purity for count in counts]))
    mixing = over_all_known_classes(1 - purity, n_old)
    new_if_mixed = new_classes_if_mixed(novel, n_unlab, class_size, n_old, mixing)
    # Under half a class counted new is no new class (estimate_k keeps the known classes), and the allowance only
    # sizes new classes: scaling a few leftovers up would make one.
    shown = mixing_read_off_new_images(counts, n_old) if new_classes >= 0.5 else 0.0
    new_as_shown = new_classes_if_mixed(novel, n_unlab, class_size, n_old, mixing * shown)
    low, high = size_spread_range(new_classes, sizes)
    return {
        "k": n_old + int(round(new_as_shown)),
        "k_unrounded": round(n_old + new_as_shown, 4),
        "k_count": round(n_old + new_classes, 4),
        "k_range": [low, max(high, size_spread_range(new_if_mixed, sizes)[1])],
        "novel_share": round(novel / n_unlab, 6),
        "novel_images": round(novel, 2),
        "class_size": round(class_size, 4),
        "same_class_share": round(float(np.mean([count.same_class_share for count in counts])), 6),
        "labelled_purity": round(purity, 6),
        "mixing": round(mixing, 6),
        "k_if_mixed": round(n_old + new_if_mixed, 4),
        "new_mixing_share": round(shown, 6),
        "points": points,
        "subsamples": len(counts),
        "neighbours": neighbours,
        "wide_neighbours": wide_neighbours,
    }


class PointsCount(NamedTuple):
    """One set of points' count: its unlabelled images without a known class, each known class's images [n_old],
    `count_by_neighbours`'s `same_class_share` and `labelled_purity` of these points, and `mixing_shares`'."""

    novel_images: float
    class_sizes: np.ndarray
    same_class_share: float
    labelled_purity: float
    surest_new_labelled: float
    known_cross_labelled: float


def count_points(
    x: torch.Tensor, classes: np.ndarray, n_old: int, neighbours: int, wide_neighbours: int, prior_images: float
) -> PointsCount:
    """The count on the points `x` [P, D] whose `classes` [P] are the labelled points' classes, else UNLABELLED."""
    lab = classes != UNLABELLED
    nearest = nearest_neighbours(x, max(neighbours, wide_neighbours))
    neighbour_class = classes[nearest[:, :neighbours]]  # [P, neighbours]
    share = expected_labelled_share(neighbour_class[lab], classes[lab], n_old, prior_images)
    seen = neighbour_class[~lab]
    seen_by_class = np.bincount(seen[seen != UNLABELLED], minlength=n_old) / neighbours
    unlabelled_known = seen_by_class / share
    return PointsCount(
        novel_images=float(np.clip((~lab).sum() - unlabelled_known.sum(), 0, None)),
        class_sizes=np.bincount(classes[lab], minlength=n_old) + unlabelled_known,
        same_class_share=float((neighbour_class[lab] == classes[lab][:, None]).mean()),
        labelled_purity=labelled_purity(neighbour_class[lab], classes[lab]),
        **mixing_shares(classes[nearest[:, :wide_neighbours]], classes, (neighbour_class == UNLABELLED).all(1) & ~lab),
    )


def mixing_shares(wide_class: np.ndarray, classes: np.ndarray, surest_new: np.ndarray) -> dict:
    """Of the `wide_class` [P, wide neighbours] each point's wide neighbours' classes: `surest_new_labelled`, the
    share that is labelled among the `surest_new` points' (unlabelled, without a labelled one among the nearest; 0
    where there are none), and `known_cross_labelled`, the share that is labelled of another known class among the
    labelled points'."""
    lab = classes != UNLABELLED
    wide_labelled = wide_class != UNLABELLED
    return {
        "surest_new_labelled": float(wide_labelled[surest_new].mean()) if surest_new.any() else 0.0,
        "known_cross_labelled": float((wide_labelled[lab] & (wide_class[lab] != classes[lab][:, None])).mean()),
    }


def mixing_read_off_new_images(counts: list[PointsCount], n_old: int) -> float:
    """The share of `mixing` (a known class's mixing with the other known classes) that the new images show: the
    share of labelled images among the wide neighbours of the surely new images (those without a labelled one among
    their nearest), against the share of labelled images of another known class among a labelled image's, scaled
    by n_old / (n_old - 1) as a new image has all n_old known classes to mix with; at most 1. Averaged over the
    subsamples `counts`. The surely new images are the new images that mix least, so the share reads low; on the
    choice sets that low reading kept the answer from overshooting where the known classes mix more with each other
    than with the new ones, where reading on more neighbours did not (docs/kmeans.md)."""
    surest = float(np.mean([count.surest_new_labelled for count in counts]))
    cross = over_all_known_classes(float(np.mean([count.known_cross_labelled for count in counts])), n_old)
    return min(1.0, surest / cross) if cross > 0 else 0.0


def over_all_known_classes(share_of_others: float, n_old: int) -> float:
    """A known image's `share_of_others` (of its neighbours, of the n_old - 1 other known classes) for a new image,
    which has all n_old known classes to mix with; 0 with one known class (there is no other to read it from)."""
    return share_of_others * n_old / (n_old - 1) if n_old > 1 else 0.0


def labelled_purity(neighbour_class: np.ndarray, classes: np.ndarray) -> float:
    """The share of the labelled images' labelled neighbours (`neighbour_class` [labelled, neighbours], UNLABELLED
    for an unlabelled one) that are of their own class (`classes` [labelled]), pooled."""
    labelled = neighbour_class != UNLABELLED
    return float((neighbour_class == classes[:, None]).sum() / max(labelled.sum(), 1))


def new_classes_if_mixed(novel_images: float, unlabelled: int, class_size: float, n_old: int, mixing: float) -> float:
    """The new classes if every new image was counted as known by the share `mixing` of its weight.

    A labelled image's labelled neighbours are of another known class with the share 1 - `labelled_purity`, spread
    over the n_old - 1 other known classes. A new image that mixes as much, over all n_old known classes, has a
    (1 - purity) x n_old / (n_old - 1) share of a known image's labelled neighbours (`mixing`), and the count takes
    that share of it for a known class's. So the `novel_images` counted are (1 - mixing) of the true new images
    (never more than every `unlabelled` image), and the known classes' mean size `class_size` holds the rest, which
    this takes out of it. Where the known classes were drawn as a block (cub100's first species, related ones side by
    side) they mix more with each other than with the new ones, and this overshoots; where they were drawn at random
    the count is low and this nearer the truth (docs/kmeans.md)."""
    new_images = unlabelled if mixing >= 1 else min(novel_images / (1 - mixing), unlabelled)
    return new_images / (class_size - (new_images - novel_images) / n_old)


def expected_labelled_share(
    neighbour_class: np.ndarray, classes: np.ndarray, n_old: int, prior_images: float = PRIOR_IMAGES
) -> np.ndarray:
    """[n_old]: the share of labelled neighbours that an unlabelled image of each class has, read off that class's
    labelled images (`neighbour_class` [labelled, neighbours], their `classes`): their own share, scaled by L / (L - 1)
    for their absence from their own neighbours, and drawn towards the share pooled over all the known classes as if
    `prior_images` more labelled images had shown the pooled share: a class read off a few labelled images is read
    mostly by the pool (its own share is noisy, and the count divides by it), one read off many by its own (0: each
    class by its own alone; inf: every class by the pool)."""
    labelled = np.bincount(classes, minlength=n_old).astype(np.float64)
    summed = np.bincount(classes, weights=(neighbour_class != UNLABELLED).mean(1), minlength=n_old)
    seen = np.clip(labelled - 1, 0, None)  # the other labelled images each labelled image could see
    if summed.sum() == 0:
        raise ValueError(
            "no labelled image has a labelled image among its nearest neighbours: the labelled images are too few or "
            "too scattered to count new classes by; use the score rule (--rule score), or give K"
        )
    pooled = summed.sum() / seen.sum()
    if np.isinf(prior_images):
        return np.full(n_old, pooled)
    return (summed + prior_images * pooled) / (seen + prior_images)


def size_spread_range(new_classes: float, sizes: np.ndarray) -> list[int]:
    """[smallest, largest] K for `new_classes` new classes counted at the known classes' mean size, where the new
    classes' sizes vary as the known classes' `sizes` do (coefficient of variation `cv`): the relative standard error
    of the count is cv x sqrt(1 / new + 1 / known) (the new classes' mean size and the known classes' are both means
    of so many sizes); two of them either way, the ends rounded outwards, never below the known classes. It leaves
    out the features' mixing, which only lowers the count."""
    n_old = len(sizes)
    cv = sizes.std(ddof=1) / sizes.mean() if n_old > 1 else 0.0
    spread = 2 * cv * np.sqrt(1 / max(new_classes, 1.0) + 1 / n_old) * new_classes
    return [n_old + max(0, int(np.floor(new_classes - spread))), n_old + int(np.ceil(new_classes + spread))]
