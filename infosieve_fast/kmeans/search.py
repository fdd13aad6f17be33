"""Nearest-centre searches over row chunks: the torch GEMM search (exact fp32, or low precision with an exact recheck
of the rows near a tie) and the FAISS flat index.

Half-precision features are only ever converted one chunk of rows at a time (:func:`_chunks`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def faiss_available(gpu: bool = False) -> bool:
    """Whether ``faiss`` imports (and, with ``gpu=True``, whether it was built with GPU support and sees a GPU)."""
    try:
        import faiss
    except ImportError:
        return False
    return not gpu or (hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0)


# ------------------------------------------------------------------------------------------------------------ chunks
def _chunks(x: torch.Tensor, rows: int, dtype: torch.dtype, index: torch.Tensor | None = None):
    """Yield ``(start, end, block)``: ``x[start:end]`` (or ``x[index[start:end]]``) converted to ``dtype``, so that a
    half-precision matrix is only ever upcast one block of rows at a time."""
    n = x.shape[0] if index is None else index.shape[0]
    for start in range(0, n, rows):
        end = min(start + rows, n)
        yield start, end, (x[start:end] if index is None else x[index[start:end]]).to(dtype)


def _sq_norms(x: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=dtype, device=x.device)
    for start, end, block in _chunks(x, rows, dtype):
        out[start:end] = (block * block).sum(1)
    return out


@contextmanager
def _cuda_matmul_precision(precision: str) -> Iterator[None]:
    """Set CUDA fp32 matmuls to ``"ieee"`` or ``"tf32"`` for the block, then restore the caller's setting."""
    matmul = torch.backends.cuda.matmul
    old = matmul.fp32_precision
    matmul.fp32_precision = precision
    try:
        yield
    finally:
        matmul.fp32_precision = old


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
def _direct_sqdist(block: torch.Tensor, centers: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """||x - C[idx]||² per row, in the compute dtype (the distance to a centre found by an inexact search)."""
    return (block - centers[idx]).pow_(2).sum(1)


def _batched_gemm_distances(block: torch.Tensor, centers: torch.Tensor, c2: torch.Tensor) -> torch.Tensor:
    """``||c||² - 2 x·c`` [R, rows, K] for the rows ``block`` and the centres ``centers`` [R, K, D] (``c2`` [R, K]) of
    R restarts, in one batched GEMM. On the CPU each restart's block equals bit for bit the lone restart's
    ``addmm(c2, block, C.t())``; on CUDA cuBLAS may pick another kernel for the batch, so a distance can differ in the
    last bit (a label only where two centres tie to that bit)."""
    return torch.baddbmm(c2[:, None], block.expand(centers.shape[0], -1, -1), centers.transpose(1, 2), beta=1, alpha=-2)


def _low_precision_products(block: torch.Tensor, centers_low: torch.Tensor, precision: str) -> torch.Tensor:
    """``x·c`` of the rows ``block`` with the transposed low-precision centres, in ``precision``."""
    if precision == "tf32":
        with _cuda_matmul_precision("tf32"):  # on the CPU this is an fp32 GEMM, inside the same bound
            return block @ centers_low
    if block.is_cuda:
        return torch.mm(block.to(torch.bfloat16), centers_low, out_dtype=torch.float32)
    return block.to(torch.bfloat16) @ centers_low  # bf16 result on the CPU: its rounding is part of the bound


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
        n_restarts = centers.shape[0]
        c2 = (centers * centers).sum(2)
        if allowed is not None:
            c2 = c2.masked_fill(~allowed, float("inf"))
        n = x.shape[0] if rows is None else rows.shape[0]
        d_out = torch.empty(n_restarts, n, dtype=centers.dtype, device=centers.device)
        i_out = torch.empty(n_restarts, n, dtype=torch.long, device=centers.device)
        for start, end, block in _chunks(x, max(1, self.chunk_rows // n_restarts), centers.dtype, rows):
            dmin, i_out[:, start:end] = _batched_gemm_distances(block, centers, c2).min(2)
            block_x2 = x2[start:end] if rows is None else x2[rows[start:end]]
            d_out[:, start:end] = (dmin + block_x2).clamp_min_(0)
        return d_out, i_out

    def _nearest_one(self, x, x2, centers, rows, allowed):
        """:meth:`nearest` of one restart's centres ``centers`` [K, D] -> [n] each."""
        n = x.shape[0] if rows is None else rows.shape[0]
        d_out = torch.empty(n, dtype=centers.dtype, device=centers.device)
        i_out = torch.empty(n, dtype=torch.long, device=centers.device)
        prep = self._prepare(centers, allowed)
        for start, end, block in _chunks(x, self.chunk_rows, centers.dtype, rows):
            block_x2 = x2[start:end] if rows is None else x2[rows[start:end]]
            d_out[start:end], i_out[start:end] = self._search(block, block_x2, centers, prep)
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

    def _search(self, block, block_x2, centers, prep):
        c2, low = prep
        if low is None:
            dmin, idx = torch.addmm(c2, block, centers.t(), beta=1, alpha=-2).min(1)
            return (dmin + block_x2).clamp_min_(0), idx
        c_low, c_max = low
        products = _low_precision_products(block, c_low, self.precision)
        top_v, top_i = torch.add(c2, products, alpha=-2).topk(2, dim=1, largest=False)
        bf16_out = products.dtype == torch.bfloat16
        threshold = _recheck_threshold(self.precision, block.shape[1], bf16_out, block_x2.sqrt(), c_max)
        redo = torch.nonzero(top_v[:, 1] - top_v[:, 0] <= threshold).squeeze(1)
        idx = top_i[:, 0]
        self.searched += block.shape[0]
        self.rechecked += redo.numel()
        if redo.numel():
            idx[redo] = torch.addmm(c2, block[redo], centers.t(), beta=1, alpha=-2).min(1).indices
        return _direct_sqdist(block, centers, idx), idx

    def distances(self, x, x2, centers):
        """Full [R, N, K] squared distances to the centres ``centers`` [R, K, D] of R restarts (chunked exact GEMM)."""
        n_restarts, K, _ = centers.shape
        c2 = (centers * centers).sum(2)
        out = torch.empty(n_restarts, x.shape[0], K, dtype=centers.dtype, device=centers.device)
        for start, end, block in _chunks(x, max(1, self.chunk_rows // n_restarts), centers.dtype):
            distances = _batched_gemm_distances(block, centers, c2)
            out[:, start:end] = distances.add_(x2[start:end, None]).clamp_min_(0)
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
        searched = (centers if ids is None else centers[ids]).float().contiguous()
        if self.gpu:
            index = self.faiss.GpuIndexFlatL2(self.res, centers.shape[1])
            index.add(searched)
        else:
            index = self.faiss.IndexFlatL2(centers.shape[1])
            index.add(searched.cpu().numpy())
        return index, ids

    def _search(self, block, block_x2, centers, prep):
        index, ids = prep
        queries = block.float().contiguous()
        if self.gpu:
            idx = index.search(queries, 1)[1][:, 0].to(block.device).long()
        else:
            idx = torch.from_numpy(index.search(queries.cpu().numpy(), 1)[1][:, 0]).to(block.device).long()
        if ids is not None:
            idx = ids[idx]
        return _direct_sqdist(block, centers, idx), idx
