"""Fused Euclidean contrastive losses (InfoNCE with label smoothing, SupCon over a label vector) in Triton.

Same functions as `reference.info_nce_loss` / `supcon_loss` (docs/reference.md §3.1, §3.2, §3.9, §8), forward and
backward, without an N x N matrix in memory on the tiled path.

Math (x_i = s_i f_i, s_i = 1 / max(||f_i||, NORM_EPS) for InfoNCE, s_i = 1 for SupCon):
- Gram G = F F^T, sq_i = G_ii (taken from the same dot product as G, so duplicate rows give d2 = 0 exactly),
  d_ij = sqrt(max(s_i^2 sq_i + s_j^2 sq_j - 2 s_i s_j G_ij, 0)), d_ii = 0, and the gradient through d = 0 is 0.
- `rowsum_normalize` (the codes' variant): dn_ij = d_ij / (S_j + eps), eps = ROW_SUM_EPS, S_j = sum_k d_jk over the kept
  columns, from a first pass.
- Logits l_ij = -dn_ij / T, online log-sum-exp per row over column tiles (self and dropped rows masked).
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
"""

from __future__ import annotations

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

__all__ = ["GRAM", "info_nce_loss", "supcon_loss"]


# ----------------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _row_scale(sq, NORMALIZE: tl.constexpr):
    if NORMALIZE:
        s = 1.0 / tl.maximum(tl.sqrt(sq), _NORM_EPS)
    else:
        s = tl.full(sq.shape, 1.0, sq.dtype)
    return s


