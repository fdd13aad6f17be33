"""Assignment steps: each takes the centres [R, K, D] of R restarts and returns their unlabelled labels [R, N] and
inertia [R] (fp64)."""

from __future__ import annotations

import torch

from infosieve_fast.common.distributed import all_reduce_sum, get_world_size

from .multirank import _global_rank_within_cluster
from .problem import _counts, _Problem, _restart_ids


def _assign_plain(problem: _Problem, centers: torch.Tensor):
    sq_dist, lab = problem.nearest(centers)
    return lab, sq_dist.sum(1, dtype=torch.float64)


def _assign_capacity(problem: _Problem, centers: torch.Tensor, cap: torch.Tensor):
    """Capacity-constrained assignment in rounds (one restart, ``centers`` [1, K, D]): every pending point proposes to
    its nearest cluster that still has room; each cluster accepts its closest proposals (globally) up to its remaining
    capacity; rejected points try again without the clusters that filled up. At least one more cluster fills per
    round, so at most K rounds."""
    K, device, n = problem.K, problem.device, problem.unlabelled.shape[0]
    lab = torch.empty(n, dtype=torch.long, device=device)
    sq_dist = torch.empty(n, dtype=problem.dtype, device=device)
    room = cap.clone()
    pending = torch.arange(n, device=device)
    stored = problem.distances(centers)[0] if problem.stores_distances(1) else None
    if stored is None:
        proposed_d, proposed_k = (a[0] for a in problem.nearest(centers))
    else:
        proposed_d, proposed_k = stored.min(1)
    for _ in range(K + 1):
        global_k, rank, offset = _global_rank_within_cluster(proposed_k, proposed_d, K)
        global_accepted = rank < room[global_k]
        room = room - torch.bincount(global_k[global_accepted], minlength=K)
        accepted = global_accepted[offset : offset + pending.shape[0]]
        lab[pending[accepted]] = proposed_k[accepted]
        sq_dist[pending[accepted]] = proposed_d[accepted]
        pending = pending[~accepted]
        if bool(global_accepted.all()):
            break
        if stored is None:
            nearest = problem.nearest(centers, rows=pending, allowed=(room > 0)[None])
            proposed_d, proposed_k = (a[0] for a in nearest)
        else:  # the distances do not change within an assignment: mask the full clusters and take the argmin again
            proposed_d, proposed_k = stored[pending].masked_fill_((room <= 0)[None], float("inf")).min(1)
    return lab[None], sq_dist.sum(dtype=torch.float64)[None]


def _assign_reference_phase_a(problem: _Problem, centers: torch.Tensor, cap: torch.Tensor | None, n_pass: int):
    """InfoSieve's Phase A assignment: argmin, then ``n_pass`` balancing passes (docs/reference.md §5.2), vectorised
    over points, clusters and restarts.

    With the stored [R, N, K] distances (small problems) the freed points of every restart take their nearest cluster
    with room (a restart without room keeps its labels): on CUDA without a host sync, by taking the masked argmin of
    every point and keeping it where freed; on the CPU only the freed points are searched. Without the stored
    distances (large problems) each restart searches again only its freed rows. The returned inertia is that of the
    unbalanced argmin, as in the reference.
    """
    stored = None
    if cap is not None and n_pass and problem.stores_distances(centers.shape[0]):
        stored = problem.distances(centers)
    if stored is None:
        sq_dist, lab = problem.nearest(centers)
    else:
        sq_dist, lab = stored.min(2)
    inertia = sq_dist.sum(1, dtype=torch.float64)
    if cap is None:
        return lab, inertia
    for _ in range(n_pass):
        _balancing_pass(problem, centers, cap, stored, lab, sq_dist)
    return lab, inertia


def _balancing_pass(problem: _Problem, centers, cap, stored, lab, sq_dist) -> None:
    """One of the reference's balancing passes, in place on ``lab`` / ``sq_dist`` [R, N]: in every cluster over its
    capacity the points beyond the ``cap`` nearest are freed and move to their nearest cluster with room."""
    (n_restarts, n), K = lab.shape, problem.K
    counts = all_reduce_sum(_counts(lab, K))
    room = (counts == 1) | (counts < cap)  # the reference's 0-d squeeze makes a singleton cluster always "have room"
    over = (counts > cap) & ~room
    keep = torch.where(cap >= 0, cap, (counts + cap).clamp_min(0))  # [cap:] with cap < 0 frees only |cap| points
    ids = _restart_ids(lab, K).reshape(-1)
    global_ids, rank, offset = _global_rank_within_cluster(ids, sq_dist.reshape(-1), n_restarts * K)
    freed = over.reshape(-1)[global_ids] & (rank >= keep.reshape(-1)[global_ids])
    free = freed[offset : offset + n_restarts * n].view(n_restarts, n)
    free &= room.any(1, keepdim=True)  # a restart whose clusters are all full moves nothing
    if stored is not None and problem.host_syncs_free:
        pairs = torch.nonzero(free.view(-1)).squeeze(1)  # (restart, point) as restart * n + point
        new_d, new_k = stored.view(n_restarts * n, K)[pairs].masked_fill_(~room[pairs // n], float("inf")).min(1)
        lab.view(-1)[pairs], sq_dist.view(-1)[pairs] = new_k, new_d
    elif stored is not None:
        new_d, new_k = stored.masked_fill(~room[:, None], float("inf")).min(2)
        lab.copy_(torch.where(free, new_k, lab))
        sq_dist.copy_(torch.where(free, new_d, sq_dist))
    else:
        for r in range(n_restarts):
            rows = torch.nonzero(free[r]).squeeze(1)
            if rows.numel() or get_world_size() > 1:
                new_d, new_k = problem.nearest(centers[r : r + 1], rows=rows, allowed=room[r : r + 1])
                lab[r, rows] = new_k[0]
                sq_dist[r, rows] = new_d[0]
