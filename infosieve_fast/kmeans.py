"""Semi-supervised k-means (REFERENCE.md §5) at hardware speed.

One entry point, :func:`semi_supervised_kmeans`. Semantics follow GCD's ``fit_mix`` (REFERENCE.md §5.1) and, for
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
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from infosieve_fast.distributed import all_gather_cat, all_reduce_any, all_reduce_max, all_reduce_sum, get_world_size

__all__ = ["KMeansResult", "semi_supervised_kmeans", "faiss_available"]

_BALANCE_MODES = ("capacity", "reference")
_BACKENDS = ("auto", "torch", "faiss")
_PRECISIONS = ("fp32", "tf32", "bf16")
_CAPACITY_MATRIX_MAX = 2**27  # keep the [N, K] distance matrix for capacity rounds up to this many entries
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


def faiss_available(gpu: bool = False) -> bool:
    """Whether ``faiss`` imports (and, with ``gpu=True``, whether it was built with GPU support and sees a GPU)."""
    try:
        import faiss
    except ImportError:
        return False
    return not gpu or (hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0)


def _pick_backend(backend: str, cuda: bool, distance_precision: str) -> str:
    """``"auto"``: FAISS only where it is faster than the torch GEMMs, i.e. a GPU FAISS with the data on CUDA (and the
    exact fp32 search, the only one FAISS does); torch otherwise (on the CPU torch measured about 2x faster)."""
    if backend != "auto":
        return backend
    return "faiss" if cuda and distance_precision == "fp32" and faiss_available(gpu=True) else "torch"


# ------------------------------------------------------------------------------------------------------------ chunks
def _chunks(x: torch.Tensor, rows: int, dtype: torch.dtype, index: torch.Tensor | None = None):
    """Yield ``(start, end, block)``: ``x[start:end]`` (or ``x[index[start:end]]``) converted to ``dtype``, so that a
    half-precision matrix is only ever upcast one block of rows at a time."""
    n = x.shape[0] if index is None else index.shape[0]
    for s in range(0, n, rows):
        e = min(s + rows, n)
        yield s, e, (x[s:e] if index is None else x[index[s:e]]).to(dtype)


def _sq_norms(x: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=dtype, device=x.device)
    for s, e, xc in _chunks(x, rows, dtype):
        out[s:e] = (xc * xc).sum(1)
    return out


@contextmanager
def _cuda_matmul_precision(precision: str) -> Iterator[None]:
    """Set CUDA fp32 matmuls to ``"ieee"`` or ``"tf32"`` for the block, then restore the caller's setting."""
    m = torch.backends.cuda.matmul
    old = m.fp32_precision
    m.fp32_precision = precision
    try:
        yield
    finally:
        m.fp32_precision = old


# ------------------------------------------------------------------------------------------- low-precision distances
_U_IN = {"tf32": 2.0**-10, "bf16": 2.0**-8}  # relative input rounding: TF32 may truncate (2^-10), bf16 rounds (2^-8)
_U_ACC = 2.0**-23  # per-addition error of fp32 accumulation: twice fp32's unit roundoff, covering truncating adders


def _recheck_threshold(precision: str, d: int, bf16_out: bool, x_norm: torch.Tensor, c_max: torch.Tensor):
    """Rows whose low-precision gap (second-best minus best of ``c2 - 2 x·c``) is at most this are re-searched exactly.

    Error model (Higham, Accuracy and Stability of Numerical Algorithms, §3.1): the inputs are rounded with relative
    error ``u_in``; products are exact in fp32 (11 x 11 or 8 x 8 significand bits); sums of the ``d`` products, in any
    order, err by at most ``γ = d·u_acc / (1 - d·u_acc)`` times ``Σ|x_i c_i|``; a bf16 result is rounded once more
    (``u_out = 2^-8``). With ``Σ|x_i c_i| <= ||x|| ||c||`` (Cauchy-Schwarz):
        |Ĝ - x·c| <= e_low ||x|| ||c||,  e_low = (1 + u_in)² (1 + γ) (1 + u_out) - 1,
    and the exact fp32 path's own product errs by at most ``γ ||x|| ||c||``. Both sides then round ``c2 - 2G`` once
    (<= 2^-24 (||c||² + 2|G|) each; ``c2`` is the same fp32 vector on both sides), and flushed subnormal products
    add at most ``d·2^-126`` per product sum. So each candidate value differs from the fp32 path's by at most
        E = 2 (e_low + γ) ||x|| c_max + 2^-23 (c_max² + 2 (1 + e_low) ||x|| c_max) + 4 d 2^-126,
    with ``c_max`` the largest centre norm. If ``second - best > 2E``, the low-precision argmin is strictly below every
    other centre in the fp32 path too, i.e. it is the fp32 argmin. The factor 1.01 covers the fp32 rounding of the
    norms, of this bound and of the gap (all below 1e-4 relative).
    """
    gamma = d * _U_ACC / (1 - d * _U_ACC)
    e_low = (1 + _U_IN[precision]) ** 2 * (1 + gamma) * (1 + (2.0**-8 if bf16_out else 0.0)) - 1
    xn_cn = x_norm * c_max
    err = 2 * (e_low + gamma) * xn_cn + 2.0**-23 * (c_max * c_max + 2 * (1 + e_low) * xn_cn) + 4 * d * 2.0**-126
    return 2 * 1.01 * err


