"""Fused Euclidean contrastive losses (InfoNCE with label smoothing, SupCon over a label vector) in Triton.

Same functions as `reference.info_nce_loss` / `supcon_loss` (docs/reference.md §3.1, §3.2, §3.9, §8), forward and
backward, without an N x N matrix in memory on the tiled path.

Math (x_i = s_i f_i, s_i = 1 / max(||f_i||, NORM_EPS) for InfoNCE, s_i = 1 for SupCon):
- Gram G = F F^T, sq_i = G_ii (taken from the same dot product as G, so duplicate rows give d2 = 0 exactly),
  d_ij = sqrt(max(s_i^2 sq_i + s_j^2 sq_j - 2 s_i s_j G_ij, 0)), d_ii = 0, and the gradient through d = 0 is 0.
- `rowsum_normalize` (the codes' variant): dn_ij = d_ij / (S_j + eps), eps = ROW_SUM_EPS, S_j = sum_k d_jk over the kept
  columns, from a first pass.
- Logits l_ij = -dn_ij / T, online log-sum-exp per row over column tiles (self and dropped rows masked).
- InfoNCE's smoothing target (row i's label-smoothing mass s spread over the other columns): uniform 1/(N-1), or a
  given matrix C [N, N] (`smoothing_target`, SelEx's confusion), rows free to sum to any W_i = sum_{j!=i} C_ij:
  loss_i = (1 - s)(LSE_i - l_i,pos) + s (W_i LSE_i - sum_j C_ij l_ij), dL/dl_ij = p_ij ((1 - s) + s W_i)
  - (1 - s)[j = pos(i)] - s C_ij. The target is a constant (no gradient); W_i is saved by the forward.
- Backward: E_ij = dL/d(dn_ij) is rebuilt tile by tile from the saved per-row LSE (and 1/|P(i)| for SupCon). With
  `rowsum_normalize`, sigma_j = dL/dS_j = -sum_i E_ij d_ij / (S_j + eps)^2 is one more pass, and the gradient of the
  distance entry (i, j) is Gamma_ij = E_ij / (S_j + eps) + sigma_i (S_i sums row i, so d_ij feeds S_i). With
  C_ij = (Gamma_ij + Gamma_ji) / d_ij (0 where d_ij = 0): dL/dx_i = R_i x_i - sum_j C_ij x_j, R_i = sum_j C_ij.
  The row normalisation folds in: dL/df_i = a_i f_i - sum_j (s_i C_ij s_j) f_j with
  a_i = s_i^2 (R_i (1 - x_i.x_i) + sum_j C_ij x_i.x_j) (a_i = s_i^2 R_i where ||f_i|| < NORM_EPS, a_i = R_i for SupCon).
  Each backward tile (I, J) builds Gamma_IJ and Gamma_JI from the row statistics of both blocks (d is symmetric),
  so one program owns its output rows: no atomics.

Two Gram paths, picked by `_pick_gram` (override with the `gram=` argument or the module-level `GRAM`):
- "triton": every kernel recomputes its Gram tiles with `tl.dot`; memory O(N D); the backward grid also splits D
  into BLOCK_D chunks (each chunk recomputes the Gram tiles, so this path is meant for moderate D).
- "mm": G = torch.mm(F, F^T) in fp32/TF32 (fp64 for fp64, never bf16), the row statistics are fused Triton kernels
  over G, and the backward writes M = diag(a) - s C s (N x N) and returns torch.mm(M, F): two GEMMs in all.

Kernels: `_info_nce_supcon_sqnorm_kernel` (sq_i, tiled path), `_info_nce_supcon_fwd_kernel` (with `rowsum_normalize`
a ROWSUM_PASS launch for S first, then the per-row LSE and loss terms), `_info_nce_supcon_fwd_finalize_kernel` (the
loss), `_info_nce_supcon_bwd_kernel` (with `rowsum_normalize` a SIGMA launch for sigma first, then dF or M). A pointer
a launch does not use is None. The file reads top to bottom: device helpers, the kernels, then the host side
(`_forward` and `_backward`, which launch them, the `autograd.Function`s over them) and the checked public losses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import launch
from .reference import NORM_EPS, ROW_SUM_EPS

# the jit functions read globals only as constexprs
_ROW_SUM_EPS = tl.constexpr(ROW_SUM_EPS)
_NORM_EPS = tl.constexpr(NORM_EPS)

GRAM = "auto"  # "auto" | "triton" | "mm": the default Gram path (tests force each)
MM_MAX_ROWS = 4096  # auto: torch.mm Gram when N <= this ...
MM_MIN_DIM, MM_MAX_ROWS_WIDE = 1024, 16384  # ... or when D >= MM_MIN_DIM and N <= MM_MAX_ROWS_WIDE
DOT_PRECISION = "tf32"  # tl.dot input precision for fp32 operands on a GPU ("tf32", "tf32x3", "ieee")

__all__ = [
    "DOT_PRECISION",
    "GRAM",
    "MM_MAX_ROWS",
    "MM_MAX_ROWS_WIDE",
    "MM_MIN_DIM",
    "info_nce_and_supcon",
    "info_nce_loss",
    "supcon_loss",
]


# ----------------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _row_scale(sq, NORMALIZE: tl.constexpr):
    if NORMALIZE:
        s = 1.0 / tl.maximum(tl.sqrt(sq), _NORM_EPS)
    else:
        s = tl.full(sq.shape, 1.0, sq.dtype)
    return s


@triton.jit
def _gram_tile_dot(
    x_ptr,  # features F [N, D]
    rows,
    cols,
    N,
    D,
    stride_xr,
    stride_xc,
    ACC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
):
    """G[rows, cols] = F[rows] F[cols]^T, a tl.dot over D in BK chunks."""
    rmask = rows < N
    cmask = cols < N
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    g = tl.zeros([BM, BN], dtype=ACC)
    ks = tl.arange(0, BK)
    for k0 in range(0, D, BK):
        kk = k0 + ks
        kmask = kk < D
        a_ok = rmask[:, None] & kmask[None, :]
        b_ok = kmask[:, None] & cmask[None, :]
        a = tl.load(x_ptr + r64[:, None] * stride_xr + kk[None, :] * stride_xc, mask=a_ok, other=0.0)
        b = tl.load(x_ptr + c64[None, :] * stride_xr + kk[:, None] * stride_xc, mask=b_ok, other=0.0)
        if x_ptr.dtype.element_ty == tl.float32:
            g = tl.dot(a, b, g, input_precision=PREC, out_dtype=ACC)
        else:  # fp16/bf16 products are exact in the fp32 accumulator; fp64 is always IEEE
            g = tl.dot(a, b, g, out_dtype=ACC)
    return g


@triton.jit
def _gram_tile(
    x_ptr,  # features F [N, D], read unless FROM_G
    g_ptr,  # the materialised Gram matrix G = F F^T [N, N] when FROM_G, else None
    rows,
    cols,
    N,
    D,
    stride_xr,
    stride_xc,
    FROM_G: tl.constexpr,
    ACC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
):
    """G[rows, cols]: loaded from the materialised Gram, or a tl.dot over D in BK chunks."""
    if FROM_G:
        ok = (rows < N)[:, None] & (cols < N)[None, :]
        g = tl.load(g_ptr + rows.to(tl.int64)[:, None] * N + cols.to(tl.int64)[None, :], mask=ok, other=0.0)
        g = g.to(ACC)
    else:
        g = _gram_tile_dot(x_ptr, rows, cols, N, D, stride_xr, stride_xc, ACC, BM, BN, BK, PREC)
    return g


@triton.jit
def _side(idx, N, sq_ptr, sq_stride, lab_ptr, NORMALIZE: tl.constexpr, SUPCON: tl.constexpr, ACC: tl.constexpr):
    """Per-index vectors of one tile side: in-bounds mask, sq = G_ii, scale s, label, kept (label >= 0) mask.
    InfoNCE has no labels (lab_ptr None): each index is its own label and every row is kept."""
    m = idx < N
    sq = tl.load(sq_ptr + idx.to(tl.int64) * sq_stride, mask=m, other=1.0).to(ACC)
    s = _row_scale(sq, NORMALIZE)
    if SUPCON:
        lab = tl.load(lab_ptr + idx, mask=m, other=-1)
        keep = m & (lab >= 0)
    else:
        lab = idx
        keep = m
    return m, sq, s, lab, keep


@triton.jit
def _side_stats(idx, m, lse_ptr, aux_ptr, SUPCON: tl.constexpr, SOFT_TARGET: tl.constexpr):
    """Saved per-row LSE and aux of one tile side: 1/|P(i)| (SupCon) or the smoothing target's row sum W_i (InfoNCE
    with a `smoothing_target`); without either (aux_ptr None): zeros."""
    lse = tl.load(lse_ptr + idx, mask=m, other=0.0)
    if SUPCON or SOFT_TARGET:
        aux = tl.load(aux_ptr + idx, mask=m, other=0.0)
    else:
        aux = tl.zeros_like(lse)
    return lse, aux


@triton.jit
def _distances(g, sq_r, s_r, sq_c, s_c, pair):
    """d = sqrt(max(x_i.x_i + x_j.x_j - 2 x_i.x_j, 0)) on `pair`, else 0; also returns x_i.x_j."""
    gp = (s_r[:, None] * s_c[None, :]) * g
    sqp_r = (s_r * s_r) * sq_r
    sqp_c = (s_c * s_c) * sq_c
    d2 = (sqp_r[:, None] + sqp_c[None, :]) - 2.0 * gp
    ok = pair & (d2 > 0)
    d = tl.where(ok, tl.sqrt(tl.where(ok, d2, 1.0)), 0.0)
    return d, gp


@triton.jit
def _dloss_ddn(
    dn,
    pair,
    a_idx,
    o_idx,
    a_lse,
    a_aux,
    a_lab,
    o_lab,
    tgt_ptr,
    coef,
    inv_t,
    smoothing,
    half,
    N,
    SUPCON: tl.constexpr,
    SOFT_TARGET: tl.constexpr,
):
    """dL/d(dn) for anchor a, other o (broadcast tiles): InfoNCE with label `smoothing` (uniform, or spread as the
    target C[a, o] at `tgt_ptr` says, a_aux = W_a) or SupCon (which ignores `smoothing`), times the upstream
    coefficient."""
    p = tl.where(pair, tl.exp(tl.where(pair, -dn * inv_t - a_lse, 0.0)), 0.0)
    if SUPCON:
        w = tl.where(a_lab == o_lab, a_aux, 0.0) - p
        w = tl.where(a_aux > 0, w, 0.0)
    else:
        a_pos = tl.where(a_idx < half, a_idx + half, a_idx - half)
        if SOFT_TARGET:
            c = tl.load(tgt_ptr + a_idx.to(tl.int64) * N + o_idx, mask=pair, other=0.0)
            w = p * ((1.0 - smoothing) + smoothing * a_aux) - tl.where(o_idx == a_pos, 1.0 - smoothing, 0.0)
            w = w - smoothing * c
        else:
            w = p - tl.where(o_idx == a_pos, 1.0 - smoothing, 0.0) - smoothing / (N - 1)
    return tl.where(pair, (-inv_t * coef) * w, 0.0)


@triton.jit
def _info_nce_supcon_sqnorm_kernel(
    # pointers
    x_ptr,  # features F [N, D]
    sq_ptr,  # out: squared row norms sq_i = G_ii [N]
    # sizes
    N,
    D,
    # strides of F (row, column)
    stride_xr,
    stride_xc,
    # meta-parameters: see _info_nce_supcon_fwd_kernel
    ACC: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
):
    """sq_i = G_ii from the same tl.dot tiles the other kernels use (diagonal block, BN = BM)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    g = _gram_tile_dot(x_ptr, rows, rows, N, D, stride_xr, stride_xc, ACC, BM, BM, BK, PREC)
    diag = tl.sum(tl.where(rows[:, None] == rows[None, :], g, 0.0), axis=1)
    tl.store(sq_ptr + rows, diag, mask=rows < N)


