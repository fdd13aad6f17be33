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
  its images pass for that class's unlabelled images, so the count is low.

Chosen on cub100 species 0-39 only (sets of 10 to 40 species, a third to three quarters known, 224 and 112 px
EfficientNet-Lite0 features, each labelled by GCD's split and with each class in its own share; docs/kmeans.md has
the commands, the table and the measurement on other species, at other scales and on CIFAR-10): of 3, 5 and 10
neighbours and 0, 3, 10, 30 or all images' worth of the pool, only 3 and 5 neighbours with 10 images were within 10%
of the true K on every answer of both labellings, and 5 has the smaller mean error. A class with one labelled image
is read by the pool alone.

Costs one [rows, points] similarity block at a time; above `MAX_POINTS` points a uniform random subsample (seeded) is
counted, which keeps every share in expectation.
"""

from __future__ import annotations

import numpy as np
import torch

NEIGHBOURS = 5
PRIOR_IMAGES = 10.0
MAX_POINTS = 20000
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
    seed: int = 0,
    prior_images: float = PRIOR_IMAGES,
) -> dict:
    """The count for L2-normalised features `x` [N, D], `targets` [N] (read on the labelled points only; classes
    0..n_old-1) and the labelled mask (module docstring): `k` (n_old plus the rounded count of new classes),
    `k_unrounded`, `k_range` (`size_spread_range`), `novel_share` and `novel_images` of the unlabelled images,
    `class_size` (the known classes' mean), `same_class_share` (the labelled images' share of labelled neighbours of
    their own class, pooled), the `points` counted and the `neighbours`. `prior_images`: `expected_labelled_share`'s
    (another than `PRIOR_IMAGES` only to compare, benchmarks/bench_k_neighbours.py)."""
    lab = np.asarray(labelled, bool)
    if len(x) - 1 < neighbours:
        raise ValueError(f"{len(x)} points are too few for {neighbours} neighbours each: add images, or give K")
    rows = np.arange(len(x))
    if len(x) > MAX_POINTS:
        rows = np.sort(np.random.RandomState(seed).choice(len(x), MAX_POINTS, replace=False))
        x = x[torch.from_numpy(rows).to(x.device)]
    lab = lab[rows]
    classes = np.where(lab, np.asarray(targets)[rows], UNLABELLED)
    nearest = nearest_neighbours(x, neighbours)
    neighbour_class = classes[nearest]  # [points, neighbours]: a labelled neighbour's class, else UNLABELLED
    share = expected_labelled_share(neighbour_class[lab], classes[lab], n_old, prior_images)
    seen = neighbour_class[~lab]
    seen_by_class = np.bincount(seen[seen != UNLABELLED], minlength=n_old) / neighbours
    unlabelled_known = seen_by_class / share
    n_unlab = int((~lab).sum())
    novel = float(np.clip(n_unlab - unlabelled_known.sum(), 0, None))
    sizes = np.bincount(classes[lab], minlength=n_old) + unlabelled_known
    new_classes = novel / sizes.mean()
    return {
        "k": n_old + int(round(new_classes)),
        "k_unrounded": round(n_old + new_classes, 4),
        "k_range": size_spread_range(new_classes, sizes),
        "novel_share": round(novel / n_unlab, 6),
        "novel_images": round(novel, 2),
        "class_size": round(float(sizes.mean()), 4),
        "same_class_share": round(float((neighbour_class[lab] == classes[lab][:, None]).mean()), 6),
        "points": len(rows),
        "neighbours": neighbours,
    }


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