# ----------------------------------------------------------------------------------------------------------- searches
def _direct_sqdist(xc: torch.Tensor, centers: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """||x - C[idx]||² per row, in the compute dtype (the distance to a centre found by an inexact search)."""
    return (xc - centers[idx]).pow_(2).sum(1)


def _batched_gemm_distances(xc: torch.Tensor, centers: torch.Tensor, c2: torch.Tensor) -> torch.Tensor:
    """``||c||² - 2 x·c`` [R, rows, K] for the rows ``xc`` and the centres ``centers`` [R, K, D] (``c2`` [R, K]) of R
    restarts, in one batched GEMM. On the CPU each restart's block equals bit for bit the lone restart's
    ``addmm(c2, xc, C.t())``; on CUDA cuBLAS may pick another kernel for the batch, so a distance can differ in the
    last bit (a label only where two centres tie to that bit)."""
    return torch.baddbmm(c2[:, None], xc.expand(centers.shape[0], -1, -1), centers.transpose(1, 2), beta=1, alpha=-2)


class _TorchOps:
    """Nearest-centre search with chunked GEMMs ``||x||² - 2 x·c + ||c||²``.

    ``precision="fp32"``: one exact GEMM in the compute dtype (the published behaviour); the distances are the GEMM's.
    ``"tf32"`` / ``"bf16"``: the GEMM runs in that precision, the two nearest candidates are kept, and every row whose
    gap is within the GEMM's error bound (:func:`_recheck_threshold`) is searched again exactly, so the argmin equals
    the fp32 GEMM's; the distance to the chosen centre is then recomputed directly in the compute dtype.
    """

    name = "torch"

    def __init__(self, chunk_rows: int, precision: str = "fp32"):
        self.chunk_rows = chunk_rows
        self.precision = precision
        self.searched = 0
        self.rechecked = 0

    def nearest(self, x, x2, centers, rows=None, allowed=None):
        """(squared distance, index), each [R, n], of the nearest centre of ``centers[r][allowed[r]]`` (indices into all
        of ``centers[r]``) for each row of ``x[rows]`` (all rows if None) and each restart ``r`` of ``centers``
        [R, K, D] (``allowed`` [R, K] or None); ``x2``: the squared norms of all rows of ``x``.

        The exact fp32 search takes all restarts in one batched GEMM (:func:`_batched_gemm_distances`); the
        low-precision search (whose rechecks depend on each restart's gaps) and FAISS take the restarts one after
        another."""
        if self.name == "torch" and self.precision == "fp32":
            return self._nearest_batched(x, x2, centers, rows, allowed)
        found = [
            self._nearest_one(x, x2, centers[r], rows, None if allowed is None else allowed[r])
            for r in range(len(centers))
        ]
        return torch.stack([d for d, _ in found]), torch.stack([i for _, i in found])

    def _nearest_batched(self, x, x2, centers, rows, allowed):
        R = centers.shape[0]
        c2 = (centers * centers).sum(2)
        if allowed is not None:
            c2 = c2.masked_fill(~allowed, float("inf"))
        n = x.shape[0] if rows is None else rows.shape[0]
        d_out = torch.empty(R, n, dtype=centers.dtype, device=centers.device)
        i_out = torch.empty(R, n, dtype=torch.long, device=centers.device)
        for s, e, xc in _chunks(x, max(1, self.chunk_rows // R), centers.dtype, rows):
            dmin, i_out[:, s:e] = _batched_gemm_distances(xc, centers, c2).min(2)
            x2c = x2[s:e] if rows is None else x2[rows[s:e]]
            d_out[:, s:e] = (dmin + x2c).clamp_min_(0)
        return d_out, i_out

    def _nearest_one(self, x, x2, centers, rows, allowed):
        """:meth:`nearest` of one restart's centres ``centers`` [K, D] -> [n] each."""
        n = x.shape[0] if rows is None else rows.shape[0]
        d_out = torch.empty(n, dtype=centers.dtype, device=centers.device)
        i_out = torch.empty(n, dtype=torch.long, device=centers.device)
        prep = self._prepare(centers, allowed)
        for s, e, xc in _chunks(x, self.chunk_rows, centers.dtype, rows):
            d_out[s:e], i_out[s:e] = self._search(xc, x2[s:e] if rows is None else x2[rows[s:e]], centers, prep)
        return d_out, i_out

    def _prepare(self, centers, allowed):
        c2 = (centers * centers).sum(1)
        if allowed is not None:
            c2 = c2.masked_fill(~allowed, float("inf"))
        if self.precision == "fp32" or centers.shape[0] < 2:
            return c2, None
        c_norm = centers.norm(dim=1)
        c_max = (c_norm if allowed is None else c_norm.masked_fill(~allowed, 0)).max()
        c_low = centers.t() if self.precision == "tf32" else centers.to(torch.bfloat16).t()
        return c2, (c_low, c_max)

    def _search(self, xc, x2c, centers, prep):
        c2, low = prep
        if low is None:
            dmin, idx = torch.addmm(c2, xc, centers.t(), beta=1, alpha=-2).min(1)
            return (dmin + x2c).clamp_min_(0), idx
        c_low, c_max = low
        if self.precision == "tf32":
            with _cuda_matmul_precision("tf32"):  # on the CPU this is an fp32 GEMM, inside the same bound
                g = xc @ c_low
        elif xc.is_cuda:
            g = torch.mm(xc.to(torch.bfloat16), c_low, out_dtype=torch.float32)
        else:
            g = xc.to(torch.bfloat16) @ c_low  # bf16 result on the CPU: its rounding is part of the bound
        top_v, top_i = torch.add(c2, g, alpha=-2).topk(2, dim=1, largest=False)
        thr = _recheck_threshold(self.precision, xc.shape[1], g.dtype == torch.bfloat16, x2c.sqrt(), c_max)
        redo = torch.nonzero(top_v[:, 1] - top_v[:, 0] <= thr).squeeze(1)
        idx = top_i[:, 0]
        self.searched += xc.shape[0]
        self.rechecked += redo.numel()
        if redo.numel():
            idx[redo] = torch.addmm(c2, xc[redo], centers.t(), beta=1, alpha=-2).min(1).indices
        return _direct_sqdist(xc, centers, idx), idx

    def distances(self, x, x2, centers):
        """Full [R, N, K] squared distances to the centres ``centers`` [R, K, D] of R restarts (chunked exact GEMM)."""
        R, K, _ = centers.shape
        c2 = (centers * centers).sum(2)
        out = torch.empty(R, x.shape[0], K, dtype=centers.dtype, device=centers.device)
        for s, e, xc in _chunks(x, max(1, self.chunk_rows // R), centers.dtype):
            out[:, s:e] = _batched_gemm_distances(xc, centers, c2).add_(x2[s:e, None]).clamp_min_(0)
        return out


class _FaissOps(_TorchOps):
    """Nearest-centre search with a FAISS flat L2 index (fp32; a GPU index when FAISS has GPUs and the data are on
    CUDA), one row chunk of queries at a time; the distance to the chosen centre is recomputed in the compute dtype so
    that inertia is comparable across backends."""

    name = "faiss"

    def __init__(self, chunk_rows: int, cuda: bool):
        super().__init__(chunk_rows)
        import faiss

        self.faiss = faiss
        self.gpu = cuda and faiss_available(gpu=True)
        if self.gpu:
            import faiss.contrib.torch_utils  # noqa: F401  (lets FAISS take torch CUDA tensors)

            self.res = faiss.StandardGpuResources()

    def _prepare(self, centers, allowed):
        ids = None if allowed is None else torch.nonzero(allowed).squeeze(1)
        Cs = (centers if ids is None else centers[ids]).float().contiguous()
        if self.gpu:
            index = self.faiss.GpuIndexFlatL2(self.res, centers.shape[1])
            index.add(Cs)
        else:
            index = self.faiss.IndexFlatL2(centers.shape[1])
            index.add(Cs.cpu().numpy())
        return index, ids

    def _search(self, xc, x2c, centers, prep):
        index, ids = prep
        q = xc.float().contiguous()
        if self.gpu:
            idx = index.search(q, 1)[1][:, 0].to(xc.device).long()
        else:
            idx = torch.from_numpy(index.search(q.cpu().numpy(), 1)[1][:, 0]).to(xc.device).long()
        if ids is not None:
            idx = ids[idx]
        return _direct_sqdist(xc, centers, idx), idx


# -------------------------------------------------------------------------------------------------------- validation
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
    for _, _, xc in _chunks(x, _chunk_rows(chunk_size, 1, x.shape[1], x.is_cuda), x.dtype):
        finite &= torch.isfinite(xc).all()
    if all_reduce_any(not bool(finite), x.device):
        raise ValueError(f"{name} contains NaN or inf values (on some rank); clean or drop those rows first")


def _chunk_rows(chunk_size: int | None, k: int, d: int, cuda: bool) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return int(chunk_size)
    budget = 2**26 if cuda else 2**23  # elements of a [rows, K] distance block and of a [rows, D] feature block
    return max(256, budget // max(k, d, 1))


# ------------------------------------------------------------------------------------------------------ shared state
@dataclass
class _Problem:
    u: torch.Tensor  # [Nu, D] as given (possibly half precision; converted per chunk)
    x2: torch.Tensor  # [Nu] squared norms, compute dtype
    l: torch.Tensor  # [Nl, D]
    lab_l: torch.Tensor  # [Nl] internal cluster ids (0..nL-1)
    K: int
    nL: int
    l_sums: torch.Tensor  # [K, D] global sums of labelled points per cluster, compute dtype
    l_cnt: torch.Tensor  # [K] global counts of labelled points per cluster (long)
    n_u_global: int
    ops: _TorchOps
    chunk: int
    l_sq: torch.Tensor | float = 0.0  # global Σ ||l||² (fp64)
    l_sums64: torch.Tensor | None = None

    def __post_init__(self):
        self.l_sums64 = self.l_sums.to(torch.float64)

    @property
    def device(self):
        return self.u.device

    @property
    def dtype(self):
        """The compute dtype (fp32, or fp64 for fp64 inputs)."""
        return self.l_sums.dtype


def _labelled_inertia(problem: _Problem, centers: torch.Tensor) -> torch.Tensor:
    """Σ ||l - C[lab]||² per restart of ``centers`` [R, K, D] from per-cluster statistics, O(R·K·D):
    Σ||l||² - 2 Σ_k C_k·S_k + Σ_k n_k ||C_k||² (fp64) -> [R]."""
    centers64 = centers.to(torch.float64)
    cross = (centers64 * problem.l_sums64).sum((1, 2))
    return problem.l_sq - 2 * cross + (problem.l_cnt.to(torch.float64) * (centers64 * centers64).sum(2)).sum(1)


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
    (rows in order); on CUDA (``segments`` None) each restart's rows
    are sorted by cluster and every row chunk is summed as contiguous segments, one segment per (restart, cluster), in
    one call (no atomics, and O(R·N·D) instead of the O(R·N·K·D) of a one-hot GEMM), a block holding ``chunk // R``
    rows of each restart."""
    R, n = lab.shape
    if not (x.is_cuda if segments is None else segments):
        out = torch.zeros(R, K, x.shape[1], dtype=dtype, device=x.device)
        for s, e, xc in _chunks(x, chunk, dtype):
            for r in range(R):  # on the CPU one call per restart costs nothing and saves R copies of the chunk
                out[r].index_add_(0, lab[r, s:e], xc)
        return out
    out = torch.zeros(R * K, x.shape[1], dtype=dtype, device=x.device)
    rows = max(1, chunk // R)
    order = torch.argsort(lab, dim=1, stable=True)
    ends = torch.cumsum(_counts(lab, K), 1)  # restart r's cluster k holds its sorted rows [ends - counts, ends)
    starts = ends - _counts(lab, K)
    for s in range(0, n, rows):
        e = min(s + rows, n)
        xc = x[order[:, s:e].reshape(-1)].to(dtype)
        lengths = (ends.clamp(max=e) - starts.clamp(min=s)).clamp_min_(0)  # each cluster's rows in this chunk
        out += torch.segment_reduce(xc, "sum", lengths=lengths.reshape(-1), axis=0, unsafe=True)
    return out.view(R, K, -1)


def _update_centers(
    problem: _Problem, centers: torch.Tensor, u_lab: torch.Tensor, frozen: torch.Tensor | None
) -> torch.Tensor:
    """New centres [R, K, D] from the centres ``centers`` and unlabelled labels ``u_lab`` [R, N] of R restarts."""
    sums = all_reduce_sum(_cluster_sums(problem.u, u_lab, problem.K, problem.chunk, problem.dtype))
    cnt = all_reduce_sum(_counts(u_lab, problem.K))
    sums += problem.l_sums
    cnt = cnt + problem.l_cnt
    keep = cnt == 0  # empty cluster keeps its centre (the reference gives NaN here)
    if frozen is not None:
        keep = keep | frozen
    new = sums / cnt.clamp_min(1).to(sums.dtype)[..., None]
    return torch.where(keep[..., None], centers, new)


def _global_rank_within_cluster(lab: torch.Tensor, dist: torch.Tensor, K: int):
    """For every point of the global (rank-ordered) set: its rank inside its cluster by distance (ties: order)."""
    g_lab, off = all_gather_cat(lab)
    g_d, _ = all_gather_cat(dist)
    order = torch.argsort(g_d, stable=True)
    order = order[torch.argsort(g_lab[order], stable=True)]
    sl = g_lab[order]
    counts = torch.bincount(sl, minlength=K)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(sl.shape[0], device=sl.device) - starts[sl]
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return g_lab, rank, off


# --------------------------------------------------------------------------------------------------------- k-means++
def _kmeans_pp(problem: _Problem, means: torch.Tensor, uniforms: torch.Tensor, exclude: int | None) -> torch.Tensor:
    """k-means++ from the labelled means for R restarts at once (``uniforms`` [R, K - nL]) -> centres [R, K, D].

    The running min distance is updated against the newest centre only, and the R restarts share every pass over the
    data (one [N, D] x [D, R] GEMM per seed step instead of R GEMVs); each restart is still exactly the sequential
    k-means++ of its own uniforms.
    ``exclude``: after each new seed, drop the ``exclude`` still-available unlabelled points nearest to it from later
    draws (InfoSieve's intended behaviour, whose published version deletes the wrong rows, REFERENCE.md §5.2).
    """
    u, x2, K, n_labelled = problem.u, problem.x2, problem.K, problem.nL
    dev, world, n = problem.device, get_world_size(), problem.u.shape[0]
    R = uniforms.shape[0]
    centers = torch.empty(R, K, u.shape[1], dtype=problem.dtype, device=dev)
    centers[:, :n_labelled] = means
    ux = torch.empty(n, R, dtype=problem.dtype, device=dev)  # u·c of the newest seeds, filled one row chunk at a time
    if n_labelled:
        d2 = problem.ops.nearest(u, x2, means[None])[0][0].to(torch.float64)[:, None].repeat(1, R)  # [N, R]
    else:
        d2 = torch.ones(n, R, dtype=torch.float64, device=dev)
    avail = torch.ones(n, R, dtype=torch.bool, device=dev) if exclude else None
    n_glob = torch.tensor(float(problem.n_u_global), dtype=torch.float64, device=dev)
    for j in range(K - n_labelled):
        w = d2 if avail is None else d2 * avail
        tot = all_reduce_sum(w.sum(0))
        if avail is not None:  # everything excluded: fall back to plain k-means++ weights
            w = torch.where(tot > 0, w, d2)
            tot = torch.where(tot > 0, tot, all_reduce_sum(d2.sum(0)))
        zero = tot <= 0  # all points coincide with centres: draw uniformly
        w = torch.where(zero, torch.ones_like(w), w)
        tot = torch.where(zero, n_glob, tot)
        r = uniforms[:, j].contiguous()
        if world == 1:
            cum = torch.cumsum(w / tot, 0).t().contiguous()  # [R, N]
            ind = torch.searchsorted(cum, r[:, None]).clamp_(max=n - 1)[:, 0]
            c = u[ind].to(problem.dtype)  # [R, D]
        else:
            rank_w, rank = all_gather_cat(w.sum(0)[None])  # [world, R]; offset == rank
            before = rank_w[:rank].sum(0) / tot
            hi = torch.cumsum(rank_w / tot, 0).t().contiguous()  # [R, world]
            owner = torch.searchsorted(hi, r[:, None])[:, 0]
            last = torch.where(rank_w > 0, torch.arange(world, device=dev)[:, None], 0).max(0).values
            owner = torch.minimum(owner, last)
            c = torch.zeros(R, u.shape[1], dtype=problem.dtype, device=dev)
            mine = owner == rank
            if n and bool(mine.any()):
                cum = (torch.cumsum(w / tot, 0) + before).t().contiguous()
                ind = torch.searchsorted(cum, r[:, None]).clamp_(max=n - 1)[:, 0]
                c[mine] = u[ind[mine]].to(problem.dtype)
            c = all_reduce_sum(c)
        centers[:, n_labelled + j] = c
        for s, e, xc in _chunks(u, problem.chunk, problem.dtype):
            torch.mm(xc, c.t(), out=ux[s:e])
        dn = (x2[:, None] - 2 * ux + (c * c).sum(1)[None]).clamp_min_(0).to(torch.float64)  # [N, R]
        d2 = dn if (n_labelled == 0 and j == 0) else torch.minimum(d2, dn)
        if avail is not None:
            masked = dn.masked_fill(~avail, float("inf"))
            k_loc = min(exclude, n)
            vals = torch.topk(masked, k_loc, dim=0, largest=False).values if k_loc else masked[:0]
            g_vals, _ = all_gather_cat(vals)
            g_vals = torch.sort(g_vals, dim=0).values
            thr = g_vals[min(exclude, g_vals.shape[0]) - 1]
            avail &= ~(dn <= thr[None])
    return centers


# ------------------------------------------------------------------------------------------------- assignment steps
# Each step takes the centres [R, K, D] of R restarts and returns their unlabelled labels [R, N] and inertia [R] (fp64).
def _assign_plain(problem: _Problem, centers: torch.Tensor):
    d, lab = problem.ops.nearest(problem.u, problem.x2, centers)
    return lab, d.sum(1, dtype=torch.float64)


def _assign_capacity(problem: _Problem, centers: torch.Tensor, cap: torch.Tensor):
    """Capacity-constrained assignment in rounds (one restart, ``centers`` [1, K, D]): every pending point proposes to
    its nearest cluster that still has room; each cluster accepts its closest proposals (globally) up to its remaining
    capacity; rejected points try again without the clusters that filled up. At least one more cluster fills per
    round, so at most K rounds."""
    K, dev = problem.K, problem.device
    n = problem.u.shape[0]
    lab = torch.empty(n, dtype=torch.long, device=dev)
    dist = torch.empty(n, dtype=problem.dtype, device=dev)
    rem = cap.clone()
    pend = torch.arange(n, device=dev)
    full_d = problem.ops.distances(problem.u, problem.x2, centers)[0] if n * K <= _CAPACITY_MATRIX_MAX else None
    if full_d is None:
        prop_d, prop_k = (a[0] for a in problem.ops.nearest(problem.u, problem.x2, centers))
    else:
        prop_d, prop_k = full_d.min(1)
    for _ in range(K + 1):
        g_k, rank, off = _global_rank_within_cluster(prop_k, prop_d, K)
        g_acc = rank < rem[g_k]
        rem = rem - torch.bincount(g_k[g_acc], minlength=K)
        acc = g_acc[off : off + pend.shape[0]]
        lab[pend[acc]] = prop_k[acc]
        dist[pend[acc]] = prop_d[acc]
        pend = pend[~acc]
        if bool(g_acc.all()):
            break
        if full_d is None:
            nearest = problem.ops.nearest(problem.u, problem.x2, centers, rows=pend, allowed=(rem > 0)[None])
            prop_d, prop_k = (a[0] for a in nearest)
        else:  # the distances do not change within an assignment: mask the full clusters and take the argmin again
            prop_d, prop_k = full_d[pend].masked_fill_((rem <= 0)[None], float("inf")).min(1)
    return lab[None], dist.sum(dtype=torch.float64)[None]


def _assign_reference_phase_a(problem: _Problem, centers: torch.Tensor, cap: torch.Tensor | None, n_pass: int):
    """InfoSieve's Phase A assignment: argmin, then ``n_pass`` balancing passes (REFERENCE.md §5.2), vectorised over
    points, clusters and restarts.

    With the stored [R, N, K] distances (small problems) the freed points of every restart take their nearest cluster
    with room (a restart without room keeps its labels): on CUDA without a host sync, by taking the masked argmin of
    every point and keeping it where freed; on the CPU only the freed points are searched. Without the stored
    distances (large problems) each restart searches again only its freed rows. The returned inertia is that of the
    unbalanced argmin, as in the reference.
    """
    R, n, K = centers.shape[0], problem.u.shape[0], problem.K
    stored = cap is not None and n_pass and R * n * K <= _CAPACITY_MATRIX_MAX
    full_d = problem.ops.distances(problem.u, problem.x2, centers) if stored else None
    d, lab = problem.ops.nearest(problem.u, problem.x2, centers) if full_d is None else full_d.min(2)
    inertia = d.sum(1, dtype=torch.float64)
    if cap is None:
        return lab, inertia
    for _ in range(n_pass):
        cnt = all_reduce_sum(_counts(lab, K))
        room = (cnt == 1) | (cnt < cap)  # the reference's 0-d squeeze makes a singleton cluster always "have room"
        over = (cnt > cap) & ~room
        keep = torch.where(cap >= 0, cap, (cnt + cap).clamp_min(0))  # [cap:] with cap < 0 frees only |cap| points
        g_lab, rank, off = _global_rank_within_cluster(_restart_ids(lab, K).reshape(-1), d.reshape(-1), R * K)
        free = (over.reshape(-1)[g_lab] & (rank >= keep.reshape(-1)[g_lab]))[off : off + R * n].view(R, n)
        free &= room.any(1, keepdim=True)  # a restart whose clusters are all full moves nothing
        if full_d is not None and _host_syncs_are_free(problem.device):
            pairs = torch.nonzero(free.view(-1)).squeeze(1)  # (restart, point) as restart * n + point
            dn, kn = full_d.view(R * n, K)[pairs].masked_fill_(~room[pairs // n], float("inf")).min(1)
            lab.view(-1)[pairs], d.view(-1)[pairs] = kn, dn
            continue
        if full_d is not None:
            dn, kn = full_d.masked_fill(~room[:, None], float("inf")).min(2)
            lab, d = torch.where(free, kn, lab), torch.where(free, dn, d)
            continue
        for r in range(R):
            rows = torch.nonzero(free[r]).squeeze(1)
            if rows.numel() or get_world_size() > 1:
                dn, kn = problem.ops.nearest(
                    problem.u, problem.x2, centers[r : r + 1], rows=rows, allowed=room[r : r + 1]
                )
                lab[r, rows] = kn[0]
                d[r, rows] = dn[0]
    return lab, inertia


# ------------------------------------------------------------------------------------------------------- restarts
def _host_syncs_are_free(device: torch.device) -> bool:
    """Whether reading a value back to the host is free (the CPU): then the iterations stop once every restart has
    converged and the balancing passes search only the freed points. On CUDA the restarts run all ``max_iter``
    iterations (the converged ones unchanged) and the passes search every point, without a host sync."""
    return device.type != "cuda"


class _Runs:
    """R restarts iterated in lockstep, every restart's state on the device.

    A restart stops (keeps its centres and records nothing more) after the iteration whose centre shift is below
    ``tol``; the others go on. Per restart: the inertia history, the iteration count and the best iteration (strict
    ``<``: the first of equal inertias), its labels and the centres updated from them. Nothing is read back to the
    host until :meth:`best_restart`.
    """

    def __init__(self, problem: _Problem, R: int, steps: int):
        dev = problem.device
        self.history = torch.zeros(R, steps, dtype=torch.float64, device=dev)
        self.recorded = torch.zeros(R, steps, dtype=torch.bool, device=dev)
        self.step = 0
        self.best_inertia = torch.full((R,), float("inf"), dtype=torch.float64, device=dev)
        self.best_lab = torch.zeros(R, problem.u.shape[0], dtype=torch.long, device=dev)
        self.best_centers = torch.zeros(R, problem.K, problem.u.shape[1], dtype=problem.dtype, device=dev)

    def iterate(self, problem: _Problem, centers, max_iter, tol, assign, frozen):
        active = torch.ones(centers.shape[0], dtype=torch.bool, device=problem.device)
        poll = _host_syncs_are_free(problem.device)
        for it in range(max_iter):
            u_lab, inertia_u = assign(centers, it)
            inertia = all_reduce_sum(inertia_u) + _labelled_inertia(problem, centers)
            new = _update_centers(problem, centers, u_lab, frozen)
            self.history[:, self.step] = inertia
            self.recorded[:, self.step] = active
            self.step += 1
            better = active & (inertia < self.best_inertia)
            self.best_inertia = torch.where(better, inertia, self.best_inertia)
            self.best_lab = torch.where(better[:, None], u_lab, self.best_lab)
            self.best_centers = torch.where(better[:, None, None], new, self.best_centers)
            shift = (new - centers).norm(dim=2).sum(1).to(torch.float64) ** 2
            centers = torch.where(active[:, None, None], new, centers)
            active = active & ~(shift < tol)
            if poll and not bool(active.any()):
                break
        return centers

    def best_restart(self):
        """(inertia, history, n_iter, index in the batch, labels, centres) of the best restart (the first of equal
        inertias)."""
        r = int(torch.argmin(self.best_inertia))
        history = self.history[r][self.recorded[r]].tolist()
        return float(self.best_inertia[r]), history, len(history), r, self.best_lab[r], self.best_centers[r]


def _run_restarts(problem, seeds, max_iter, tol, balance, cap, frozen):
    """Run the restarts whose seeds are ``seeds`` [R, K, D] together -> :meth:`_Runs.best_restart` of the batch.
    ``cap``: room left per cluster for unlabelled points (None: unbalanced)."""
    centers, runs = seeds.clone(), _Runs(problem, seeds.shape[0], 2 * max_iter)
    if balance == "reference":  # Phase A (capacity passes only when balanced), then Phase B
        frozen_a = torch.zeros(problem.K, dtype=torch.bool, device=problem.device)
        frozen_a[: problem.nL] = True
        phase_a = lambda c, it: _assign_reference_phase_a(problem, c, cap, it)
        centers = runs.iterate(problem, centers, max_iter, tol, phase_a, frozen_a)
        runs.iterate(problem, centers, max_iter, tol, lambda c, it: _assign_plain(problem, c), frozen)
    elif cap is None:
        runs.iterate(problem, centers, max_iter, tol, lambda c, it: _assign_plain(problem, c), frozen)
    else:
        cap_free = cap.clamp_min(0)
        runs.iterate(problem, centers, max_iter, tol, lambda c, it: _assign_capacity(problem, c, cap_free), frozen)
    return runs.best_restart()


# ------------------------------------------------------------------------------------------------------- entry point
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
    and keeps its points. The clusters without labelled points are seeded by k-means++ in increasing id order.
    ``l_feats`` may have zero rows (plain k-means++ / Lloyd).

    ``balance="capacity"`` (default) with ``balanced=False``: GCD's one-phase SS-k-means (REFERENCE.md §5.1).
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
    ``backend``: ``"torch"``, ``"faiss"`` or ``"auto"``: FAISS when it has GPU support (``faiss.get_num_gpus() > 0``),
    the features are on CUDA and ``distance_precision="fp32"``; torch otherwise (on this project's CPUs the chunked
    GEMM is about 2x faster than FAISS's flat index, and FAISS's OpenMP runtime slowed later torch work).
    ``chunk_size``: rows per block (default: about 8M (CPU) / 64M (CUDA) entries per [rows, max(K, D)] block).
    ``distance_precision`` (torch backend, fp32/fp16/bf16 features): ``"fp32"`` (default) exact nearest-centre
    searches, the published behaviour; ``"tf32"`` / ``"bf16"`` run the search GEMM in that precision and re-search
    exactly every row whose two nearest centres are within the GEMM's rigorous error bound, so the labels are those of
    ``"fp32"``; ``KMeansResult.searched_rows`` / ``rechecked_rows`` count them.
    """
    u = _as_tensor(u_feats, "u_feats")
    _check_features(u, "u_feats", None, chunk_size)
    dev, D = u.device, u.shape[1]
    l = _as_tensor(l_feats, "l_feats") if l_feats is not None else u.new_zeros((0, D))
    _check_features(l, "l_feats", D, chunk_size)
    t = _as_tensor(l_targets, "l_targets") if l_targets is not None else torch.zeros(0, dtype=torch.long)
    if l.device != dev:
        raise ValueError(f"l_feats is on {l.device} but u_feats is on {dev}; put both on the same device")
    K = int(n_clusters)
    if K < 1:
        raise ValueError(f"n_clusters must be >= 1, got {n_clusters}")
    if n_init < 1 or max_iter < 1:
        raise ValueError(f"n_init and max_iter must be >= 1, got n_init={n_init}, max_iter={max_iter}")
    if balance not in _BALANCE_MODES:
        raise ValueError(f"balance must be one of {_BALANCE_MODES}, got {balance!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if distance_precision not in _PRECISIONS:
        raise ValueError(f"distance_precision must be one of {_PRECISIONS}, got {distance_precision!r}")
    cdtype = torch.float64 if (u.dtype == torch.float64 or l.dtype == torch.float64) else torch.float32
    if distance_precision != "fp32" and cdtype == torch.float64:
        raise ValueError(
            f"distance_precision={distance_precision!r} needs fp32, fp16 or bf16 features; float64 features are "
            "clustered exactly in float64: use distance_precision='fp32'"
        )
    backend = _pick_backend(backend, u.is_cuda, distance_precision)
    if backend == "faiss" and distance_precision != "fp32":
        raise ValueError(
            f"backend='faiss' searches in fp32 only; use backend='torch' for distance_precision={distance_precision!r}"
        )
    t = t.reshape(-1)
    if t.shape[0] != l.shape[0]:
        raise ValueError(f"l_targets has {t.shape[0]} entries but l_feats has {l.shape[0]} rows")
    if t.is_floating_point():
        if t.numel() and not bool((t == t.round()).all() & torch.isfinite(t).all()):
            raise ValueError("l_targets must hold integer class ids; got non-integer values")
    t = t.to(device=dev, dtype=torch.long)
    if t.numel() and bool(((t < 0) | (t >= K)).any()):
        raise ValueError(
            f"l_targets must lie in 0..{K - 1} (n_clusters={K}); got values {int(t.min())}..{int(t.max())}"
        )

    counts = all_reduce_sum(torch.tensor([u.shape[0], l.shape[0]], dtype=torch.long, device=dev))
    n_u, n_l = int(counts[0]), int(counts[1])
    if n_u == 0:
        raise ValueError("u_feats is empty: semi-supervised k-means needs unlabelled points")
    present = all_reduce_max(torch.bincount(t, minlength=K).clamp_max_(1))
    cls = torch.nonzero(present).squeeze(1)  # sorted labelled classes (global)
    nL = int(cls.numel())
    if K > n_u + n_l:
        raise ValueError(f"n_clusters={K} is larger than the number of points ({n_u + n_l})")
    if K - nL > n_u:
        raise ValueError(f"{K - nL} clusters need seeds but there are only {n_u} unlabelled points")

    cs = None
    if balanced:
        cs = int(cluster_size) if cluster_size is not None else math.ceil((n_u + n_l) / K)
        if cs < 1 or cs * K < n_u + n_l:
            raise ValueError(f"cluster_size={cs} is too small: {K} clusters x {cs} < {n_u + n_l} points")
    elif cluster_size is not None:
        raise ValueError("cluster_size is only used with balanced=True")

    if backend == "faiss" and not faiss_available():
        raise ImportError("backend='faiss' needs the faiss package (pip install faiss-cpu); or use backend='torch'")
    chunk = _chunk_rows(chunk_size, K, D, u.is_cuda)
    lab_l = torch.searchsorted(cls, t)  # internal ids: labelled classes first, in sorted order (as the reference)
    free_ids = torch.nonzero(present == 0).squeeze(1)
    slot = torch.cat([cls, free_ids])  # internal id -> returned cluster id

    l_sums = all_reduce_sum(_cluster_sums(l, lab_l[None], K, chunk, cdtype)[0])
    l_cnt = all_reduce_sum(torch.bincount(lab_l, minlength=K))
    means = l_sums[:nL] / l_cnt[:nL, None].to(cdtype)
    ops = _FaissOps(chunk, u.is_cuda) if backend == "faiss" else _TorchOps(chunk, distance_precision)
    l_sq = torch.zeros((), dtype=torch.float64, device=dev)
    for _, _, lc in _chunks(l, chunk, torch.float64):
        l_sq += (lc * lc).sum()
    l_sq = all_reduce_sum(l_sq.reshape(1))[0]
    p = _Problem(u, _sq_norms(u, chunk, cdtype), l, lab_l, K, nL, l_sums, l_cnt, n_u, ops, chunk, l_sq)

    frozen = None
    if freeze_labelled_centers:
        frozen = torch.zeros(K, dtype=torch.bool, device=dev)
        frozen[:nL] = True
    n_seeds = K - nL
    rs = np.random.RandomState(seed)
    uniforms = torch.from_numpy(rs.random_sample(n_init * n_seeds)).to(dev).reshape(n_init, n_seeds)
    kpp_batch = max(1, min(n_init, _KPP_ARRAY_BYTES // max(1, 8 * u.shape[0])))

    exclude = cs if balance == "reference" else None  # cs is None unless balanced
    seeds_all = []
    for r0 in range(0, n_init, kpp_batch):  # restarts share k-means++ passes over the data, kpp_batch at a time
        r1 = min(r0 + kpp_batch, n_init)
        seeds_all.append(_kmeans_pp(p, means, uniforms[r0:r1], exclude))
    seeds = torch.cat(seeds_all)
    cap = None if cs is None else cs - l_cnt  # room left for unlabelled points (negative: labelled overflow)
    # all restarts in one batch; capacity rounds differ in length per restart, so that mode runs them one at a time
    batch = 1 if (cap is not None and balance == "capacity") else n_init
    best = None
    for r0 in range(0, n_init, batch):
        found = _run_restarts(p, seeds[r0 : r0 + batch], max_iter, tol, balance, cap, frozen)
        if best is None or found[0] < best[0]:
            best = found[:3] + (r0 + found[3],) + found[4:]
    inertia, history, n_iter, best_init, u_lab, C = best
    labels = torch.cat([slot[lab_l], slot[u_lab]])
    centers = torch.empty_like(C)
    centers[slot] = C
    counts = all_reduce_sum(torch.tensor([ops.searched, ops.rechecked], dtype=torch.long, device=dev))
    return KMeansResult(labels, centers, inertia, n_iter, history, ops.name, best_init,
                        int(counts[0]), int(counts[1]))  # fmt: skip