@triton.jit
def _info_nce_supcon_fwd_kernel(
    # pointers
    x_ptr,  # features F [N, D]
    g_ptr,  # Gram matrix G = F F^T [N, N] when FROM_G, else None
    sq_ptr,  # squared row norms G_ii: the diagonal of G (sq_stride N + 1) or a vector (sq_stride 1)
    sq_stride,
    lab_ptr,  # SupCon labels [N] (-1: row left out); None for InfoNCE
    tgt_ptr,  # InfoNCE's smoothing target C [N, N] (contiguous, ACC dtype) when SOFT_TARGET, else None
    rowsum_ptr,  # row sums S_i = sum_j d_ij [N]: written by the ROWSUM_PASS launch, read by the next; None without
    lse_ptr,  # out: per-row log-sum-exp [N], kept for the backward; None in the ROWSUM_PASS launch
    out_ptr,  # out: per-row loss term [N]; None in the ROWSUM_PASS launch
    # out [N]: SupCon's 1 / |P(i)|, the inverse positive count, 0 for a row without a positive; with SOFT_TARGET the
    # target's row sum W_i = sum_{j != i} C_ij; else None
    aux_ptr,
    # sizes
    N,  # rows (2B for InfoNCE)
    D,  # feature dimension
    # strides of F (row, column)
    stride_xr,
    stride_xc,
    half,  # B = N / 2: row i's positive in InfoNCE is i +- B
    # scalars, each an fp32 hi + lo pair (launch.fp32_pair): 1 / temperature, and label smoothing (InfoNCE) or
    # temperature / base_temperature (SupCon)
    inv_t_hi,
    inv_t_lo,
    coef_hi,
    coef_lo,
    # meta-parameters
    SUPCON: tl.constexpr,  # SupCon over labels, else InfoNCE over 2 views
    ROWSUM_NORMALIZE: tl.constexpr,  # divide d_ij by (S_j + eps)
    NORMALIZE: tl.constexpr,  # L2-normalise the rows first (InfoNCE)
    FROM_G: tl.constexpr,  # read Gram tiles from g_ptr, else compute them with tl.dot
    ROWSUM_PASS: tl.constexpr,  # this launch only writes S_i
    SOFT_TARGET: tl.constexpr,  # InfoNCE: the smoothing mass spread by tgt_ptr's C, else uniformly
    ACC: tl.constexpr,  # accumulation dtype: fp32, or fp64 for fp64 inputs
    BM: tl.constexpr,  # rows per program
    BN: tl.constexpr,  # columns per loop step
    BK: tl.constexpr,  # feature chunk of a tl.dot
    PREC: tl.constexpr,  # tl.dot input precision for fp32 operands
):
    """ROWSUM_PASS: S_i = sum_j d_ij. Else the per-row LSE and loss term (and 1/|P(i)| for SupCon)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask, sq_r, s_r, lab_r, keep_r = _side(rows, N, sq_ptr, sq_stride, lab_ptr, NORMALIZE, SUPCON, ACC)
    pos_r = tl.where(rows < half, rows + half, rows - half)
    inv_t = tl.cast(inv_t_hi, ACC) + tl.cast(inv_t_lo, ACC)
    m_i = tl.full([BM], float("-inf"), ACC)
    z_i = tl.zeros([BM], dtype=ACC)
    sum_l = tl.zeros([BM], dtype=ACC)
    sum_pos = tl.zeros([BM], dtype=ACC)
    n_pos = tl.zeros([BM], dtype=ACC)
    tgt_sum = tl.zeros([BM], dtype=ACC)  # SOFT_TARGET: W_i
    row_sum = tl.zeros([BM], dtype=ACC)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        cmask, sq_c, s_c, lab_c, keep_c = _side(cols, N, sq_ptr, sq_stride, lab_ptr, NORMALIZE, SUPCON, ACC)
        pair = keep_r[:, None] & keep_c[None, :] & (rows[:, None] != cols[None, :])
        g = _gram_tile(x_ptr, g_ptr, rows, cols, N, D, stride_xr, stride_xc, FROM_G, ACC, BM, BN, BK, PREC)
        d, gp = _distances(g, sq_r, s_r, sq_c, s_c, pair)
        if ROWSUM_PASS:
            row_sum += tl.sum(d, axis=1)
        else:
            if ROWSUM_NORMALIZE:
                S_c = tl.load(rowsum_ptr + cols, mask=cmask, other=1.0)
                d = d / (S_c[None, :] + _ROW_SUM_EPS)
            lg = -d * inv_t
            lm = tl.where(pair, lg, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(lm, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            z_i = z_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(lm - m_safe[:, None]), axis=1)
            m_i = m_new
            if SUPCON:
                same = pair & (lab_r[:, None] == lab_c[None, :])
                n_pos += tl.sum(same.to(ACC), axis=1)
                sum_pos += tl.sum(tl.where(same, lg, 0.0), axis=1)
            else:
                if SOFT_TARGET:
                    c = tl.load(tgt_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=pair, other=0.0)
                    sum_l += tl.sum(c * lg, axis=1)
                    tgt_sum += tl.sum(c, axis=1)
                else:
                    sum_l += tl.sum(tl.where(pair, lg, 0.0), axis=1)
                sum_pos += tl.sum(tl.where(pair & (cols[None, :] == pos_r[:, None]), lg, 0.0), axis=1)
    if ROWSUM_PASS:
        tl.store(rowsum_ptr + rows, row_sum, mask=rmask)
    else:
        lse = tl.where(z_i > 0, m_i + tl.log(tl.where(z_i > 0, z_i, 1.0)), 0.0)  # 0 on rows with no pair
        if SUPCON:
            anchor = n_pos > 0
            inv_np = tl.where(anchor, 1.0 / tl.where(anchor, n_pos, 1.0), 0.0)
            term = tl.where(anchor, sum_pos * inv_np - lse, 0.0)
            tl.store(aux_ptr + rows, inv_np, mask=rmask)
            tl.store(lse_ptr + rows, tl.where(anchor, lse, 0.0), mask=rmask)
        else:
            smoothing = tl.cast(coef_hi, ACC) + tl.cast(coef_lo, ACC)
            if SOFT_TARGET:
                term = (1.0 - smoothing) * (lse - sum_pos) + smoothing * (tgt_sum * lse - sum_l)
                tl.store(aux_ptr + rows, tgt_sum, mask=rmask)
            else:
                term = (1.0 - smoothing) * (lse - sum_pos) + smoothing * (lse - sum_l / (N - 1))
            tl.store(lse_ptr + rows, lse, mask=rmask)
        tl.store(out_ptr + rows, term, mask=rmask)


@triton.jit
def _info_nce_supcon_fwd_finalize_kernel(
    # pointers: the forward's row terms and (SupCon) 1/|P(i)|; out: the loss and (SupCon) the anchor count. The
    # SupCon-only ones are None for InfoNCE
    out_ptr,
    aux_ptr,
    loss_ptr,
    cnt_ptr,
    # size
    N,
    # SupCon's temperature / base_temperature, an fp32 hi + lo pair; None for InfoNCE
    ratio_hi,
    ratio_lo,
    # meta-parameters
    SUPCON: tl.constexpr,
    BLOCK: tl.constexpr,  # rows summed per loop step
):
    """One program: loss = mean of the row terms (InfoNCE) or -(T/Tb) sum / #anchors (SupCon, 0 if none)."""
    offs = tl.arange(0, BLOCK)
    tot = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
    cnt = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
    for s0 in range(0, N, BLOCK):
        m = s0 + offs < N
        tot += tl.load(out_ptr + s0 + offs, mask=m, other=0.0)
        if SUPCON:
            cnt += tl.where(tl.load(aux_ptr + s0 + offs, mask=m, other=0.0) > 0, 1.0, 0.0)
    total = tl.sum(tot, axis=0)
    if SUPCON:
        n_anchor = tl.sum(cnt, axis=0)
        ratio = tl.cast(ratio_hi, out_ptr.dtype.element_ty) + tl.cast(ratio_lo, out_ptr.dtype.element_ty)
        loss = tl.where(n_anchor > 0, -ratio * total / tl.maximum(n_anchor, 1.0), 0.0)
        tl.store(cnt_ptr, n_anchor)
    else:
        loss = total / N
    tl.store(loss_ptr, loss)


