"""The steps whose answer is global over the ranks of a ``torch.distributed`` group: a point's rank within its
cluster (balancing), the owner of a k-means++ draw, the k-th smallest distance (k-means++ exclusion).

Every rank holds its own shard of the unlabelled points and makes the same calls; with one process each step is the
plain single-shard computation (``all_gather_cat`` returns its input).
"""

from __future__ import annotations

import torch

from infosieve_fast.common.distributed import all_gather_cat, all_reduce_sum, get_world_size


def _global_rank_within_cluster(lab: torch.Tensor, dist: torch.Tensor, K: int):
    """For every point of the global (rank-ordered) set: its rank inside its cluster by distance (ties: order).

    Returns ``(global labels, rank, offset)``; this rank's points are ``[offset, offset + len(lab))``."""
    global_lab, offset = all_gather_cat(lab)
    global_dist, _ = all_gather_cat(dist)
    order = torch.argsort(global_dist, stable=True)
    order = order[torch.argsort(global_lab[order], stable=True)]
    sorted_lab = global_lab[order]
    counts = torch.bincount(sorted_lab, minlength=K)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(sorted_lab.shape[0], device=sorted_lab.device) - starts[sorted_lab]
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return global_lab, rank, offset


def _draw_across_ranks(points: torch.Tensor, weights: torch.Tensor, total: torch.Tensor, uniform: torch.Tensor, dtype):
    """One k-means++ draw per restart over the points of all ranks: the row of the global (rank-ordered) cumulative
    distribution of ``weights`` [N, R] (``total`` [R], the global sums) at ``uniform`` [R] -> seeds [R, D].

    Each rank learns every rank's weight sum, so all agree on which rank owns each restart's draw; the owner searches
    its own cumulative weights shifted by the ranks before it, and a sum over ranks hands the seed to everyone."""
    world, device, n = get_world_size(), points.device, points.shape[0]
    rank_weights, rank = all_gather_cat(weights.sum(0)[None])  # [world, R]; offset == rank
    before = rank_weights[:rank].sum(0) / total
    upper = torch.cumsum(rank_weights / total, 0).t().contiguous()  # [R, world]
    owner = torch.searchsorted(upper, uniform[:, None])[:, 0]
    # a uniform past the rounded last upper bound belongs to the last rank with weight, as the clamp does on one rank
    last = torch.where(rank_weights > 0, torch.arange(world, device=device)[:, None], 0).max(0).values
    owner = torch.minimum(owner, last)
    seeds = torch.zeros(weights.shape[1], points.shape[1], dtype=dtype, device=device)
    mine = owner == rank
    if n and bool(mine.any()):
        cumulative = (torch.cumsum(weights / total, 0) + before).t().contiguous()
        index = torch.searchsorted(cumulative, uniform[:, None]).clamp_(max=n - 1)[:, 0]
        seeds[mine] = points[index[mine]].to(dtype)
    return all_reduce_sum(seeds)


def _global_kth_smallest(values: torch.Tensor, k: int) -> torch.Tensor:
    """Per column of ``values`` [N, R] (this rank's rows): the ``k``-th smallest value over the rows of all ranks (the
    largest value when all ranks together have fewer rows) -> [R]."""
    k_local = min(k, values.shape[0])
    smallest = torch.topk(values, k_local, dim=0, largest=False).values if k_local else values[:0]
    gathered, _ = all_gather_cat(smallest)
    gathered = torch.sort(gathered, dim=0).values
    return gathered[min(k, gathered.shape[0]) - 1]
