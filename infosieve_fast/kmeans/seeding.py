"""k-means++ from the labelled class means, for R restarts at once (docs/reference.md §5.1, §5.2)."""

from __future__ import annotations

import torch

from infosieve_fast.common.distributed import all_reduce_sum, get_world_size

from .multirank import _draw_across_ranks, _global_kth_smallest
from .problem import _Problem
from .search import _chunks


def _kmeans_pp(problem: _Problem, means: torch.Tensor, uniforms: torch.Tensor, exclude: int | None) -> torch.Tensor:
    """k-means++ from the labelled means for R restarts at once (``uniforms`` [R, K - n_labelled]) -> centres
    [R, K, D].

    The running min distance is updated against the newest centre only, and the R restarts share every pass over the
    data (one [N, D] x [D, R] GEMM per seed step instead of R GEMVs); each restart is still exactly the sequential
    k-means++ of its own uniforms.
    ``exclude``: after each new seed, drop the ``exclude`` still-available unlabelled points nearest to it from later
    draws (InfoSieve's intended behaviour, whose published version deletes the wrong rows, docs/reference.md §5.2).
    """
    n_restarts, n_labelled, device = uniforms.shape[0], problem.n_labelled, problem.device
    n = problem.unlabelled.shape[0]
    centers = torch.empty(n_restarts, problem.K, problem.unlabelled.shape[1], dtype=problem.dtype, device=device)
    centers[:, :n_labelled] = means
    dots = torch.empty(n, n_restarts, dtype=problem.dtype, device=device)  # x·c of the newest seeds
    min_sq_dist = _min_sq_dist_to_means(problem, means, n_restarts)
    available = torch.ones(n, n_restarts, dtype=torch.bool, device=device) if exclude else None
    n_global = torch.tensor(float(problem.n_unlabelled_global), dtype=torch.float64, device=device)
    for j in range(problem.K - n_labelled):
        weights, total = _draw_weights(min_sq_dist, available, n_global)
        seeds = _draw(problem, weights, total, uniforms[:, j].contiguous())
        centers[:, n_labelled + j] = seeds
        sq_dist = _sq_dist_to_seeds(problem, seeds, dots)
        min_sq_dist = sq_dist if (n_labelled == 0 and j == 0) else torch.minimum(min_sq_dist, sq_dist)
        if available is not None:
            threshold = _global_kth_smallest(sq_dist.masked_fill(~available, float("inf")), exclude)
            available &= ~(sq_dist <= threshold[None])
    return centers


def _min_sq_dist_to_means(problem: _Problem, means: torch.Tensor, n_restarts: int) -> torch.Tensor:
    """Squared distance [N, R] (fp64) of every unlabelled point to its nearest labelled mean, the same for every
    restart; all ones without labelled means (the first seed is then drawn uniformly)."""
    if problem.n_labelled:
        nearest = problem.nearest(means[None])[0][0]
        return nearest.to(torch.float64)[:, None].repeat(1, n_restarts)
    return torch.ones(problem.unlabelled.shape[0], n_restarts, dtype=torch.float64, device=problem.device)


def _draw_weights(min_sq_dist: torch.Tensor, available: torch.Tensor | None, n_global: torch.Tensor):
    """Unnormalised draw weights [N, R] and their global sums [R]: the min squared distances of the available points;
    of all points where nothing is available; uniform where every point coincides with a centre."""
    weights = min_sq_dist if available is None else min_sq_dist * available
    total = all_reduce_sum(weights.sum(0))
    if available is not None:  # everything excluded: fall back to plain k-means++ weights
        weights = torch.where(total > 0, weights, min_sq_dist)
        total = torch.where(total > 0, total, all_reduce_sum(min_sq_dist.sum(0)))
    zero = total <= 0
    weights = torch.where(zero, torch.ones_like(weights), weights)
    total = torch.where(zero, n_global, total)
    return weights, total


def _draw(problem: _Problem, weights: torch.Tensor, total: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One seed [R, D] per restart: the point where the cumulative distribution of ``weights`` reaches ``uniform``."""
    if get_world_size() > 1:
        return _draw_across_ranks(problem.unlabelled, weights, total, uniform, problem.dtype)
    cumulative = torch.cumsum(weights / total, 0).t().contiguous()  # [R, N]
    index = torch.searchsorted(cumulative, uniform[:, None]).clamp_(max=problem.unlabelled.shape[0] - 1)[:, 0]
    return problem.unlabelled[index].to(problem.dtype)


def _sq_dist_to_seeds(problem: _Problem, seeds: torch.Tensor, dots: torch.Tensor) -> torch.Tensor:
    """Squared distances [N, R] (fp64) of the unlabelled points to each restart's newest seed; ``dots`` [N, R] is the
    work buffer of the products, filled one row chunk at a time."""
    for start, end, block in _chunks(problem.unlabelled, problem.chunk, problem.dtype):
        torch.mm(block, seeds.t(), out=dots[start:end])
    return (problem.sq_norms[:, None] - 2 * dots + (seeds * seeds).sum(1)[None]).clamp_min_(0).to(torch.float64)