@triton.jit
def _info_nce_supcon_bwd_kernel(
    # pointers (those shared with _info_nce_supcon_fwd_kernel mean the same)
    x_ptr,
    g_ptr,
    sq_ptr,
    sq_stride,
    lab_ptr,
    tgt_ptr,
    rowsum_ptr,
    sigma_ptr,  # sigma_i = dL/dS_i [N]: written by the SIGMA launch, read by the next; None without ROWSUM_NORMALIZE
    lse_ptr,
    aux_ptr,
    gout_ptr,  # the upstream gradient of the loss (a scalar on the device)
    cnt_ptr,  # SupCon: the number of anchors, from _info_nce_supcon_fwd_finalize_kernel; None for InfoNCE
    o_ptr,  # out (contiguous): dL/dF [N, D], or the matrix M [N, N] with dL/dF = M F when FROM_G; None when SIGMA
    # sizes
    N,
    D,
    # strides of F (row, column)
    stride_xr,
    stride_xc,
    half,
    # scalars (as in _info_nce_supcon_fwd_kernel)
    inv_t_hi,
    inv_t_lo,
    coef_hi,
    coef_lo,
    # meta-parameters (those shared with _info_nce_supcon_fwd_kernel mean the same)
    SUPCON: tl.constexpr,
    ROWSUM_NORMALIZE: tl.constexpr,
    NORMALIZE: tl.constexpr,
    FROM_G: tl.constexpr,
    SIGMA: tl.constexpr,  # this launch only writes sigma (launched with ROWSUM_NORMALIZE only)
    SOFT_TARGET: tl.constexpr,
    ACC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,  # feature columns of dL/dF per program (the grid's second axis); None when SIGMA or FROM_G
    PREC: tl.constexpr,
):
    """SIGMA: sigma_i = dL/dS_i (code pass). Else dF[rows, D chunk] (tl.dot path) or the rows of M (G path)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    r64 = rows.to(tl.int64)
    rmask, sq_r, s_r, lab_r, keep_r = _side(rows, N, sq_ptr, sq_stride, lab_ptr, NORMALIZE, SUPCON, ACC)
    lse_r, aux_r = _side_stats(rows, rmask, lse_ptr, aux_ptr, SUPCON, SOFT_TARGET)
    if ROWSUM_NORMALIZE:
        S_r = tl.load(rowsum_ptr + rows, mask=rmask, other=1.0)
        if not SIGMA:
            sig_r = tl.load(sigma_ptr + rows, mask=rmask, other=0.0)
    inv_t = tl.cast(inv_t_hi, ACC) + tl.cast(inv_t_lo, ACC)
    smoothing_or_ratio = tl.cast(coef_hi, ACC) + tl.cast(coef_lo, ACC)
    g_out = tl.load(gout_ptr).to(ACC)
    if SUPCON:
        coef = -g_out * smoothing_or_ratio / tl.maximum(tl.load(cnt_ptr), 1.0)
    else:
        coef = g_out / N
    if not SIGMA:
        if not FROM_G:  # this program's chunk of feature columns of dF
            dcols = tl.program_id(1) * BD + tl.arange(0, BD)
            dmask = dcols < D
            acc = tl.zeros([BM, BD], dtype=ACC)
    R = tl.zeros([BM], dtype=ACC)
    Q = tl.zeros([BM], dtype=ACC)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        c64 = cols.to(tl.int64)
        cmask, sq_c, s_c, lab_c, keep_c = _side(cols, N, sq_ptr, sq_stride, lab_ptr, NORMALIZE, SUPCON, ACC)
        lse_c, aux_c = _side_stats(cols, cmask, lse_ptr, aux_ptr, SUPCON, SOFT_TARGET)
        pair = keep_r[:, None] & keep_c[None, :] & (rows[:, None] != cols[None, :])
        g = _gram_tile(x_ptr, g_ptr, rows, cols, N, D, stride_xr, stride_xc, FROM_G, ACC, BM, BN, BK, PREC)
        d, gp = _distances(g, sq_r, s_r, sq_c, s_c, pair)
        if ROWSUM_NORMALIZE:
            S_c = tl.load(rowsum_ptr + cols, mask=cmask, other=1.0)
            dn1 = d / (S_c[None, :] + _ROW_SUM_EPS)
            dn2 = d / (S_r[:, None] + _ROW_SUM_EPS)
        else:
            dn1 = d
            dn2 = d
        # anchor = column j, other = row i: dL/d(dn_ji), stored at [i, j]
        e2 = _dloss_ddn(
            dn2,
            pair,
            cols[None, :],
            rows[:, None],
            lse_c[None, :],
            aux_c[None, :],
            lab_c[None, :],
            lab_r[:, None],
            tgt_ptr,
            coef,
            inv_t,
            smoothing_or_ratio,
            half,
            N,
            SUPCON,
            SOFT_TARGET,
        )
        if SIGMA:
            R += tl.sum(e2 * d, axis=1)
        else:
            e1 = _dloss_ddn(
                dn1,
                pair,
                rows[:, None],
                cols[None, :],
                lse_r[:, None],
                aux_r[:, None],
                lab_r[:, None],
                lab_c[None, :],
                tgt_ptr,
                coef,
                inv_t,
                smoothing_or_ratio,
                half,
                N,
                SUPCON,
                SOFT_TARGET,
            )
            if ROWSUM_NORMALIZE:
                sig_c = tl.load(sigma_ptr + cols, mask=cmask, other=0.0)
                e1 = e1 / (S_c[None, :] + _ROW_SUM_EPS) + sig_r[:, None]
                e2 = e2 / (S_r[:, None] + _ROW_SUM_EPS) + sig_c[None, :]
            nz = d > 0
            c = tl.where(nz, (e1 + e2) / tl.where(nz, d, 1.0), 0.0)
            R += tl.sum(c, axis=1)
            if NORMALIZE:
                Q += tl.sum(c * gp, axis=1)
            t = (s_r[:, None] * c) * s_c[None, :]
            if FROM_G:
                off = r64[:, None] * N + c64[None, :]
                tl.store(o_ptr + off, -t, mask=rmask[:, None] & cmask[None, :] & (rows[:, None] != cols[None, :]))
            else:
                fj = tl.load(
                    x_ptr + c64[:, None] * stride_xr + dcols[None, :] * stride_xc,
                    mask=cmask[:, None] & dmask[None, :],
                    other=0.0,
                )
                acc = tl.dot(t, fj.to(ACC), acc, input_precision=PREC, out_dtype=ACC)  # out_dtype: fp64 on triton 3.6
    if SIGMA:
        sig = -R / ((S_r + _ROW_SUM_EPS) * (S_r + _ROW_SUM_EPS))
        tl.store(sigma_ptr + rows, tl.where(keep_r, sig, 0.0), mask=rmask)
    else:
        if NORMALIZE:
            sqp_r = (s_r * s_r) * sq_r
            a = (s_r * s_r) * tl.where(tl.sqrt(sq_r) >= _NORM_EPS, R * (1.0 - sqp_r) + Q, R)
        else:
            a = R
        if FROM_G:
            tl.store(o_ptr + r64 * N + r64, a, mask=rmask)
        else:
            fi = tl.load(
                x_ptr + r64[:, None] * stride_xr + dcols[None, :] * stride_xc,
                mask=rmask[:, None] & dmask[None, :],
                other=0.0,
            )
            df = a[:, None] * fi.to(ACC) - acc
            tl.store(
                o_ptr + r64[:, None] * D + dcols[None, :],
                df.to(o_ptr.dtype.element_ty),
                mask=rmask[:, None] & dmask[None, :],
            )


# ------------------------------------------------------------------------------------------------------------- host

_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


def _config(acc: torch.dtype, d: int) -> dict:
    """Tile sizes: small under the interpreter (so tests cover several tiles), tensor-core sized on a GPU."""
    if launch.interpreting():
        return dict(BM=32, BN=32, BK=32, BD=32, warps=4, g_bm=32, g_bn=32)
    if acc == torch.float64:
        return dict(BM=32, BN=32, BK=32, BD=min(64, max(16, triton.next_power_of_2(d))), warps=4, g_bm=32, g_bn=64)
    return dict(BM=64, BN=64, BK=64, BD=min(128, max(16, triton.next_power_of_2(d))), warps=8, g_bm=32, g_bn=64)


def _pick_gram(n: int, d: int, gram: str | None) -> str:
    gram = GRAM if gram is None else gram
    if gram not in ("auto", "triton", "mm"):
        raise ValueError(f"gram={gram!r} is not one of 'auto', 'triton', 'mm'")
    if gram != "auto":
        return gram
    return "mm" if n <= MM_MAX_ROWS or (d >= MM_MIN_DIM and n <= MM_MAX_ROWS_WIDE) else "triton"


class _Spec(NamedTuple):
    """One loss call's switches and scalars, shared by its forward and backward launches."""

    supcon: bool  # SupCon over labels, else InfoNCE over 2 views
    inv_t: float  # 1 / temperature
    coef: float  # InfoNCE: label smoothing; SupCon: temperature / base_temperature
    rowsum_normalize: bool  # divide d_ij by (S_j + eps): the codes' variant
    from_g: bool  # Gram tiles read from a materialised G = F F^T, else computed with tl.dot
    soft_target: bool = False  # InfoNCE: the smoothing mass spread by a given target matrix, else uniformly

    def kernel_args(self, acc: torch.dtype) -> dict:
        """The arguments every forward and backward launch takes alike: the scalars as fp32 hi/lo pairs, the
        switches and the accumulation dtype."""
        inv_t_hi, inv_t_lo = launch.fp32_pair(self.inv_t)
        coef_hi, coef_lo = launch.fp32_pair(self.coef)
        return dict(
            inv_t_hi=inv_t_hi,
            inv_t_lo=inv_t_lo,
            coef_hi=coef_hi,
            coef_lo=coef_lo,
            SUPCON=self.supcon,
            ROWSUM_NORMALIZE=self.rowsum_normalize,
            NORMALIZE=not self.supcon,
            FROM_G=self.from_g,
            SOFT_TARGET=self.soft_target,
            ACC=_TL_DTYPES[acc],
        )


