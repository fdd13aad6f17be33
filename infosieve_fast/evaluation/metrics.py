"""Clustering accuracy for generalised category discovery (docs/reference.md §6).

All functions follow GCD's ``project_utils/cluster_and_log_utils.py`` (which InfoSieve copies byte for byte) and
SimGCD's class-balanced ``v2b``. The confusion matrix is ``w[pred, true]`` of shape ``(D, D)`` with
``D = max(y_pred.max(), y_true.max()) + 1``, exactly as in the reference, and the Hungarian matching is
``scipy.optimize.linear_sum_assignment(w.max() - w)`` on that same square matrix (maximising matches). Keeping the
reference's matrix layout means ties between equally good matchings are broken the same way, so Old/New agree with
the reference even when the optimum is not unique.

Conventions that the reference leaves undefined (it raises or returns NaN there):

* **Empty subset.** When no sample is Old (``mask`` all False) the Old accuracy is ``0.0``; likewise New when
  ``mask`` is all True; an empty input gives ``0.0`` everywhere. ``0.0`` (not NaN/None) keeps ``metrics.json``
  valid JSON and the printed tables formattable. The All value is unaffected: v1 weights the empty side by 0, v2
  counts all samples, and v2b averages only over the classes that occur.
* **Inputs.** 1-D numpy arrays, sequences or torch tensors (CPU or CUDA) of non-negative integer labels
  (integer-valued floats are accepted, as the reference casts with ``astype(int)``). ``mask`` is boolean (or 0/1),
  True where the sample's *true* class is an Old (known) class. Lengths must match. Labels are used as indices,
  so the matrix is ``D x D``: pass compact ids (as SS-k-means produces), not arbitrary large integers.
* Values are Python floats in ``[0, 1]``.
* **No label.** ``evaluate_split`` leaves out the samples whose true class is ``NO_LABEL`` (-1): images that carry no
  label at all (the unlabelled pool of ``make-shards --dataset discovery``), which no accuracy can score. The rest
  are scored as if those samples were absent. The other functions take no ``NO_LABEL``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..common.labels import NO_LABEL

__all__ = [
    "PROTOCOLS",
    "SplitAcc",
    "cluster_acc",
    "evaluate_split",
    "split_cluster_acc_v1",
    "split_cluster_acc_v2",
    "split_cluster_acc_v2b",
]


class SplitAcc(NamedTuple):
    """All / Old / New accuracy; unpacks like the reference's ``(total_acc, old_acc, new_acc)`` tuple."""

    all: float
    old: float
    new: float


# --------------------------------------------------------------------------------------------------------------------
# input handling


