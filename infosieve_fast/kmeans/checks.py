"""Input checks of :func:`~infosieve_fast.kmeans.semi_supervised_kmeans`: each names the input and the fix.

The checks run in a fixed order (the first problem found is the one reported), and those that depend on other ranks'
shards (non-finite values, global sizes, labelled classes) give every rank the same answer.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from infosieve_fast.common.distributed import all_reduce_any, all_reduce_max, all_reduce_sum

from .search import _chunks, faiss_available

_BALANCE_MODES = ("capacity", "reference")
_BACKENDS = ("auto", "torch", "faiss")
_PRECISIONS = ("fp32", "tf32", "bf16")


def _as_tensor(a, name: str) -> torch.Tensor:
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    if isinstance(a, torch.Tensor):
        return a.detach()
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(a).__name__}")


def _check_features(x: torch.Tensor, name: str, d: int | None, chunk_size: int | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if d is not None and x.shape[1] != d:
        raise ValueError(f"{name} has {x.shape[1]} features per row but u_feats has {d}")
    finite = torch.ones((), dtype=torch.bool, device=x.device)
    for _, _, block in _chunks(x, _chunk_rows(chunk_size, 1, x.shape[1], x.is_cuda), x.dtype):
        finite &= torch.isfinite(block).all()
    if all_reduce_any(not bool(finite), x.device):
        raise ValueError(f"{name} contains NaN or inf values (on some rank); clean or drop those rows first")


def _chunk_rows(chunk_size: int | None, k: int, d: int, cuda: bool) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return int(chunk_size)
    budget = 2**26 if cuda else 2**23  # elements of a [rows, K] distance block and of a [rows, D] feature block
    return max(256, budget // max(k, d, 1))


def _read_inputs(u_feats, l_feats, l_targets, chunk_size: int | None):
    """The features and targets as tensors (``None`` labelled inputs: zero rows), the features checked ->
    (unlabelled, labelled, targets)."""
    unlabelled = _as_tensor(u_feats, "u_feats")
    _check_features(unlabelled, "u_feats", None, chunk_size)
    device, dim = unlabelled.device, unlabelled.shape[1]
    labelled = _as_tensor(l_feats, "l_feats") if l_feats is not None else unlabelled.new_zeros((0, dim))
    _check_features(labelled, "l_feats", dim, chunk_size)
    targets = _as_tensor(l_targets, "l_targets") if l_targets is not None else torch.zeros(0, dtype=torch.long)
    if labelled.device != device:
        raise ValueError(f"l_feats is on {labelled.device} but u_feats is on {device}; put both on the same device")
    return unlabelled, labelled, targets


class _Options(NamedTuple):
    K: int
    compute_dtype: torch.dtype  # fp32, or fp64 for fp64 features
    backend: str  # "torch" or "faiss"
    precision: str  # distance_precision


def _check_options(unlabelled, labelled, n_clusters, n_init, max_iter, balance, backend, precision) -> _Options:
    """The scalar options, checked, with the compute dtype and the backend resolved."""
    K = int(n_clusters)
    if K < 1:
        raise ValueError(f"n_clusters must be >= 1, got {n_clusters}")
    if n_init < 1 or max_iter < 1:
        raise ValueError(f"n_init and max_iter must be >= 1, got n_init={n_init}, max_iter={max_iter}")
    if balance not in _BALANCE_MODES:
        raise ValueError(f"balance must be one of {_BALANCE_MODES}, got {balance!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if precision not in _PRECISIONS:
        raise ValueError(f"distance_precision must be one of {_PRECISIONS}, got {precision!r}")
    compute_dtype = _compute_dtype(unlabelled, labelled, precision)
    backend = _pick_backend(backend, unlabelled.is_cuda, precision)
    if backend == "faiss" and precision != "fp32":
        raise ValueError(
            f"backend='faiss' searches in fp32 only; use backend='torch' for distance_precision={precision!r}"
        )
    return _Options(K, compute_dtype, backend, precision)


def _compute_dtype(unlabelled: torch.Tensor, labelled: torch.Tensor, precision: str) -> torch.dtype:
    """fp64 when either feature matrix is fp64, else fp32; a low-precision search needs fp32 (or narrower) inputs."""
    fp64 = unlabelled.dtype == torch.float64 or labelled.dtype == torch.float64
    if precision != "fp32" and fp64:
        raise ValueError(
            f"distance_precision={precision!r} needs fp32, fp16 or bf16 features; float64 features are "
            "clustered exactly in float64: use distance_precision='fp32'"
        )
    return torch.float64 if fp64 else torch.float32


def _pick_backend(backend: str, cuda: bool, distance_precision: str) -> str:
    """``"auto"``: FAISS only where it is faster than the torch GEMMs, i.e. a GPU FAISS (``faiss.get_num_gpus() > 0``)
    with the data on CUDA (and the exact fp32 search, the only one FAISS does); torch otherwise (on the CPU the chunked
    GEMM beats FAISS's flat index, and FAISS's OpenMP runtime slows later torch work: see docs/kmeans.md)."""
    if backend != "auto":
        return backend
    return "faiss" if cuda and distance_precision == "fp32" and faiss_available(gpu=True) else "torch"


class _Layout(NamedTuple):
    targets: torch.Tensor  # [Nl] long, on the features' device
    classes: torch.Tensor  # the sorted labelled classes of all ranks
    present: torch.Tensor  # [K]: 1 for a class with labelled points on some rank, else 0
    n_unlabelled: int  # over all ranks
    capacity: int | None  # points per cluster of a balanced call; None when unbalanced


def _check_layout(unlabelled, labelled, targets, K: int, balanced: bool, cluster_size: int | None) -> _Layout:
    """The targets, and the point counts and labelled classes over all ranks, checked against K and the capacity."""
    targets = _check_targets(targets, labelled, K)
    local = torch.tensor([unlabelled.shape[0], labelled.shape[0]], dtype=torch.long, device=unlabelled.device)
    counts = all_reduce_sum(local)
    n_unlabelled, n_labelled_points = int(counts[0]), int(counts[1])
    n_points = n_unlabelled + n_labelled_points
    if n_unlabelled == 0:
        raise ValueError("u_feats is empty: semi-supervised k-means needs unlabelled points")
    present = all_reduce_max(torch.bincount(targets, minlength=K).clamp_max_(1))
    classes = torch.nonzero(present).squeeze(1)
    n_seeded = K - int(classes.numel())
    if K > n_points:
        raise ValueError(f"n_clusters={K} is larger than the number of points ({n_points})")
    if n_seeded > n_unlabelled:
        raise ValueError(f"{n_seeded} clusters need seeds but there are only {n_unlabelled} unlabelled points")
    capacity = _capacity(balanced, cluster_size, K, n_points)
    return _Layout(targets, classes, present, n_unlabelled, capacity)


def _check_targets(targets: torch.Tensor, labelled: torch.Tensor, K: int) -> torch.Tensor:
    """The labelled targets as a long vector on the features' device, one integer in 0..K-1 per labelled row."""
    targets = targets.reshape(-1)
    if targets.shape[0] != labelled.shape[0]:
        raise ValueError(f"l_targets has {targets.shape[0]} entries but l_feats has {labelled.shape[0]} rows")
    if targets.is_floating_point():
        if targets.numel() and not bool((targets == targets.round()).all() & torch.isfinite(targets).all()):
            raise ValueError("l_targets must hold integer class ids; got non-integer values")
    targets = targets.to(device=labelled.device, dtype=torch.long)
    if targets.numel() and bool(((targets < 0) | (targets >= K)).any()):
        raise ValueError(
            f"l_targets must lie in 0..{K - 1} (n_clusters={K}); got values {int(targets.min())}..{int(targets.max())}"
        )
    return targets


def _capacity(balanced: bool, cluster_size: int | None, K: int, n_points: int) -> int | None:
    """Points per cluster of a balanced call (default ``ceil(N / K)``); None when unbalanced."""
    if not balanced:
        if cluster_size is not None:
            raise ValueError("cluster_size is only used with balanced=True")
        return None
    capacity = int(cluster_size) if cluster_size is not None else math.ceil(n_points / K)
    if capacity < 1 or capacity * K < n_points:
        raise ValueError(f"cluster_size={capacity} is too small: {K} clusters x {capacity} < {n_points} points")
    return capacity