def _gram_and_norms(features: Tensor, given_g: Tensor | None, from_g: bool, acc: torch.dtype, cfg: dict):
    """(G or None, the squared norms or G) of the forward: the Gram path reads sq_i off G's diagonal; the tiled path
    computes sq_i with the same tl.dot tiles as its Gram tiles."""
    n, d = features.shape
    if from_g:
        g = given_g
        if g is None:
            xc = features.to(acc)
            g = torch.mm(xc, xc.t())
        return g, g
    sq = launch.new_buffer((n,), acc, features.device)
    _info_nce_supcon_sqnorm_kernel[(triton.cdiv(n, cfg["BM"]),)](
        x_ptr=features,
        sq_ptr=sq,
        N=n,
        D=d,
        stride_xr=features.stride(0),
        stride_xc=features.stride(1),
        ACC=_TL_DTYPES[acc],
        BM=cfg["BM"],
        BK=cfg["BK"],
        PREC=DOT_PRECISION,
        num_warps=4,
    )
    return None, sq


def _row_args(features: Tensor, spec: _Spec, acc: torch.dtype, g, sq, labels, target, rowsums) -> dict:
    """The arguments the forward and backward row kernels take alike: F, G (None on the tiled path), the squared
    norms (G itself on the Gram path, read along its diagonal), the labels, smoothing target and row sums (None where
    the loss has none), the sizes, the scalars and switches, and the tile sizes."""
    n, d = features.shape
    cfg = _config(acc, d)
    return dict(
        x_ptr=features,
        g_ptr=g,
        sq_ptr=sq,
        sq_stride=n + 1 if spec.from_g else 1,
        lab_ptr=labels,
        tgt_ptr=target,
        rowsum_ptr=rowsums,
        N=n,
        D=d,
        stride_xr=features.stride(0),
        stride_xc=features.stride(1),
        half=n // 2,
        **spec.kernel_args(acc),
        BM=cfg["g_bm"] if spec.from_g else cfg["BM"],
        BN=cfg["g_bn"] if spec.from_g else cfg["BN"],
        BK=cfg["BK"],
        PREC=DOT_PRECISION,
        num_warps=4 if spec.from_g else cfg["warps"],
    )