@triton.jit
def _gram_tile(
    x_ptr,  # features F [N, D]
    g_ptr,  # the materialised Gram matrix G = F F^T [N, N], read when FROM_G
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
    rmask = rows < N
    cmask = cols < N
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    if FROM_G:
        g = tl.load(g_ptr + r64[:, None] * N + c64[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        g = g.to(ACC)
    else:
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
def _side(idx, N, sq_ptr, sq_stride, lab_ptr, NORMALIZE: tl.constexpr, SUPCON: tl.constexpr, ACC: tl.constexpr):
    """Per-index vectors of one tile side: in-bounds mask, sq = G_ii, scale s, label, kept (label >= 0) mask."""
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
def _side_stats(idx, m, lse_ptr, aux_ptr, SUPCON: tl.constexpr):
    """Saved per-row LSE and (SupCon) 1/|P(i)| of one tile side (the LSE doubles as a dummy for InfoNCE)."""
    lse = tl.load(lse_ptr + idx, mask=m, other=0.0)
    if SUPCON:
        aux = tl.load(aux_ptr + idx, mask=m, other=0.0)
    else:
        aux = lse
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
    dn, pair, a_idx, o_idx, a_lse, a_aux, a_lab, o_lab, coef, inv_t, smoothing, half, N, SUPCON: tl.constexpr
):
    """dL/d(dn) for anchor a, other o (broadcast tiles): InfoNCE with label `smoothing` or SupCon (which ignores
    `smoothing`), times the upstream coefficient."""
    p = tl.where(pair, tl.exp(tl.where(pair, -dn * inv_t - a_lse, 0.0)), 0.0)
    if SUPCON:
        w = tl.where(a_lab == o_lab, a_aux, 0.0) - p
        w = tl.where(a_aux > 0, w, 0.0)
    else:
        a_pos = tl.where(a_idx < half, a_idx + half, a_idx - half)
        w = p - tl.where(o_idx == a_pos, 1.0 - smoothing, 0.0) - smoothing / (N - 1)
    return tl.where(pair, (-inv_t * coef) * w, 0.0)


@triton.jit
def _sqnorm_kernel(
    # pointers
    x_ptr,  # features F [N, D]
    sq_ptr,  # out: squared row norms sq_i = G_ii [N]
    # sizes
    N,
    D,
    # strides of F (row, column)
    stride_xr,
    stride_xc,
    # meta-parameters: see _fwd_kernel
    ACC: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
):
    """sq_i = G_ii from the same tl.dot tiles the other kernels use (diagonal block, BN = BM)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    g = _gram_tile(x_ptr, x_ptr, rows, rows, N, D, stride_xr, stride_xc, False, ACC, BM, BM, BK, PREC)
    diag = tl.sum(tl.where(rows[:, None] == rows[None, :], g, 0.0), axis=1)
    tl.store(sq_ptr + rows, diag, mask=rows < N)


@triton.jit
def _fwd_kernel(
    # pointers
    x_ptr,  # features F [N, D]
    g_ptr,  # Gram matrix G = F F^T [N, N] when FROM_G (else F again, unread)
    sq_ptr,  # squared row norms G_ii: the diagonal of G (sq_stride N + 1) or a vector (sq_stride 1)
    sq_stride,
    lab_ptr,  # SupCon labels [N] (-1: row left out); unread for InfoNCE
    rowsum_ptr,  # row sums S_i = sum_j d_ij [N]: written by the ROWSUM_PASS launch, read by the next one
    lse_ptr,  # out: per-row log-sum-exp [N], kept for the backward
    out_ptr,  # out: per-row loss term [N]
    aux_ptr,  # out (SupCon): 1 / |P(i)|, the inverse positive count, 0 for a row without a positive [N]
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
            term = (1.0 - smoothing) * (lse - sum_pos) + smoothing * (lse - sum_l / (N - 1))
            tl.store(lse_ptr + rows, lse, mask=rmask)
        tl.store(out_ptr + rows, term, mask=rmask)


@triton.jit
def _finalize_kernel(
    # pointers: the forward's row terms and 1/|P(i)|; out: the loss and the anchor count
    out_ptr,
    aux_ptr,
    loss_ptr,
    cnt_ptr,
    # size
    N,
    # SupCon's temperature / base_temperature, an fp32 hi + lo pair
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
def _bwd_kernel(
    # pointers (those shared with _fwd_kernel mean the same)
    x_ptr,
    g_ptr,
    sq_ptr,
    sq_stride,
    lab_ptr,
    rowsum_ptr,
    sigma_ptr,  # sigma_i = dL/dS_i [N]: written by the SIGMA launch, read by the next one
    lse_ptr,
    aux_ptr,
    gout_ptr,  # the upstream gradient of the loss (a scalar on the device)
    cnt_ptr,  # SupCon: the number of anchors, from _finalize_kernel
    o_ptr,  # out: dL/dF [N, D], or the matrix M [N, N] with dL/dF = M F when FROM_G
    # sizes
    N,
    D,
    # strides of F and of the output (row, column)
    stride_xr,
    stride_xc,
    stride_or,
    stride_oc,
    half,
    # scalars (as in _fwd_kernel)
    inv_t_hi,
    inv_t_lo,
    coef_hi,
    coef_lo,
    # meta-parameters (those shared with _fwd_kernel mean the same)
    SUPCON: tl.constexpr,
    ROWSUM_NORMALIZE: tl.constexpr,
    NORMALIZE: tl.constexpr,
    FROM_G: tl.constexpr,
    SIGMA: tl.constexpr,  # this launch only writes sigma
    ACC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,  # feature columns of dL/dF per program (the grid's second axis)
    PREC: tl.constexpr,
):
    """SIGMA: sigma_i = dL/dS_i (code pass). Else dF[rows, D chunk] (tl.dot path) or the rows of M (G path)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    r64 = rows.to(tl.int64)
    rmask, sq_r, s_r, lab_r, keep_r = _side(rows, N, sq_ptr, sq_stride, lab_ptr, NORMALIZE, SUPCON, ACC)
    lse_r, aux_r = _side_stats(rows, rmask, lse_ptr, aux_ptr, SUPCON)
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
    dcols = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = dcols < D
    R = tl.zeros([BM], dtype=ACC)
    Q = tl.zeros([BM], dtype=ACC)
    acc = tl.zeros([BM, BD], dtype=ACC)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        c64 = cols.to(tl.int64)
        cmask, sq_c, s_c, lab_c, keep_c = _side(cols, N, sq_ptr, sq_stride, lab_ptr, NORMALIZE, SUPCON, ACC)
        lse_c, aux_c = _side_stats(cols, cmask, lse_ptr, aux_ptr, SUPCON)
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
            coef,
            inv_t,
            smoothing_or_ratio,
            half,
            N,
            SUPCON,
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
                coef,
                inv_t,
                smoothing_or_ratio,
                half,
                N,
                SUPCON,
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
                off = r64[:, None] * stride_or + c64[None, :] * stride_oc
                tl.store(o_ptr + off, -t, mask=rmask[:, None] & cmask[None, :] & (rows[:, None] != cols[None, :]))
            else:
                fj = tl.load(
                    x_ptr + c64[:, None] * stride_xr + dcols[None, :] * stride_xc,
                    mask=cmask[:, None] & dmask[None, :],
                    other=0.0,
                )
                acc = tl.dot(t, fj.to(ACC), acc, input_precision=PREC, out_dtype=ACC)  # out_dtype: fp64 on triton 3.6
    if SIGMA:
        if ROWSUM_NORMALIZE:
            sig = -R / ((S_r + _ROW_SUM_EPS) * (S_r + _ROW_SUM_EPS))
        else:
            sig = R
        tl.store(sigma_ptr + rows, tl.where(keep_r, sig, 0.0), mask=rmask)
    else:
        if NORMALIZE:
            sqp_r = (s_r * s_r) * sq_r
            a = (s_r * s_r) * tl.where(tl.sqrt(sq_r) >= _NORM_EPS, R * (1.0 - sqp_r) + Q, R)
        else:
            a = R
        if FROM_G:
            tl.store(o_ptr + r64 * stride_or + r64 * stride_oc, a, mask=rmask)
        else:
            fi = tl.load(
                x_ptr + r64[:, None] * stride_xr + dcols[None, :] * stride_xc,
                mask=rmask[:, None] & dmask[None, :],
                other=0.0,
            )
            df = a[:, None] * fi.to(ACC) - acc
            tl.store(
                o_ptr + r64[:, None] * stride_or + dcols[None, :] * stride_oc,
                df.to(o_ptr.dtype.element_ty),
                mask=rmask[:, None] & dmask[None, :],
            )


# ------------------------------------------------------------------------------------------------------------- host

_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def _check_features(features: Tensor, name: str) -> None:
    if not isinstance(features, Tensor):
        raise TypeError(f"{name}: features must be a torch.Tensor, got {type(features).__name__}")
    if features.dim() != 2:
        raise ValueError(f"{name}: features must be 2-D [N, D], got shape {tuple(features.shape)}")
    if features.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: features must be float16, bfloat16, float32 or float64, got {features.dtype}")
    if features.shape[1] < 1:
        raise ValueError(f"{name}: features must have at least one column, got shape {tuple(features.shape)}")
    launch.check_device(features, name)


def _check_positive(value, what: str, name: str) -> float:
    value = float(value)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}: {what} must be a positive finite number, got {value}")
    return value


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


def _gram_and_norms(features: Tensor, given_g: Tensor | None, from_g: bool, acc: torch.dtype, cfg: dict):
    """(G or None, squared norms, their stride, BM, BN) of the forward: the Gram path reads sq_i off G's diagonal
    (stride N + 1); the tiled path computes sq_i with the same tl.dot tiles as its Gram tiles."""
    n, d = features.shape
    if from_g:
        g = given_g
        if g is None:
            xc = features.to(acc)
            g = torch.mm(xc, xc.t())
        return g, g, n + 1, cfg["g_bm"], cfg["g_bn"]
    sq = launch.new_buffer((n,), acc, features.device)
    _sqnorm_kernel[(triton.cdiv(n, cfg["BM"]),)](
        features,
        sq,
        n,
        d,
        features.stride(0),
        features.stride(1),
        ACC=_TL_DTYPES[acc],
        BM=cfg["BM"],
        BK=cfg["BK"],
        PREC=DOT_PRECISION,
        num_warps=4,
    )
    return None, sq, 1, cfg["BM"], cfg["BN"]


class _Contrastive(torch.autograd.Function):
    """One loss over `features`; with `given_g` (a `_Gram` of them) the loss is computed from it and its gradient
    goes to `given_g` (M / 2: the backward's M is symmetric and d(F F^T) gives (dG + dG^T) F = M F)."""

    @staticmethod
    def forward(ctx, features, labels, supcon, inv_t, smoothing_or_ratio, rowsum_normalize, gram, given_g=None):
        n, d = features.shape
        dev = features.device
        acc = launch.compute_dtype(features.dtype)
        cfg = _config(acc, d)
        normalize = not supcon
        scalars = (*launch.fp32_pair(inv_t), *launch.fp32_pair(smoothing_or_ratio))
        lse = launch.new_buffer((n,), acc, dev)
        out = launch.new_buffer((n,), acc, dev)
        aux = launch.new_buffer((n,), acc, dev) if supcon else lse
        rowsums = launch.new_buffer((n,), acc, dev) if rowsum_normalize else lse
        loss = launch.new_buffer((), acc, dev)
        cnt = launch.new_buffer((), acc, dev) if supcon else loss
        lab = labels if supcon else lse
        from_g = gram == "mm" or given_g is not None
        with launch.device_ctx(features):
            g, sq, sq_stride, bm, bn = _gram_and_norms(features, given_g, from_g, acc, cfg)
            args = (features, g if from_g else features, sq, sq_stride, lab, rowsums, lse, out, aux, n, d)
            args += (features.stride(0), features.stride(1), n // 2, *scalars)
            for rowsum_pass in (True, False) if rowsum_normalize else (False,):
                _fwd_kernel[(triton.cdiv(n, bm),)](
                    *args,
                    SUPCON=supcon,
                    ROWSUM_NORMALIZE=rowsum_normalize,
                    NORMALIZE=normalize,
                    FROM_G=from_g,
                    ROWSUM_PASS=rowsum_pass,
                    ACC=_TL_DTYPES[acc],
                    BM=bm,
                    BN=bn,
                    BK=cfg["BK"],
                    PREC=DOT_PRECISION,
                    num_warps=cfg["warps"] if not from_g else 4,
                )
            _finalize_kernel[(1,)](out, aux, loss, cnt, n, *scalars[2:], SUPCON=supcon, BLOCK=1024, num_warps=4)
        ctx.save_for_backward(features, lab, g if from_g else sq, lse, aux, rowsums, cnt)
        ctx.flags = (supcon, rowsum_normalize, from_g, given_g is not None)
        ctx.scalars = scalars
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        features, lab, g_or_sq, lse, aux, rowsums, cnt = ctx.saved_tensors
        supcon, rowsum_normalize, from_g, to_g = ctx.flags
        n, d = features.shape
        dev = features.device
        acc = lse.dtype
        cfg = _config(acc, d)
        gout = grad_out.detach().to(acc).reshape(())
        if from_g:
            sq, sq_stride, bm, bn = g_or_sq, n + 1, cfg["g_bm"], cfg["g_bn"]
        else:
            sq, sq_stride, bm, bn = g_or_sq, 1, cfg["BM"], cfg["BN"]
        sigma = launch.new_buffer((n,), acc, dev) if rowsum_normalize else lse
        consts = dict(
            SUPCON=supcon,
            ROWSUM_NORMALIZE=rowsum_normalize,
            NORMALIZE=not supcon,
            FROM_G=from_g,
            ACC=_TL_DTYPES[acc],
            BM=bm,
            BN=bn,
            BK=cfg["BK"],
            PREC=DOT_PRECISION,
        )
        head = (features, g_or_sq, sq, sq_stride, lab, rowsums, sigma, lse, aux, gout, cnt)
        xs = (features.stride(0), features.stride(1))
        warps = 4 if from_g else cfg["warps"]
        with launch.device_ctx(features):
            if rowsum_normalize:
                _bwd_kernel[(triton.cdiv(n, bm), 1)](
                    *head, sigma, n, d, *xs, 0, 0, n // 2, *ctx.scalars, SIGMA=True, BD=16, num_warps=warps, **consts
                )
            if from_g:
                m = launch.new_buffer((n, n), acc, dev)
                _bwd_kernel[(triton.cdiv(n, bm), 1)](
                    *head, m, n, d, *xs, n, 1, n // 2, *ctx.scalars, SIGMA=False, BD=16, num_warps=warps, **consts
                )
                if to_g:
                    grad = None
                else:
                    grad = torch.mm(m, features.to(acc)).to(features.dtype)
            else:
                grad = launch.new_buffer((n, d), features.dtype, dev)
                bd = cfg["BD"]
                _bwd_kernel[(triton.cdiv(n, bm), triton.cdiv(d, bd))](
                    *head, grad, n, d, *xs, *grad.stride(), n // 2, *ctx.scalars, SIGMA=False, BD=bd, num_warps=warps,
                    **consts,
                )
        if to_g:
            return None, None, None, None, None, None, None, m * 0.5
        return grad, None, None, None, None, None, None, None


def _info_nce_args(features: Tensor, temperature, label_smoothing, name: str) -> tuple[float, float]:
    """Checked (1 / temperature, label_smoothing) of an InfoNCE call."""
    _check_features(features, name)
    n = features.shape[0]
    if n < 2 or n % 2:
        raise ValueError(f"{name}: features must hold 2 views of B >= 1 samples (an even number of rows), got {n} rows")
    inv_t = 1.0 / _check_positive(temperature, "temperature", name)
    smoothing = float(label_smoothing)
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {smoothing}")
    return inv_t, smoothing


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
    *,
    gram: str | None = None,
) -> Tensor:
    """Euclidean InfoNCE over 2 views with label smoothing; see `reference.info_nce_loss`.

    `features` [2B, D] view-major, rows L2-normalised inside. Returns an fp32 scalar (fp64 for fp64 input).
    `gram`: "triton" (tl.dot tiles, O(N D) memory), "mm" (torch.mm Gram), or None/"auto" (`GRAM`, size rule).
    """
    inv_t, smoothing = _info_nce_args(features, temperature, label_smoothing, "info_nce_loss")
    n, d = features.shape
    return _Contrastive.apply(features, None, False, inv_t, smoothing, bool(rowsum_normalize), _pick_gram(n, d, gram))


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
    *,
    gram: str | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """`info_nce_loss(features, ...)` and one `supcon_loss(features, labels, ...)` per label vector, sharing one Gram
    matrix: one GEMM forward and one backward for all the terms instead of one pair each. On the tiled ("triton") path
    there is no Gram matrix to share and the terms are computed one by one."""
    name = "info_nce_and_supcon"
    inv_t, smoothing = _info_nce_args(features, temperature, label_smoothing, name)
    sup_args = [_supcon_args(features, y, supcon_temperature, base_temperature, name) for y in supcon_labels]
    n, d = features.shape
    path = _pick_gram(n, d, gram)
    rowsum = bool(rowsum_normalize)
    if path != "mm":
        nce = _Contrastive.apply(features, None, False, inv_t, smoothing, rowsum, path)
        return nce, [_Contrastive.apply(features, lab, True, it, r, rowsum, path) for lab, it, r in sup_args]
    g = _Gram.apply(features, launch.compute_dtype(features.dtype))
    nce = _Contrastive.apply(features, None, False, inv_t, smoothing, rowsum, path, g)
    return nce, [_Contrastive.apply(features, lab, True, it, r, rowsum, path, g) for lab, it, r in sup_args]