def _to_numpy(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor (any device) without importing torch
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    return arr


def _as_labels(x: Any, name: str) -> np.ndarray:
    arr = _to_numpy(x, name)
    if arr.dtype == bool:
        arr = arr.astype(np.int64)
    elif np.issubdtype(arr.dtype, np.floating):
        if arr.size and not (np.all(np.isfinite(arr)) and np.all(arr == np.round(arr))):
            raise ValueError(f"{name} must hold integer labels, got non-integral values")
        arr = arr.astype(np.int64)
    elif np.issubdtype(arr.dtype, np.integer):
        arr = arr.astype(np.int64, copy=False)
    elif arr.size == 0:
        arr = arr.astype(np.int64)
    else:
        raise ValueError(f"{name} must hold integer labels, got dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} must hold non-negative labels, got minimum {int(arr.min())}")
    return arr


def _as_mask(x: Any, n: int) -> np.ndarray:
    arr = _to_numpy(x, "mask")
    if arr.dtype != bool:
        if arr.size and not np.all((arr == 0) | (arr == 1)):
            raise ValueError("mask must be boolean (or 0/1): True where the sample's true class is Old")
        arr = arr.astype(bool)
    if arr.shape[0] != n:
        raise ValueError(f"mask has length {arr.shape[0]} but y_true and y_pred have length {n}")
    return arr


def _pair(y_true: Any, y_pred: Any) -> tuple[np.ndarray, np.ndarray]:
    t = _as_labels(y_true, "y_true")
    p = _as_labels(y_pred, "y_pred")
    if t.shape[0] != p.shape[0]:
        raise ValueError(f"y_true and y_pred must have the same length, got {t.shape[0]} and {p.shape[0]}")
    return t, p


# --------------------------------------------------------------------------------------------------------------------
# core


def _confusion(y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
    """``w[pred, true]`` counts, square ``(D, D)`` with ``D = max(max pred, max true) + 1`` (as the reference)."""
    d = int(max(y_pred.max(), y_true.max())) + 1
    return np.bincount(y_pred * d + y_true, minlength=d * d).reshape(d, d)


def _match(w: np.ndarray) -> np.ndarray:
    """Hungarian matching maximising matches; returns ``row_of[true] = pred`` for every column of ``w``."""
    rows, cols = linear_sum_assignment(w.max() - w)
    row_of = np.empty(w.shape[1], dtype=np.int64)
    row_of[cols] = rows
    return row_of


def cluster_acc(y_true: Any, y_pred: Any) -> float:
    """Best-matching accuracy of a clustering: the share of samples right under the optimal one-to-one map
    from cluster ids to class ids (Hungarian). Clusters and classes may differ in number; unmatched clusters
    count as wrong. An empty input gives 0.0."""
    t, p = _pair(y_true, y_pred)
    if t.size == 0:
        return 0.0
    w = _confusion(t, p)
    row_of = _match(w)
    return float(w[row_of, np.arange(w.shape[1])].sum() / t.size)


def split_cluster_acc_v1(y_true: Any, y_pred: Any, mask: Any) -> SplitAcc:
    """GCD's v1: a separate Hungarian matching on the Old samples and on the New samples.

    ``Old = cluster_acc(y_true[mask], y_pred[mask])``, ``New = cluster_acc(y_true[~mask], y_pred[~mask])``,
    ``All = mean(mask) * Old + (1 - mean(mask)) * New``. An empty side is 0.0 and gets weight 0 in All.
    (The reference's in-training logs and checkpoint selection use this; the papers report v2.)"""
    t, p = _pair(y_true, y_pred)
    m = _as_mask(mask, t.size)
    if t.size == 0:
        return SplitAcc(0.0, 0.0, 0.0)
    weight = float(m.mean())
    old = cluster_acc(t[m], p[m])
    new = cluster_acc(t[~m], p[~m])
    return SplitAcc(float(weight * old + (1.0 - weight) * new), old, new)


def _v2_parts(t: np.ndarray, p: np.ndarray, m: np.ndarray):
    w = _confusion(t, p)
    row_of = _match(w)
    correct = w[row_of, np.arange(w.shape[1])]  # correct[c]: samples of class c in its matched cluster
    counts = w.sum(axis=0)  # counts[c]: samples of class c
    old_classes = np.unique(t[m])  # set(y_true[mask])
    new_classes = np.unique(t[~m])  # set(y_true[~mask])
    return correct, counts, old_classes, new_classes


def split_cluster_acc_v2(y_true: Any, y_pred: Any, mask: Any) -> SplitAcc:
    """GCD's v2 (the number papers report): ONE Hungarian matching over all samples, then read off subsets.

    ``All = matched / N``; ``Old = sum_{c in set(y_true[mask])} w[map[c], c] / sum_{c} |class c|``; New likewise
    over ``set(y_true[~mask])``. The matching runs over all clusters, with no identity map forced for the labelled
    clusters. An empty side is 0.0."""
    t, p = _pair(y_true, y_pred)
    m = _as_mask(mask, t.size)
    if t.size == 0:
        return SplitAcc(0.0, 0.0, 0.0)
    correct, counts, old_c, new_c = _v2_parts(t, p, m)
    all_acc = float(correct.sum() / t.size)

    def part(cs: np.ndarray) -> float:
        return float(correct[cs].sum() / counts[cs].sum()) if cs.size else 0.0

    return SplitAcc(all_acc, part(old_c), part(new_c))


def split_cluster_acc_v2b(y_true: Any, y_pred: Any, mask: Any) -> SplitAcc:
    """SimGCD's class-balanced v2 (``split_cluster_acc_v2_balanced``; SimGCD reports it for Herbarium19).

    Same single Hungarian matching as v2. Per-class accuracy ``acc_c = w[map[c], c] / |class c|`` for each class
    present in ``y_true``; ``Old = mean(acc_c for c in set(y_true[mask]))``, ``New = mean(acc_c for c in
    set(y_true[~mask]))``, and ``All = mean`` of the concatenation of those two lists, i.e. the unweighted mean
    over all classes that occur (a class would count twice only if ``mask`` split it, which a mask defined by the
    true class never does). An empty side is 0.0 and adds no classes to All."""
    t, p = _pair(y_true, y_pred)
    m = _as_mask(mask, t.size)
    if t.size == 0:
        return SplitAcc(0.0, 0.0, 0.0)
    correct, counts, old_c, new_c = _v2_parts(t, p, m)
    per_class = correct / counts.clip(min=1)  # only read at classes that occur, where counts >= 1
    old_accs, new_accs = per_class[old_c], per_class[new_c]
    all_accs = np.concatenate([old_accs, new_accs])

    def mean(a: np.ndarray) -> float:
        return float(a.mean()) if a.size else 0.0

    return SplitAcc(mean(all_accs), mean(old_accs), mean(new_accs))


PROTOCOLS: dict[str, Callable[[Any, Any, Any], SplitAcc]] = {
    "v1": split_cluster_acc_v1,
    "v2": split_cluster_acc_v2,
    "v2b": split_cluster_acc_v2b,
}


def evaluate_split(y_true: Any, y_pred: Any, mask: Any, protocol: str = "v2") -> dict[str, float]:
    """All/Old/New accuracy under ``protocol`` ("v1", "v2" or "v2b"), as ``{"all": .., "old": .., "new": ..}``
    of plain floats (JSON-ready). ``mask`` is True where the sample's true class is Old. Samples whose ``y_true`` is
    ``NO_LABEL`` are left out (they have no class to be scored against)."""
    try:
        fn = PROTOCOLS[protocol]
    except (KeyError, TypeError):
        raise ValueError(f"unknown metric protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}") from None
    return fn(*_with_labels(y_true, y_pred, mask))._asdict()


def _with_labels(y_true: Any, y_pred: Any, mask: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The samples of (y_true, y_pred, mask) whose true class is known (``y_true != NO_LABEL``)."""
    t, p, m = _to_numpy(y_true, "y_true"), _to_numpy(y_pred, "y_pred"), _to_numpy(mask, "mask")
    if not len(t) == len(p) == len(m):
        raise ValueError(f"y_true, y_pred and mask must have one length, got {len(t)}, {len(p)} and {len(m)}")
    known = t != NO_LABEL
    return t[known], p[known], m[known]