def _forward(features: Tensor, labels: Tensor | None, target: Tensor | None, given_g: Tensor | None, spec: _Spec):
    """The loss and what the backward reads: (loss, G or the squared norms, LSE, 1/|P(i)| or W_i, row sums, anchor
    count), the last three None where the loss has none. Launches: sq_i (tiled path), S_i (codes' variant), the row
    terms, the loss."""
    n, d = features.shape
    dev = features.device
    acc = launch.compute_dtype(features.dtype)
    cfg = _config(acc, d)
    lse = launch.new_buffer((n,), acc, dev)
    out = launch.new_buffer((n,), acc, dev)
    aux = launch.new_buffer((n,), acc, dev) if spec.supcon or spec.soft_target else None
    rowsums = launch.new_buffer((n,), acc, dev) if spec.rowsum_normalize else None
    loss = launch.new_buffer((), acc, dev)
    cnt = launch.new_buffer((), acc, dev) if spec.supcon else None
    with launch.device_ctx(features):
        g, sq = _gram_and_norms(features, given_g, spec.from_g, acc, cfg)
        rows = _row_args(features, spec, acc, g, sq, labels, target, rowsums)
        grid = (triton.cdiv(n, rows["BM"]),)
        if spec.rowsum_normalize:  # first pass: the row sums S_i that the distances are divided by
            _info_nce_supcon_fwd_kernel[grid](**rows, lse_ptr=None, out_ptr=None, aux_ptr=None, ROWSUM_PASS=True)
        _info_nce_supcon_fwd_kernel[grid](**rows, lse_ptr=lse, out_ptr=out, aux_ptr=aux, ROWSUM_PASS=False)
        ratio_hi, ratio_lo = launch.fp32_pair(spec.coef) if spec.supcon else (None, None)
        _info_nce_supcon_fwd_finalize_kernel[(1,)](
            out_ptr=out,
            aux_ptr=aux,
            loss_ptr=loss,
            cnt_ptr=cnt,
            N=n,
            ratio_hi=ratio_hi,
            ratio_lo=ratio_lo,
            SUPCON=spec.supcon,
            BLOCK=1024,
            num_warps=4,
        )
    return loss, g if spec.from_g else sq, lse, aux, rowsums, cnt


