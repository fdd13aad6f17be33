"""The state one clustering call shares between its steps (:class:`_Problem`) and the per-cluster statistics computed
from it: counts, centre sums, the labelled points' inertia, the centre update.

Every statistic is kept per restart: R restarts' labels [R, N] are read as one label space of R·K clusters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infosieve_fast.common.distributed import all_reduce_sum

from .search import _chunks, _TorchOps

_CAPACITY_MATRIX_MAX = 2**27  # keep the [R, N, K] distance matrix of the balancing steps up to this many entries


def _host_syncs_are_free(device: torch.device) -> bool:
    """Whether reading a value back to the host is free (the CPU): then the iterations stop once every restart has
    converged and the balancing passes search only the freed points. On CUDA the restarts run all ``max_iter``
    iterations (the converged ones unchanged) and the passes search every point, without a host sync."""
    return device.type != "cuda"


@dataclass
class _Problem:
    """One call's data, its global labelled statistics, its search and its limits (the entry fills in the last two
    from its own module per call; a problem built by hand gets the defaults)."""

    unlabelled: torch.Tensor  # [Nu, D] as given (possibly half precision; converted per chunk)
    sq_norms: torch.Tensor  # [Nu] squared norms of the unlabelled rows, compute dtype
    labelled: torch.Tensor  # [Nl, D]
    labelled_ids: torch.Tensor  # [Nl] internal cluster ids (0..n_labelled-1)
    K: int
    n_labelled: int  # clusters that hold labelled points: internal ids 0..n_labelled-1
    labelled_sums: torch.Tensor  # [K, D] global sums of labelled points per cluster, compute dtype
    labelled_counts: torch.Tensor  # [K] global counts of labelled points per cluster (long)
    n_unlabelled_global: int
    ops: _TorchOps
    chunk: int
    labelled_sq: torch.Tensor | float = 0.0  # global Σ ||l||² (fp64)
    stored_distances_max: int = _CAPACITY_MATRIX_MAX  # largest [R, N, K] distance matrix the balancing steps keep
    host_syncs_free: bool | None = None  # None: decided by the device (_host_syncs_are_free)
    labelled_sums64: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.labelled_sums64 = self.labelled_sums.to(torch.float64)
        if self.host_syncs_free is None:
            self.host_syncs_free = _host_syncs_are_free(self.device)

    @property
    def device(self):
        return self.unlabelled.device

    @property
    def dtype(self):
        """The compute dtype (fp32, or fp64 for fp64 inputs)."""
        return self.labelled_sums.dtype

    def nearest(self, centers: torch.Tensor, rows: torch.Tensor | None = None, allowed: torch.Tensor | None = None):
        """:meth:`_TorchOps.nearest` for the unlabelled points."""
        return self.ops.nearest(self.unlabelled, self.sq_norms, centers, rows=rows, allowed=allowed)

    def distances(self, centers: torch.Tensor) -> torch.Tensor:
        """:meth:`_TorchOps.distances` of the unlabelled points, [R, N, K]."""
        return self.ops.distances(self.unlabelled, self.sq_norms, centers)

    def stores_distances(self, n_restarts: int) -> bool:
        """Whether the full [R, N, K] distance matrix of ``n_restarts`` restarts is small enough to keep."""
        return n_restarts * self.unlabelled.shape[0] * self.K <= self.stored_distances_max


def _labelled_inertia(problem: _Problem, centers: torch.Tensor) -> torch.Tensor:
    """Σ ||l - C[lab]||² per restart of ``centers`` [R, K, D] from per-cluster statistics, O(R·K·D):
    Σ||l||² - 2 Σ_k C_k·S_k + Σ_k n_k ||C_k||² (fp64) -> [R]."""
    centers64 = centers.to(torch.float64)
    cross = (centers64 * problem.labelled_sums64).sum((1, 2))
    squares = (problem.labelled_counts.to(torch.float64) * (centers64 * centers64).sum(2)).sum(1)
    return problem.labelled_sq - 2 * cross + squares


def _restart_ids(lab: torch.Tensor, K: int) -> torch.Tensor:
    """Labels [R, N] of R restarts as ids of one label space of R·K clusters: restart r's cluster k is r·K + k."""
    return lab + K * torch.arange(lab.shape[0], device=lab.device)[:, None]


