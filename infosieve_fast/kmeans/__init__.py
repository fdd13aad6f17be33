"""Semi-supervised k-means (docs/reference.md §5) at hardware speed.

One entry point, :func:`semi_supervised_kmeans`. Semantics follow GCD's ``fit_mix`` (docs/reference.md §5.1) and, for
``balance="reference"``, InfoSieve's two-phase variant (§5.2), with the published bugs fixed (see ``docs/kmeans.md``):

* k-means++ starts from the labelled class means; new seeds are drawn from the unlabelled points with probability
  proportional to the running min squared distance, which is updated against the newest centre only (O(N·K·D)).
  The uniforms come from ``numpy.random.RandomState(seed)``, one per new seed, restarts one after another sharing the
  stream, exactly as the reference draws them; so seeds equal the reference's for the same ``seed``.
* Labelled points keep their class. All centres move (reference) unless ``freeze_labelled_centers``.
* An empty cluster keeps its previous centre (the reference produces NaN).
* Each iteration records the inertia computed with the pre-update centres; the best iteration (strict ``<``) over all
  iterations and restarts is returned (reference semantics), its labels and the centres updated from them.
* Stop when ``(Σ_k ||Δc_k||)² < tol`` or after ``max_iter`` iterations.

Backends: ``torch`` (chunked GEMM nearest-centre search, exact in fp32 by default or low precision with an exact
recheck of the rows near a tie; ``index_add_`` on the CPU and sorted segment sums on CUDA for deterministic centre
sums) and ``faiss`` (flat L2 index for the searches, a GPU index when the FAISS build has GPUs and the data are on
CUDA; the distance to the chosen centre is then recomputed in the compute dtype, as after a low-precision search).
Half-precision features stay half precision: every pass converts one row chunk at a time. No Python loop over points
or clusters: the only Python loops are over iterations, balancing passes, k-means++ seeds, capacity rounds and row
chunks. The restarts run as one batch (one batched GEMM per distance pass, per-restart centre sums in one call, every
restart's state on the device), each exactly as it would run alone. With the exact fp32 search (and, for balanced
``balance="reference"``, the stored [R, N, K] distances of small problems) an iteration makes no host sync on CUDA, so
a round syncs a fixed number of times however many iterations it runs. Capacity mode (balanced
``balance="capacity"``), whose rounds differ per restart, runs the restarts one after another; the low-precision and
FAISS searches, whose work depends on each restart's centres, search for them one after another.

Under ``torch.distributed`` every rank passes its own shard (labelled and unlabelled) and gets the exact global
clustering: per-cluster sums and counts are all-reduced, k-means++ samples over the global distribution, and the
balancing steps rank points globally. Labels returned are those of the rank's own shard; centres are global.

The package, in the order of a call: ``checks`` (inputs), ``problem`` (the state shared by the steps, per-cluster
statistics), ``seeding`` (k-means++), ``restarts`` (the iterations of a batch of restarts), ``assign`` (their
assignment steps, balanced or not), ``search`` (nearest-centre searches), ``multirank`` (the steps that are global over
ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from infosieve_fast.common.distributed import all_reduce_sum

from .checks import _check_layout, _check_options, _chunk_rows, _Layout, _Options, _read_inputs
from .problem import _CAPACITY_MATRIX_MAX, _cluster_sums, _host_syncs_are_free, _Problem
from .restarts import _run_restarts
from .search import _chunks, _cuda_matmul_precision, _FaissOps, _sq_norms, _TorchOps, faiss_available
from .seeding import _kmeans_pp

__all__ = ["KMeansResult", "semi_supervised_kmeans", "faiss_available"]

_KPP_ARRAY_BYTES = 2**27  # k-means++ batches restarts so that each [N, restarts] fp64 work array stays below this


@dataclass
class KMeansResult:
    """Result of :func:`semi_supervised_kmeans`.

    labels: long tensor [Nl + Nu] on the input device, labelled rows first, then unlabelled (this rank's shard).
    centers: [K, D] in the compute dtype (fp32, or fp64 for fp64 inputs); row ``c`` is cluster ``c``.
    inertia: sum of squared distances of the kept iteration (global over ranks), computed with the pre-update centres.
    n_iter: iterations run in the kept restart (both phases for ``balance="reference"``).
    history: inertia per iteration of the kept restart.
    searched_rows / rechecked_rows (``distance_precision`` other than fp32; all searches of the call, all ranks): rows
    searched with the low-precision GEMM, and those of them searched again exactly because their best and second-best
    centres were closer than the GEMM's error bound.
    """

    labels: torch.Tensor
    centers: torch.Tensor
    inertia: float
    n_iter: int
    history: list[float] = field(default_factory=list)
    backend: str = "torch"
    best_init: int = 0
    searched_rows: int = 0
    rechecked_rows: int = 0


@_cuda_matmul_precision("ieee")  # "fp32" means fp32 even where the caller allowed TF32 globally
def semi_supervised_kmeans(
    u_feats,
    l_feats,
    l_targets,
    n_clusters: int,
    *,
    n_init: int = 10,
    max_iter: int = 10,
    tol: float = 1e-4,
    balanced: bool = False,
    balance: str = "capacity",
    cluster_size: int | None = None,
    freeze_labelled_centers: bool = False,
    seed: int = 0,
    backend: str = "auto",
    chunk_size: int | None = None,
    distance_precision: str = "fp32",
) -> KMeansResult:
    """Semi-supervised k-means of unlabelled ``u_feats`` [Nu, D] with labelled ``l_feats`` [Nl, D] / ``l_targets``.

    Features: torch tensors or numpy arrays, any float dtype, CPU or CUDA (computation in fp32, or fp64 for fp64
    inputs; fp16/bf16 features are converted one row chunk at a time, never as a whole, and give exactly the result of
    their fp32 upcast). ``l_targets``: integer-valued, in ``0..n_clusters-1``; labelled class ``c`` is cluster ``c``
    and keeps its points. The clusters without labelled points are seeded by k-means++ in increasing id order;
    ``l_feats`` may have zero rows (plain k-means++ / Lloyd).

    ``balance="capacity"`` (default) with ``balanced=False``: GCD's one-phase SS-k-means (docs/reference.md §5.1).
    ``balance="reference"``: InfoSieve's two phases (§5.2): Phase A with frozen labelled centres, then Phase B of
    plain iterations from Phase A's state; best inertia over both phases (strict ``<``). With ``balanced=False``
    Phase A has no capacity (the published code with ``cluster_size=None``, Herbarium19's ``--unbalanced``).

    ``balanced=True`` with capacity ``cluster_size`` (default ``ceil(N / K)``, N = all points over all ranks):

    * ``balance="capacity"``: every assignment step is capacity-constrained, so the returned labels never put more
      than ``cluster_size`` points in a cluster (a cluster whose labelled points alone exceed it gets no unlabelled
      point).
    * ``balance="reference"``: Phase A runs the reference's balancing passes (``it`` passes at iteration ``it``); in
      practice Phase B wins, so the labels are not balanced — a balanced warm start. k-means++ excludes the
      ``cluster_size`` points nearest each new seed (the intended behaviour of the reference's buggy row deletion).

    ``freeze_labelled_centers``: labelled clusters keep their class mean as centre (all iterations / phases).
    ``backend``: ``"torch"``, ``"faiss"`` or ``"auto"`` (``checks._pick_backend``: FAISS when it has GPU support, the
    features are on CUDA and ``distance_precision="fp32"``; torch otherwise).
    ``chunk_size``: rows per block (default: about 8M (CPU) / 64M (CUDA) entries per [rows, max(K, D)] block).
    ``distance_precision`` (torch backend, fp32/fp16/bf16 features): ``"fp32"`` (default) exact nearest-centre
    searches, the published behaviour; ``"tf32"`` / ``"bf16"`` run the search GEMM in that precision and re-search
    exactly every row whose two nearest centres are within the GEMM's rigorous error bound, so the labels are those of
    ``"fp32"``; ``KMeansResult.searched_rows`` / ``rechecked_rows`` count them.
    """
    unlabelled, labelled, targets = _read_inputs(u_feats, l_feats, l_targets, chunk_size)
    options = _check_options(unlabelled, labelled, n_clusters, n_init, max_iter, balance, backend, distance_precision)
    layout = _check_layout(unlabelled, labelled, targets, options.K, balanced, cluster_size)
    problem, means, slot = _build_problem(unlabelled, labelled, layout, options, chunk_size)
    seeds = _seeds(problem, means, n_init, seed, exclude=layout.capacity if balance == "reference" else None)
    best = _best_of_restarts(problem, seeds, max_iter, tol, balance, layout.capacity, freeze_labelled_centers)
    return _result(problem, best, slot)


def _build_problem(unlabelled, labelled, layout: _Layout, options: _Options, chunk_size: int | None):
    """The state shared by the steps -> (problem, labelled class means [n_labelled, D], internal id -> cluster id).

    Internal ids put the labelled classes first, in sorted order (as the reference)."""
    if options.backend == "faiss" and not faiss_available():
        raise ImportError("backend='faiss' needs the faiss package (pip install faiss-cpu); or use backend='torch'")
    K, n_labelled, compute_dtype = options.K, int(layout.classes.numel()), options.compute_dtype
    chunk = _chunk_rows(chunk_size, K, unlabelled.shape[1], unlabelled.is_cuda)
    labelled_ids = torch.searchsorted(layout.classes, layout.targets)
    slot = torch.cat([layout.classes, torch.nonzero(layout.present == 0).squeeze(1)])
    sums = all_reduce_sum(_cluster_sums(labelled, labelled_ids[None], K, chunk, compute_dtype)[0])
    counts = all_reduce_sum(torch.bincount(labelled_ids, minlength=K))
    means = sums[:n_labelled] / counts[:n_labelled, None].to(compute_dtype)
    ops = _FaissOps(chunk, unlabelled.is_cuda) if options.backend == "faiss" else _TorchOps(chunk, options.precision)
    labelled_sq = torch.zeros((), dtype=torch.float64, device=unlabelled.device)
    for _, _, block in _chunks(labelled, chunk, torch.float64):
        labelled_sq += (block * block).sum()
    labelled_sq = all_reduce_sum(labelled_sq.reshape(1))[0]
    sq_norms = _sq_norms(unlabelled, chunk, compute_dtype)
    problem = _Problem(
        unlabelled=unlabelled,
        sq_norms=sq_norms,
        labelled=labelled,
        labelled_ids=labelled_ids,
        K=K,
        n_labelled=n_labelled,
        labelled_sums=sums,
        labelled_counts=counts,
        n_unlabelled_global=layout.n_unlabelled,
        ops=ops,
        chunk=chunk,
        labelled_sq=labelled_sq,
        stored_distances_max=_CAPACITY_MATRIX_MAX,  # read per call: tests shrink it on this module
        host_syncs_free=_host_syncs_are_free(unlabelled.device),
    )
    return problem, means, slot


def _seeds(problem: _Problem, means: torch.Tensor, n_init: int, seed: int, exclude: int | None) -> torch.Tensor:
    """k-means++ seeds [n_init, K, D] of every restart; the restarts share passes over the data, a batch at a time."""
    n_seeds = problem.K - problem.n_labelled
    draws = np.random.RandomState(seed).random_sample(n_init * n_seeds)
    uniforms = torch.from_numpy(draws).to(problem.device).reshape(n_init, n_seeds)
    batch = max(1, min(n_init, _KPP_ARRAY_BYTES // max(1, 8 * problem.unlabelled.shape[0])))
    return torch.cat([_kmeans_pp(problem, means, uniforms[r : r + batch], exclude) for r in range(0, n_init, batch)])


def _best_of_restarts(problem: _Problem, seeds, max_iter, tol, balance, capacity: int | None, freeze: bool):
    """Run the restarts from ``seeds`` -> :meth:`restarts._Runs.best_restart` of the best, its index over all restarts.

    All restarts run in one batch, except in capacity mode, whose rounds differ in length per restart."""
    frozen = None
    if freeze:
        frozen = torch.zeros(problem.K, dtype=torch.bool, device=problem.device)
        frozen[: problem.n_labelled] = True
    # room left for unlabelled points (negative: labelled overflow)
    cap = None if capacity is None else capacity - problem.labelled_counts
    n_init = seeds.shape[0]
    batch = 1 if (cap is not None and balance == "capacity") else n_init
    best = None
    for first in range(0, n_init, batch):
        found = _run_restarts(problem, seeds[first : first + batch], max_iter, tol, balance, cap, frozen)
        if best is None or found[0] < best[0]:
            best = found[:3] + (first + found[3],) + found[4:]
    return best


def _result(problem: _Problem, best: tuple, slot: torch.Tensor) -> KMeansResult:
    """The best restart with the internal cluster ids mapped back to the caller's."""
    inertia, history, n_iter, best_init, unlabelled_ids, internal_centers = best
    labels = torch.cat([slot[problem.labelled_ids], slot[unlabelled_ids]])
    centers = torch.empty_like(internal_centers)
    centers[slot] = internal_centers
    ops = problem.ops
    counts = all_reduce_sum(torch.tensor([ops.searched, ops.rechecked], dtype=torch.long, device=problem.device))
    return KMeansResult(labels, centers, inertia, n_iter, history, ops.name, best_init, int(counts[0]), int(counts[1]))