def _backward(
    grad_out: Tensor, spec: _Spec, to_g: bool, features, labels, target, g_or_sq, lse, aux, rowsums, cnt
) -> Tensor:
    """dL/dF from the forward's saved tensors; with `to_g` (the loss was computed from a given Gram) the matrix M
    with dL/dF = M F instead. Launches: sigma (codes' variant), then dF (tiled path) or M (Gram path)."""
    n, d = features.shape
    dev = features.device
    acc = lse.dtype
    g = g_or_sq if spec.from_g else None
    rows = _row_args(features, spec, acc, g, g_or_sq, labels, target, rowsums)
    rows.update(
        sigma_ptr=launch.new_buffer((n,), acc, dev) if spec.rowsum_normalize else None,
        lse_ptr=lse,
        aux_ptr=aux,
        gout_ptr=grad_out.detach().to(acc).reshape(()),
        cnt_ptr=cnt,
    )
    row_blocks = triton.cdiv(n, rows["BM"])
    with launch.device_ctx(features):
        if spec.rowsum_normalize:  # first pass: sigma_i = dL/dS_i, which every gradient entry needs
            _info_nce_supcon_bwd_kernel[(row_blocks,)](**rows, o_ptr=None, SIGMA=True, BD=None)
        if spec.from_g:
            m = launch.new_buffer((n, n), acc, dev)
            _info_nce_supcon_bwd_kernel[(row_blocks,)](**rows, o_ptr=m, SIGMA=False, BD=None)
            return m if to_g else torch.mm(m, features.to(acc)).to(features.dtype)
        grad = launch.new_buffer((n, d), features.dtype, dev)
        bd = _config(acc, d)["BD"]
        _info_nce_supcon_bwd_kernel[(row_blocks, triton.cdiv(d, bd))](**rows, o_ptr=grad, SIGMA=False, BD=bd)
    return grad