def _counts(lab: torch.Tensor, K: int) -> torch.Tensor:
    """Points per cluster of each restart: labels [R, N] -> [R, K]."""
    return torch.bincount(_restart_ids(lab, K).reshape(-1), minlength=lab.shape[0] * K).view(lab.shape[0], K)


def _cluster_sums(
    x: torch.Tensor, lab: torch.Tensor, K: int, chunk: int, dtype: torch.dtype, segments: bool | None = None
) -> torch.Tensor:
    """Per-cluster sums [R, K, D] of the rows of ``x`` in ``dtype`` under the labels [R, N] of R restarts.

    Deterministic, and each restart's sums are added in the order a lone restart adds them: ``index_add_`` on the CPU
    (rows in order); on CUDA (``segments`` None) each restart's rows are sorted by cluster and every row chunk is summed
    as contiguous segments, one segment per (restart, cluster), in one call (no atomics, and O(R·N·D) instead of the
    O(R·N·K·D) of a one-hot GEMM), a block holding ``chunk // R`` rows of each restart."""
    if not (x.is_cuda if segments is None else segments):
        return _cluster_sums_index_add(x, lab, K, chunk, dtype)
    n_restarts, n = lab.shape
    out = torch.zeros(n_restarts * K, x.shape[1], dtype=dtype, device=x.device)
    rows = max(1, chunk // n_restarts)
    order = torch.argsort(lab, dim=1, stable=True)
    ends = torch.cumsum(_counts(lab, K), 1)  # restart r's cluster k holds its sorted rows [ends - counts, ends)
    starts = ends - _counts(lab, K)
    for start in range(0, n, rows):
        end = min(start + rows, n)
        block = x[order[:, start:end].reshape(-1)].to(dtype)
        lengths = (ends.clamp(max=end) - starts.clamp(min=start)).clamp_min_(0)  # each cluster's rows in this chunk
        out += torch.segment_reduce(block, "sum", lengths=lengths.reshape(-1), axis=0, unsafe=True)
    return out.view(n_restarts, K, -1)


def _cluster_sums_index_add(x: torch.Tensor, lab: torch.Tensor, K: int, chunk: int, dtype: torch.dtype):
    """:func:`_cluster_sums` with ``index_add_``, rows in order (the CPU path)."""
    out = torch.zeros(lab.shape[0], K, x.shape[1], dtype=dtype, device=x.device)
    for start, end, block in _chunks(x, chunk, dtype):
        for r in range(lab.shape[0]):  # on the CPU one call per restart costs nothing and saves R copies of the chunk
            out[r].index_add_(0, lab[r, start:end], block)
    return out


def _update_centers(
    problem: _Problem, centers: torch.Tensor, u_lab: torch.Tensor, frozen: torch.Tensor | None
) -> torch.Tensor:
    """New centres [R, K, D] from the centres ``centers`` and unlabelled labels ``u_lab`` [R, N] of R restarts."""
    sums = all_reduce_sum(_cluster_sums(problem.unlabelled, u_lab, problem.K, problem.chunk, problem.dtype))
    counts = all_reduce_sum(_counts(u_lab, problem.K))
    sums += problem.labelled_sums
    counts = counts + problem.labelled_counts
    keep = counts == 0  # empty cluster keeps its centre (the reference gives NaN here)
    if frozen is not None:
        keep = keep | frozen
    new = sums / counts.clamp_min(1).to(sums.dtype)[..., None]
    return torch.where(keep[..., None], centers, new)
