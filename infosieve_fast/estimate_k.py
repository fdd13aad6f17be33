"""Estimate the number of categories K when it is unknown (`infosieve estimate-k`).

The method is GCD's (Vaze et al. 2022, `methods/estimate_k/estimate_k.py`). For a candidate K, k-means runs on all the
points, labelled and unlabelled, ignoring the labels. The score is the clustering accuracy (Hungarian) on the
labelled points. Too few clusters merge known classes; too many split them. GCD maximises the score over
[n_old, k_max] with a bounded Brent search.

Departures, each to make the answer less noisy. A single k-means run's labelled accuracy jumps by ±0.02 from seed to
seed, enough to send Brent's search astray (GCD reports 231 for CUB's 200), and the score can have two peaks of about
one height, of which Brent's search climbs whichever its first steps find. So:
- the score of K is the mean over `n_seeds` k-means runs with different seeds; each K is scored once and cached;
- in place of Brent's search, K is scored on an even grid of `GRID_POINTS` values over [n_old, k_max], then every K
  around the best one, outwards on both sides until two K in a row score below the best score minus its standard
  error (over the seeds);
- every K scored within one standard error of the best score is plausible (`k_range`: the smallest and largest), and
  the answer is the smallest (the one-standard-error rule of model selection): the score is flat near its peak and
  slightly favours extra clusters, so the argmax alone lands above the true K.

The answer is not stable where the score is flat over many K: on 20 held-out CUB species, dropping 2% of the images
moves it by up to 15 classes, and the ranges of two resamples need not overlap (docs/kmeans.md): the seeds' standard
error is smaller than the score's change between resamples.

A second criterion is reported beside the first: the silhouette of the unlabelled points under the semi-supervised
k-means with K clusters, for the grid's K and the answer. It is computed on at most 4,000 points with a fixed seed.
It is not used to choose K.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from sklearn.metrics import silhouette_score

from .kmeans import semi_supervised_kmeans
from .metrics import cluster_acc

SILHOUETTE_SAMPLE = 4000
GRID_POINTS = 16  # K values scored evenly over the whole range before the search around the best


def labelled_accuracy(
    feats: torch.Tensor,
    targets: np.ndarray,
    labelled: np.ndarray,
    k: int,
    *,
    n_seeds: int,
    max_iter: int,
    seed: int,
    labels_table: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[float, float]:
    """(mean, standard error) over `n_seeds` k-means runs of the clustering accuracy on the labelled points.
    `labels_table`: maps the k-means labels of `feats`' rows to the rows of `targets` and `labelled`, when those are
    indexed otherwise (the trainer's tables by sample id, complete on every rank under torchrun, where `feats` holds
    this rank's share); None: the same rows. Only `targets[labelled]` is read."""
    accs = []
    for s in range(n_seeds):
        res = semi_supervised_kmeans(feats, None, None, k, n_init=1, max_iter=max_iter, seed=seed + s)
        labels = res.labels if labels_table is None else labels_table(res.labels)
        accs.append(cluster_acc(targets[labelled], labels.cpu().numpy()[labelled]))
    return float(np.mean(accs)), float(np.std(accs, ddof=1) / np.sqrt(n_seeds)) if n_seeds > 1 else 0.0


def unlabelled_silhouette(
    feats: torch.Tensor, targets: np.ndarray, labelled: np.ndarray, k: int, *, max_iter: int, seed: int
) -> float:
    """Silhouette of the unlabelled points under semi-supervised k-means with k clusters (labelled points anchored)."""
    lab = torch.from_numpy(labelled).to(feats.device)
    res = semi_supervised_kmeans(
        feats[~lab], feats[lab], torch.from_numpy(targets[labelled]), k, n_init=1, max_iter=max_iter, seed=seed
    )
    pred = res.labels.cpu().numpy()[int(labelled.sum()) :]
    if len(np.unique(pred)) < 2:
        return -1.0
    x = feats[~lab].float().cpu().numpy()
    size = min(SILHOUETTE_SAMPLE, len(x))
    return float(silhouette_score(x, pred, sample_size=size, random_state=seed))


def estimate_k(
    feats,
    targets,
    labelled,
    n_old: int,
    *,
    k_max: int | None = None,
    n_seeds: int = 4,
    max_iter: int = 10,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
    silhouette: bool = True,
) -> dict:
    """Estimate K from features [N, D] (L2-normalised here), targets [N] (used on the labelled points only) and the
    labelled mask [N]. Searches [n_old, k_max] (default: 4 x n_old, at most N // 2). Returns a JSON-ready dict: `k`,
    the method, `k_range` (the smallest and largest K within one standard error of the best score), both criteria's
    curves over the K scored (sorted; the silhouette on the grid's K and the answer, when `silhouette`), and the time
    taken."""
    x = torch.as_tensor(np.asarray(feats), dtype=torch.float32, device=device)
    x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    y = np.asarray(targets).astype(np.int64)
    lab = np.asarray(labelled).astype(bool)
    if not (len(x) == len(y) == len(lab)):
        raise ValueError(f"features, targets and labelled differ in length: {len(x)}, {len(y)}, {len(lab)}")
    if not lab.any() or lab.all():
        raise ValueError("estimate-k needs labelled and unlabelled points: check the labelled mask")
    if n_old < 1:
        raise ValueError(f"n_old (the number of known classes) must be >= 1, got {n_old}")
    k_max = min(4 * n_old, len(x) // 2) if k_max is None else k_max
    if k_max <= n_old:
        raise ValueError(f"k_max={k_max} must exceed the {n_old} known classes: pass a larger --k-max")
    start = time.perf_counter()
    scores: dict[int, float] = {}
    errors: dict[int, float] = {}

    def negative_score(k: float) -> float:
        k = int(round(k))
        if k not in scores:
            scores[k], errors[k] = labelled_accuracy(x, y, lab, k, n_seeds=n_seeds, max_iter=max_iter, seed=seed)
            if progress is not None:
                progress(f"K={k}: labelled accuracy {scores[k]:.4f} ± {errors[k]:.4f}")
        return -scores[k]

    grid = sorted({int(k) for k in np.linspace(n_old, k_max, GRID_POINTS).round()})
    for k in grid:
        negative_score(k)
    top = scan_peak(scores, errors, negative_score, n_old, k_max)
    plausible = sorted(k for k in scores if scores[k] >= scores[top] - errors[top])
    best = plausible[0]
    shown = sorted({*grid, best}) if silhouette else []
    silhouettes = {k: unlabelled_silhouette(x, y, lab, k, max_iter=max_iter, seed=seed) for k in shown}
    return {
        "k": best,
        "method": "GCD's score (k-means on all points, Hungarian accuracy on the labelled ones); a grid, then the peak",
        "search": {"k_min": n_old, "k_max": k_max, "n_seeds": n_seeds, "max_iter": max_iter, "seed": seed},
        "k_range": [plausible[0], plausible[-1]],
        "k_by_argmax": top,
        "criteria": {
            "labelled_accuracy": {str(k): round(scores[k], 6) for k in sorted(scores)},
            "labelled_accuracy_standard_error": {str(k): round(errors[k], 6) for k in sorted(scores)},
            "unlabelled_silhouette": {str(k): round(v, 6) for k, v in silhouettes.items()},
        },
        "k_by_silhouette": max(silhouettes, key=lambda k: silhouettes[k]) if silhouettes else None,
        "seconds": round(time.perf_counter() - start, 2),
    }


def scan_peak(
    scores: dict[int, float], errors: dict[int, float], score: Callable[[int], object], k_min: int, k_max: int
) -> int:
    """The best K once the K beside it are scored (`score(k)` fills `scores` and `errors`): outwards on both sides of
    the best until two K in a row fall below the best score minus its standard error, again whenever a K beats it."""
    while True:
        top = max(scores, key=lambda k: (scores[k], -k))
        floor = scores[top] - errors[top]
        for step in (-1, 1):
            k, below = top, 0
            while k_min <= k + step <= k_max and below < 2:
                k += step
                if k not in scores:
                    score(k)
                below = below + 1 if scores[k] < floor else 0
        if max(scores, key=lambda k: (scores[k], -k)) == top:
            return top


def load_features(path: str, known_classes: int, prop: float = 0.5, seed: int = 0) -> tuple:
    """(F, y, labelled) from an `.npz` with `F` [N, D] and `y` [N]: classes 0..known_classes-1 are known and `prop`
    of their samples labelled with `RandomState(seed)` (the GCD split)."""
    from .data.splits import gcd_split

    with np.load(path) as data:
        missing = {"F", "y"} - set(data.files)
        if missing:
            raise ValueError(f"{path} lacks {sorted(missing)}: a features file holds F [N, D] and y [N]")
        feats, y = data["F"], data["y"].astype(np.int64)
    if not 0 < known_classes < len(np.unique(y)):
        raise ValueError(f"--known-classes must lie in 1..{len(np.unique(y)) - 1} for {path}, got {known_classes}")
    labelled, _ = gcd_split(y, list(range(known_classes)), prop, seed)
    return feats, y, np.asarray(labelled, bool)