class _Gram(torch.autograd.Function):
    """G = F F^T in the accumulation dtype, shared by several losses; backward (dG + dG^T) F: one GEMM for all."""

    @staticmethod
    def forward(ctx, features, acc):
        ctx.save_for_backward(features)
        xc = features.to(acc)
        return torch.mm(xc, xc.t())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_g):
        (features,) = ctx.saved_tensors
        return torch.mm(grad_g + grad_g.t(), features.to(grad_g.dtype)).to(features.dtype), None


class _Contrastive(torch.autograd.Function):
    """One loss over `features`; with `given_g` (a `_Gram` of them) the loss is computed from it and its gradient
    goes to `given_g` (M / 2: the backward's M is symmetric and d(F F^T) gives (dG + dG^T) F = M F). `target`:
    InfoNCE's smoothing target (checked, contiguous, in the compute dtype), a constant; None: uniform."""

    @staticmethod
    def forward(
        ctx, features, labels, supcon, inv_t, smoothing_or_ratio, rowsum_normalize, gram, given_g=None, target=None
    ):
        from_g = gram == "mm" or given_g is not None
        spec = _Spec(supcon, inv_t, smoothing_or_ratio, rowsum_normalize, from_g, target is not None)
        loss, *saved = _forward(features, labels, target, given_g, spec)
        ctx.save_for_backward(features, labels, target, *saved)
        ctx.spec, ctx.to_g = spec, given_g is not None
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grad = _backward(grad_out, ctx.spec, ctx.to_g, *ctx.saved_tensors)
        if ctx.to_g:
            return None, None, None, None, None, None, None, grad * 0.5, None
        return grad, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------- public


def _check_features(features: Tensor, name: str) -> None:
    launch.check_float_matrix(features, name, "features", "[N, D]")
    if features.shape[1] < 1:
        raise ValueError(f"{name}: features must have at least one column, got shape {tuple(features.shape)}")
    launch.check_device(features, name)


def _check_positive(value, what: str, name: str) -> float:
    value = float(value)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}: {what} must be a positive finite number, got {value}")
    return value


