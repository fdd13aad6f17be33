"""Estimate the number of categories K when it is unknown (`infosieve estimate-k`).

The method is GCD's (Vaze et al. 2022, `methods/estimate_k/estimate_k.py`). For a candidate K, k-means runs on all the
points, labelled and unlabelled, ignoring the labels. The score is the clustering accuracy (Hungarian) on the
labelled points. Too few clusters merge known classes; too many split them. A bounded Brent search
(`scipy.optimize.minimize_scalar(method="bounded")`) maximises the score over [n_old, k_max].

Departures, each to make the search less noisy. A single k-means run's labelled accuracy jumps by ±0.02 from seed to
seed, enough to send Brent's search astray (GCD reports 231 for CUB's 200). So:
- the score of K is the mean over `n_seeds` k-means runs with different seeds;
- K is an integer: each K is scored once and cached;
- the search stops when the bracket is narrower than one class;
- the answer is the smallest K evaluated whose score lies within one standard error (over the seeds) of the best
  score (the one-standard-error rule of model selection): the score is flat near its peak and slightly favours
  extra clusters, so the argmax alone lands above the true K.

A second criterion is reported beside the first: the silhouette of the unlabelled points under the semi-supervised
k-means with K clusters. It is computed on at most 4,000 points with a fixed seed. It is not used to choose K.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from scipy.optimize import minimize_scalar
from sklearn.metrics import silhouette_score

from .kmeans import semi_supervised_kmeans
from .metrics import cluster_acc

SILHOUETTE_SAMPLE = 4000


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
) -> dict:
    """Estimate K from features [N, D] (L2-normalised here), targets [N] (used on the labelled points only) and the
    labelled mask [N]. Searches [n_old, k_max] (default: 4 x n_old, at most N // 2). Returns a JSON-ready dict: `k`,
    the method, both criteria's curves over the evaluated K (sorted), and the time taken."""
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

    minimize_scalar(negative_score, bounds=(n_old, k_max), method="bounded", options={"xatol": 1.0})
    top = max(scores, key=lambda k: (scores[k], -k))
    best = min(k for k in scores if scores[k] >= scores[top] - errors[top])
    silhouette = {k: unlabelled_silhouette(x, y, lab, k, max_iter=max_iter, seed=seed) for k in sorted(scores)}
    return {
        "k": best,
        "method": "GCD: k-means on all points, Hungarian accuracy on the labelled points, bounded Brent search",
        "search": {"k_min": n_old, "k_max": k_max, "n_seeds": n_seeds, "max_iter": max_iter, "seed": seed},
        "k_by_argmax": top,
        "criteria": {
            "labelled_accuracy": {str(k): round(scores[k], 6) for k in sorted(scores)},
            "labelled_accuracy_standard_error": {str(k): round(errors[k], 6) for k in sorted(scores)},
            "unlabelled_silhouette": {str(k): round(v, 6) for k, v in silhouette.items()},
        },
        "k_by_silhouette": max(silhouette, key=lambda k: silhouette[k]),
        "seconds": round(time.perf_counter() - start, 2),
    }


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