def _info_nce_args(features: Tensor, temperature, label_smoothing, smoothing_target, name: str):
    """Checked (1 / temperature, label_smoothing, the smoothing target as the kernels read it or None) of an InfoNCE
    call."""
    _check_features(features, name)
    n = features.shape[0]
    if n < 2 or n % 2:
        raise ValueError(f"{name}: features must hold 2 views of B >= 1 samples (an even number of rows), got {n} rows")
    inv_t = 1.0 / _check_positive(temperature, "temperature", name)
    smoothing = float(label_smoothing)
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {smoothing}")
    if smoothing_target is None:
        return inv_t, smoothing, None
    launch.check_float_matrix(smoothing_target, name, "smoothing_target", "[N, N]")
    if smoothing_target.shape != (n, n):
        raise ValueError(
            f"{name}: smoothing_target must be [N, N] for the {n} feature rows, got {tuple(smoothing_target.shape)}"
        )
    if smoothing_target.device != features.device:
        raise ValueError(f"{name}: smoothing_target is on {smoothing_target.device} but features on {features.device}")
    return inv_t, smoothing, smoothing_target.detach().to(launch.compute_dtype(features.dtype)).contiguous()


def _supcon_args(features: Tensor, labels, temperature, base_temperature, name: str) -> tuple[Tensor, float, float]:
    """Checked (int64 labels, 1 / temperature, temperature / base_temperature) of a SupCon call."""
    _check_features(features, name)
    if not isinstance(labels, Tensor):
        raise TypeError(f"{name}: labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.shape != features.shape[:1]:
        raise ValueError(
            f"{name}: labels must have one entry per feature row: {tuple(labels.shape)} vs {tuple(features.shape)}"
        )
    if labels.device != features.device:
        raise ValueError(f"{name}: labels are on {labels.device} but features on {features.device}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"{name}: labels must be an integer tensor (-1 = no label), got {labels.dtype}")
    t = _check_positive(temperature, "temperature", name)
    tb = _check_positive(base_temperature, "base_temperature", name)
    return labels.detach().to(torch.int64).contiguous(), 1.0 / t, t / tb


def info_nce_loss(
    features: Tensor,
    temperature: float = 1.0,
    label_smoothing: float = 0.0,
    rowsum_normalize: bool = False,
    smoothing_target: Tensor | None = None,
    *,
    gram: str | None = None,
) -> Tensor:
    """Euclidean InfoNCE over 2 views with label smoothing; see `reference.info_nce_loss`.

    `features` [2B, D] view-major, rows L2-normalised inside. Returns an fp32 scalar (fp64 for fp64 input).
    `smoothing_target` [2B, 2B]: where the smoothing mass goes (None: uniformly). `gram`: "triton" (tl.dot tiles,
    O(N D) memory), "mm" (torch.mm Gram), or None/"auto" (`GRAM`, size rule).
    """
    inv_t, smoothing, target = _info_nce_args(features, temperature, label_smoothing, smoothing_target, "info_nce_loss")
    n, d = features.shape
    path = _pick_gram(n, d, gram)
    return _Contrastive.apply(features, None, False, inv_t, smoothing, bool(rowsum_normalize), path, None, target)


def supcon_loss(
    features: Tensor,
    labels: Tensor,
    temperature: float = 0.07,
    base_temperature: float = 0.07,
    rowsum_normalize: bool = False,
    *,
    gram: str | None = None,
) -> Tensor:
    """Euclidean SupCon (contrast_mode='all') over the rows whose label is not -1; see `reference.supcon_loss`.

    Features are not normalised. Anchors without a positive are left out of the mean; with no anchor the loss is 0.
    Returns an fp32 scalar (fp64 for fp64 input). `gram` as in `info_nce_loss`.
    """
    lab, inv_t, ratio = _supcon_args(features, labels, temperature, base_temperature, "supcon_loss")
    n, d = features.shape
    if n == 0:
        return features.sum(dtype=launch.compute_dtype(features.dtype)) * 0.0
    return _Contrastive.apply(features, lab, True, inv_t, ratio, bool(rowsum_normalize), _pick_gram(n, d, gram))


def info_nce_and_supcon(
    features: Tensor,
    supcon_labels: list[Tensor],
    temperature: float = 1.0,
    label_smoothing: float = 0.0,
    supcon_temperature: float = 0.07,
    base_temperature: float = 0.07,
    rowsum_normalize: bool = False,
    smoothing_target: Tensor | None = None,
    *,
    gram: str | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """`info_nce_loss(features, ...)` and one `supcon_loss(features, labels, ...)` per label vector, sharing one Gram
    matrix: one GEMM forward and one backward for all the terms instead of one pair each. On the tiled ("triton") path
    there is no Gram matrix to share and the terms are computed one by one."""
    name = "info_nce_and_supcon"
    inv_t, smoothing, target = _info_nce_args(features, temperature, label_smoothing, smoothing_target, name)
    sup_args = [_supcon_args(features, y, supcon_temperature, base_temperature, name) for y in supcon_labels]
    n, d = features.shape
    path = _pick_gram(n, d, gram)
    rowsum = bool(rowsum_normalize)
    if path != "mm":
        nce = _Contrastive.apply(features, None, False, inv_t, smoothing, rowsum, path, None, target)
        return nce, [_Contrastive.apply(features, lab, True, it, r, rowsum, path) for lab, it, r in sup_args]
    g = _Gram.apply(features, launch.compute_dtype(features.dtype))
    nce = _Contrastive.apply(features, None, False, inv_t, smoothing, rowsum, path, g, target)
    return nce, [_Contrastive.apply(features, lab, True, it, r, rowsum, path, g) for lab, it, r in sup_args]
