"""Fused Triton code head: the labeller's elementwise block, its three regularisers (docs/reference.md §2.3, §3.3-3.5).

`code_head(code_feat, mask_feat, age, code_weight, length_weight)` computes the same `CodeHead` as
`reference.code_head`, forward and backward, with three small kernels:

- forward (`_code_head_fwd_kernel`): program p owns a contiguous run of `tiles_per_prog` row tiles of
  [BLOCK_N, BLOCK_L] (BLOCK_L = next_pow2(L), BLOCK_N * BLOCK_L ~ 2048 elements). It reads each input element once,
  writes the four [N, L] outputs once, and keeps per-column running sums (sum_i z, sum_i (1 - z^2),
  sum_i (m (1 - m))^2, sum_i m) in registers (per element, reduced once at the end). At most `8 x SMs` programs run,
  so for N = 1M, L = 40 each program covers 32 tiles.
- finalize (`_code_head_fwd_finalize_kernel`, one program): sums the programs' partial rows [P, BLOCK_L + 4] in a
  fixed order (a deterministic two-stage reduction: no atomics) and writes the column means (kept for the backward)
  and the three scalar terms. When one program covers the whole batch (small N, e.g. the training shape N = 256) the
  forward kernel finishes the reduction itself and this launch is skipped.
- backward (`_code_head_bwd_kernel`): one tile per program, recomputes z and m from the inputs, folds the grads of
  all seven outputs (absent ones are compile-time switched off, their pointers None) and writes d code_feat and
  d mask_feat once each.

The file reads top to bottom: device math, the three kernels, then the host side (launch sizes, `_forward` and
`_backward`, which launch the kernels, the `autograd.Function` over them) and the checked public `code_head`.

Precision: fp32 arithmetic for fp16/bf16/fp32 inputs, fp64 for fp64 inputs. Outputs come back in the input dtype,
the three scalar terms in the compute dtype (fp32, or fp64 for fp64 inputs). tanh and the sigmoid are written with
`exp(-2|x|)` (no libdevice, so Triton's CPU interpreter runs them), with a short odd Taylor series near 0 so that
tanh keeps full relative precision for the tiny pre-activations of early training (code_raw ~ 1e-6 at epoch 0), and
1 - z^2 and 1 - m are formed without cancellation. `age` and 1/(age + 1) travel as fp32 hi/lo pairs, so fp64 inputs
see them to ~1e-15. No host synchronisation: the scalar upstream grads are read on the device.

There is no gradient for `age`, `code_weight` or `length_weight` (they are schedule constants in InfoSieve).
Timings: benchmarks/bench_kernels.py, results in benchmarks/results/.
"""

from __future__ import annotations

import math
import numbers
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import launch
from .reference import CodeHead, positional_weights

__all__ = [
    "MAX_L",
    "PROGRAMS_PER_SM",
    "SINGLE_PROGRAM_ELEMENTS",
    "TILE_ELEMENTS",
    "CodeHead",
    "code_head",
    "launch_config",
    "make_inputs",
]

MAX_L = 4096  # register tiles hold a whole row; the InfoSieve code length is 40 (the issue asks for up to 256)
TILE_ELEMENTS = 2048  # BLOCK_N * BLOCK_L per tile: the fastest of 2048, 4096 and 8192 in a GPU sweep
SINGLE_PROGRAM_ELEMENTS = 32768  # at most this many (padded) elements: one forward program, no finalize launch
PROGRAMS_PER_SM = 8

# Test and tuning hook: forces tile rows, the program cap, the single-program threshold or the warps (see _override).
# The buffer hook is `launch.new_buffer`.
_TUNING: dict[str, int | None] = {
    "block_n": None,
    "block_p": None,
    "max_programs": None,
    "single_program_elements": None,
    "num_warps": None,
}


@contextmanager
def _override(**tuning):
    """Temporarily force some of `_TUNING`'s launch parameters (tests and tuning runs)."""
    unknown = set(tuning) - set(_TUNING)
    if unknown:
        raise KeyError(f"unknown tuning keys {sorted(unknown)}")
    saved = dict(_TUNING)
    _TUNING.update(tuning)
    try:
        yield
    finally:
        _TUNING.clear()
        _TUNING.update(saved)


# ---------------------------------------------------------------------------------------------------------- device math
@triton.jit
def _tanh_parts(v):
    """(tanh(v), 1 - tanh(v)^2), both accurate: a Taylor series for |v| < 1/16, exp(-2|v|) beyond."""
    a = tl.abs(v)
    t = tl.exp(-2.0 * a)
    one_t = 1.0 + t
    big = (1.0 - t) / one_t
    big_om = 4.0 * t / (one_t * one_t)
    a_s = tl.minimum(a, 0.0625)  # the series is only used below 1/16; clamping keeps the unused lanes finite
    v2 = a_s * a_s
    # tanh(v) = v (1 - v^2/3 + 2v^4/15 - 17v^6/315 + 62v^8/2835 - 1382v^10/155925 + O(v^12)), over the common
    # denominator 155925 so every constant is an exact integer (Triton folds literal expressions into fp32 constants,
    # which would cost fp64 inputs their precision); truncation error < 1e-17 relative for |v| < 1/16
    p = v2 * -1382.0 + 3410.0
    p = v2 * p - 8415.0
    p = v2 * p + 20790.0
    p = v2 * p - 51975.0
    p = v2 * p + 155925.0
    small = a_s * p / 155925.0
    small_mag = a < 0.0625
    r = tl.where(small_mag, small, big)
    om = tl.where(small_mag, 1.0 - small * small, big_om)
    return tl.where(v < 0, -r, r), om


@triton.jit
def _sigmoid2_parts(u):
    """(m, 1 - m) with m = (tanh(u) + 1) / 2 = 1 / (1 + exp(-2u)), both without cancellation or overflow."""
    e = tl.exp(-2.0 * tl.abs(u))
    s = 1.0 / (1.0 + e)  # sigmoid(2|u|) in [1/2, 1]
    r = e * s  # 1 - s
    pos = u >= 0
    return tl.where(pos, s, r), tl.where(pos, r, s)


@triton.jit
def _offsets(rows64, cols, s_n, s_l, L: tl.constexpr, CONTIG: tl.constexpr):
    if CONTIG:
        off = rows64[:, None] * L + cols[None, :]
    else:
        off = rows64[:, None] * s_n + cols[None, :] * s_l
    return off


@triton.jit
def _finish(colsum_z, s_omz2, s_mm, s_len, inv_w, cols, col_ok, N, mean_ptr, cc_ptr, mc_ptr, len_ptr, L: tl.constexpr):
    """Column means (kept for the backward) and the three scalar terms from the batch sums."""
    n = tl.cast(N, colsum_z.dtype)
    colmean = colsum_z / n
    tl.store(mean_ptr + cols, colmean, mask=col_ok)
    code_cond = s_omz2 / (n * L) + tl.sum(colmean * colmean, axis=0) / L
    tl.store(cc_ptr, code_cond)
    tl.store(mc_ptr, s_mm / (n * L))
    tl.store(len_ptr, s_len / tl.sum(inv_w, axis=0))


@triton.jit
def _inverse_weights(lw_ptr, cols, col_ok, CT: tl.constexpr):
    """1 / length_weight on the code's columns, 0 on the padding."""
    lw = tl.load(lw_ptr + cols, mask=col_ok, other=1.0).to(CT)
    return tl.where(col_ok, 1.0 / lw, 0.0)


@triton.jit
def _prologue(age_hi, age_lo, c_hi, c_lo, w_ptr, lw_ptr, L: tl.constexpr, BLOCK_L: tl.constexpr, CT: tl.constexpr):
    """age and 1/(age+1) rebuilt from their fp32 hi/lo halves, the column indices and the weights."""
    age = tl.cast(age_hi, CT) + tl.cast(age_lo, CT)
    shift = tl.cast(c_hi, CT) + tl.cast(c_lo, CT)
    cols = tl.arange(0, BLOCK_L)
    col_ok = cols < L
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(CT)
    return age, shift, cols, col_ok, w, _inverse_weights(lw_ptr, cols, col_ok, CT)


@triton.jit
def _code_head_fwd_kernel(
    # input pointers and their strides (row n, column l)
    x_ptr,  # code_feat [N, L]
    y_ptr,  # mask_feat [N, L]
    sx_n,
    sx_l,
    sy_n,
    sy_l,
    w_ptr,  # code_weight [L]
    lw_ptr,  # length_weight [L]
    # output pointers: the four [N, L] outputs (contiguous, input dtype), then the compute-dtype reductions
    raw_ptr,  # code_raw
    mask_ptr,
    code_ptr,
    trunc_ptr,  # trunc_code
    part_ptr,  # per-program partial sums [P, BLOCK_L + 4] (column sums of z, then three scalars); None when FINAL
    mean_ptr,  # column means of z [L], kept for the backward
    cc_ptr,  # code_cond
    mc_ptr,  # mask_cond
    len_ptr,  # length
    # sizes
    N,
    tiles_per_prog,  # row tiles each program walks
    # scalars: age and c = 1/(age + 1), each an fp32 hi + lo pair (launch.fp32_pair)
    age_hi,
    age_lo,
    c_hi,
    c_lo,
    # meta-parameters
    L: tl.constexpr,  # code length
    BLOCK_N: tl.constexpr,  # rows per tile
    BLOCK_L: tl.constexpr,  # next_pow2(L)
    X_CONTIG: tl.constexpr,  # x is row-major contiguous: index without its strides
    Y_CONTIG: tl.constexpr,
    FINAL: tl.constexpr,  # one program covers the batch: it finishes the reduction itself
):
    CT: tl.constexpr = mean_ptr.dtype.element_ty  # compute dtype: fp32, or fp64 for fp64 inputs
    OT: tl.constexpr = raw_ptr.dtype.element_ty  # output dtype = input dtype
    pid = tl.program_id(0)
    age, shift, cols, col_ok, w, inv_w = _prologue(age_hi, age_lo, c_hi, c_lo, w_ptr, lw_ptr, L, BLOCK_L, CT)

    # running sums kept per element and reduced once at the end: no cross-warp reduction inside the loop
    acc_z = tl.zeros([BLOCK_N, BLOCK_L], dtype=CT)
    acc_omz2 = tl.zeros([BLOCK_N, BLOCK_L], dtype=CT)
    acc_mm = tl.zeros([BLOCK_N, BLOCK_L], dtype=CT)
    acc_len = tl.zeros([BLOCK_N, BLOCK_L], dtype=CT)
    first_row = pid.to(tl.int64) * tiles_per_prog * BLOCK_N
    for t in range(0, tiles_per_prog):
        rows = first_row + t * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (rows < N)[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + _offsets(rows, cols, sx_n, sx_l, L, X_CONTIG), mask=ok, other=0.0).to(CT)
        y = tl.load(y_ptr + _offsets(rows, cols, sy_n, sy_l, L, Y_CONTIG), mask=ok, other=0.0).to(CT)
        z, omz2 = _tanh_parts(age * x)
        m, om = _sigmoid2_parts(y + shift)
        code = z * w[None, :]
        trunc = m * code
        out = rows[:, None] * L + cols[None, :]
        tl.store(raw_ptr + out, z.to(OT), mask=ok)
        tl.store(mask_ptr + out, m.to(OT), mask=ok)
        tl.store(code_ptr + out, code.to(OT), mask=ok)
        tl.store(trunc_ptr + out, trunc.to(OT), mask=ok)
        q = m * om
        acc_z += tl.where(ok, z, 0.0)
        acc_omz2 += tl.where(ok, omz2, 0.0)
        acc_mm += tl.where(ok, q * q, 0.0)
        acc_len += tl.where(ok, m * inv_w[None, :], 0.0)

    colsum_z = tl.sum(acc_z, axis=0)
    s_omz2 = tl.sum(tl.sum(acc_omz2, axis=1), axis=0)
    s_mm = tl.sum(tl.sum(acc_mm, axis=1), axis=0)
    s_len = tl.sum(tl.sum(acc_len, axis=1), axis=0)
    if FINAL:
        _finish(colsum_z, s_omz2, s_mm, s_len, inv_w, cols, col_ok, N, mean_ptr, cc_ptr, mc_ptr, len_ptr, L)
    else:
        row = part_ptr + pid.to(tl.int64) * (BLOCK_L + 4)
        tl.store(row + cols, colsum_z)
        tl.store(row + BLOCK_L, s_omz2)
        tl.store(row + BLOCK_L + 1, s_mm)
        tl.store(row + BLOCK_L + 2, s_len)


@triton.jit
def _code_head_fwd_finalize_kernel(
    # pointers (as in _code_head_fwd_kernel): the partial sums and length_weight in, the reductions out
    part_ptr,
    lw_ptr,
    mean_ptr,
    cc_ptr,
    mc_ptr,
    len_ptr,
    # sizes
    N,
    P,  # forward programs (rows of part)
    # meta-parameters
    L: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,  # partial rows summed per loop step
):
    CT: tl.constexpr = mean_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_L)
    col_ok = cols < L
    inv_w = _inverse_weights(lw_ptr, cols, col_ok, CT)
    acc_z = tl.zeros([BLOCK_P, BLOCK_L], dtype=CT)
    acc_omz2 = tl.zeros([BLOCK_P], dtype=CT)
    acc_mm = tl.zeros([BLOCK_P], dtype=CT)
    acc_len = tl.zeros([BLOCK_P], dtype=CT)
    for start in range(0, P, BLOCK_P):
        prog = start + tl.arange(0, BLOCK_P)
        p_ok = prog < P
        row = part_ptr + prog.to(tl.int64) * (BLOCK_L + 4)
        acc_z += tl.load(row[:, None] + cols[None, :], mask=p_ok[:, None], other=0.0)
        acc_omz2 += tl.load(row + BLOCK_L, mask=p_ok, other=0.0)
        acc_mm += tl.load(row + BLOCK_L + 1, mask=p_ok, other=0.0)
        acc_len += tl.load(row + BLOCK_L + 2, mask=p_ok, other=0.0)
    colsum_z = tl.sum(acc_z, axis=0)
    s_omz2 = tl.sum(acc_omz2, axis=0)
    s_mm = tl.sum(acc_mm, axis=0)
    s_len = tl.sum(acc_len, axis=0)
    _finish(colsum_z, s_omz2, s_mm, s_len, inv_w, cols, col_ok, N, mean_ptr, cc_ptr, mc_ptr, len_ptr, L)


@triton.jit
def _code_head_bwd_kernel(
    # input pointers and strides, and the column means: as in _code_head_fwd_kernel
    x_ptr,
    y_ptr,
    sx_n,
    sx_l,
    sy_n,
    sy_l,
    w_ptr,
    lw_ptr,
    mean_ptr,
    # upstream gradients of the four [N, L] outputs with their strides (row n, column l), then of the three scalars;
    # an absent one (HAS_* False) is None, its strides too
    g_raw_ptr,
    sgr_n,
    sgr_l,
    g_mask_ptr,
    sgm_n,
    sgm_l,
    g_code_ptr,
    sgc_n,
    sgc_l,
    g_trunc_ptr,
    sgt_n,
    sgt_l,
    g_cc_ptr,
    g_mc_ptr,
    g_len_ptr,
    # output pointers: d code_feat, d mask_feat [N, L] (contiguous); None when not wanted (NEED_* False)
    dx_ptr,
    dy_ptr,
    # size and scalars: as in _code_head_fwd_kernel
    N,
    age_hi,
    age_lo,
    c_hi,
    c_lo,
    # meta-parameters: as in _code_head_fwd_kernel, plus the *_CONTIG flags of the gradients, which gradients are
    # present (HAS_*), and which input gradients are wanted (NEED_*)
    L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    X_CONTIG: tl.constexpr,
    Y_CONTIG: tl.constexpr,
    GR_CONTIG: tl.constexpr,
    GM_CONTIG: tl.constexpr,
    GC_CONTIG: tl.constexpr,
    GT_CONTIG: tl.constexpr,
    HAS_RAW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_CODE: tl.constexpr,
    HAS_TRUNC: tl.constexpr,
    HAS_CC: tl.constexpr,
    HAS_MC: tl.constexpr,
    HAS_LEN: tl.constexpr,
    NEED_DX: tl.constexpr,
    NEED_DY: tl.constexpr,
):
    CT: tl.constexpr = mean_ptr.dtype.element_ty
    pid = tl.program_id(0)
    age, shift, cols, col_ok, w, inv_w = _prologue(age_hi, age_lo, c_hi, c_lo, w_ptr, lw_ptr, L, BLOCK_L, CT)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < N)[:, None] & col_ok[None, :]
    nl = tl.cast(N, CT) * L

    # z = code_raw is needed for d code_feat, and for d mask_feat through trunc_code; m likewise the other way round
    if NEED_DX or HAS_TRUNC:
        x = tl.load(x_ptr + _offsets(rows, cols, sx_n, sx_l, L, X_CONTIG), mask=ok, other=0.0).to(CT)
    else:
        x = tl.zeros([BLOCK_N, BLOCK_L], dtype=CT)
    if NEED_DY or HAS_TRUNC:
        y = tl.load(y_ptr + _offsets(rows, cols, sy_n, sy_l, L, Y_CONTIG), mask=ok, other=0.0).to(CT)
    else:
        y = tl.zeros([BLOCK_N, BLOCK_L], dtype=CT)
    z, omz2 = _tanh_parts(age * x)
    m, om = _sigmoid2_parts(y + shift)
    if HAS_TRUNC:
        g_trunc = tl.load(g_trunc_ptr + _offsets(rows, cols, sgt_n, sgt_l, L, GT_CONTIG), mask=ok, other=0.0).to(CT)
    else:
        g_trunc = tl.zeros([BLOCK_N, BLOCK_L], dtype=CT)

    if NEED_DX:
        dz = tl.zeros([BLOCK_N, BLOCK_L], dtype=CT)
        if HAS_RAW:
            dz += tl.load(g_raw_ptr + _offsets(rows, cols, sgr_n, sgr_l, L, GR_CONTIG), mask=ok, other=0.0).to(CT)
        if HAS_CODE:
            g_code = tl.load(g_code_ptr + _offsets(rows, cols, sgc_n, sgc_l, L, GC_CONTIG), mask=ok, other=0.0)
            dz += g_code.to(CT) * w[None, :]
        if HAS_TRUNC:
            dz += g_trunc * m * w[None, :]
        if HAS_CC:
            # d/dz_ik [mean(1 - z^2) + mean_k(mean_i z_ik)^2] = 2 (mean_i z_ik - z_ik) / (N L)
            colmean = tl.load(mean_ptr + cols, mask=col_ok, other=0.0)
            g_cc = tl.load(g_cc_ptr).to(CT)
            dz += (g_cc * 2.0 / nl) * (colmean[None, :] - z)
        dx = dz * (age * omz2)
        tl.store(dx_ptr + rows[:, None] * L + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)

    if NEED_DY:
        dm = tl.zeros([BLOCK_N, BLOCK_L], dtype=CT)
        if HAS_MASK:
            dm += tl.load(g_mask_ptr + _offsets(rows, cols, sgm_n, sgm_l, L, GM_CONTIG), mask=ok, other=0.0).to(CT)
        if HAS_TRUNC:
            dm += g_trunc * z * w[None, :]
        if HAS_MC:
            # d/dm (m (1 - m))^2 / (N L) = 2 m (1 - m) (1 - 2m) / (N L)
            g_mc = tl.load(g_mc_ptr).to(CT)
            dm += (g_mc * 2.0 / nl) * (m * om) * (om - m)
        if HAS_LEN:
            g_len = tl.load(g_len_ptr).to(CT)
            dm += (g_len / tl.sum(inv_w, axis=0)) * inv_w[None, :]
        dy = dm * (2.0 * m * om)  # d m / d mask_feat = (1 - tanh^2) / 2 = 2 m (1 - m)
        tl.store(dy_ptr + rows[:, None] * L + cols[None, :], dy.to(dy_ptr.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------------------------ host side
_SM_COUNT: dict[int, int] = {}


def _max_programs(device: torch.device) -> int:
    if _TUNING["max_programs"] is not None:
        return int(_TUNING["max_programs"])
    if device.type != "cuda":
        return 16  # the interpreter runs programs one after another: few, large ones are fastest
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return PROGRAMS_PER_SM * _SM_COUNT[index]


def launch_config(n: int, length: int, device: torch.device | str = "cuda") -> dict[str, int]:
    """Block sizes and grids the kernels use for an [n, length] batch (for benchmarks and tests)."""
    device = torch.device(device)
    key = (n, length, str(device), TILE_ELEMENTS, SINGLE_PROGRAM_ELEMENTS, PROGRAMS_PER_SM, *_TUNING.values())
    if key not in _CONFIGS:
        if len(_CONFIGS) > 4096:
            _CONFIGS.clear()
        _CONFIGS[key] = _launch_config(n, length, device)
    return dict(_CONFIGS[key])


_CONFIGS: dict[tuple, dict[str, int]] = {}


def _launch_config(n: int, length: int, device: torch.device) -> dict[str, int]:
    block_l = triton.next_power_of_2(length)
    block_n = _TUNING["block_n"] or min(triton.next_power_of_2(n), max(1, TILE_ELEMENTS // block_l))
    tiles = triton.cdiv(n, block_n)
    single = _TUNING["single_program_elements"] or SINGLE_PROGRAM_ELEMENTS
    programs = 1 if tiles * block_n * block_l <= single else min(tiles, _max_programs(device))
    tiles_per_prog = triton.cdiv(tiles, programs)
    programs = triton.cdiv(tiles, tiles_per_prog)
    return {
        "block_n": block_n,
        "block_l": block_l,
        "tiles": tiles,
        "fwd_programs": programs,
        "tiles_per_prog": tiles_per_prog,
        "finalize": int(programs > 1),
        "block_p": _TUNING["block_p"] or max(1, min(triton.next_power_of_2(programs), TILE_ELEMENTS // block_l)),
        "bwd_programs": tiles,
        "num_warps": _TUNING["num_warps"]
        or (4 if block_n * block_l >= 1024 else (2 if block_n * block_l >= 256 else 1)),
    }


def _scalars(age: float) -> dict[str, float]:
    """The kernels' scalar arguments: age and c = 1/(age + 1), each an fp32 hi/lo pair."""
    age_hi, age_lo = launch.fp32_pair(age)
    c_hi, c_lo = launch.fp32_pair(1.0 / (age + 1.0))
    return dict(age_hi=age_hi, age_lo=age_lo, c_hi=c_hi, c_lo=c_lo)


def _contig(t: Tensor | None) -> bool:
    """Row-major contiguous [N, L] (the kernels then index it without its strides); False for an absent gradient."""
    return t is not None and t.stride(1) == 1 and (t.stride(0) == t.shape[1] or t.shape[0] == 1)


def _stride(t: Tensor | None, dim: int) -> int | None:
    return None if t is None else t.stride(dim)


def _tile_args(cfg: dict, x: Tensor, y: Tensor, w: Tensor, lw: Tensor) -> dict:
    """The arguments the forward and backward row-tile launches take alike: the inputs with their strides, and the
    compile-time code length, tile shape, whether the code and mask logits are contiguous (then their strides are
    constant), and the warps."""
    return dict(
        x_ptr=x,
        y_ptr=y,
        sx_n=x.stride(0),
        sx_l=x.stride(1),
        sy_n=y.stride(0),
        sy_l=y.stride(1),
        w_ptr=w.contiguous(),
        lw_ptr=lw.contiguous(),
        L=x.shape[1],
        BLOCK_N=cfg["block_n"],
        BLOCK_L=cfg["block_l"],
        X_CONTIG=_contig(x),
        Y_CONTIG=_contig(y),
        num_warps=cfg["num_warps"],
    )


def _forward(x: Tensor, y: Tensor, age: float, w: Tensor, lw: Tensor) -> tuple[CodeHead, Tensor]:
    """The seven outputs and the column means of z (kept for the backward): one forward launch, and a finalize
    launch when several programs share the batch."""
    n, length = x.shape
    ct = launch.compute_dtype(x.dtype)
    cfg = launch_config(n, length, x.device)
    raw, mask, code, trunc = (launch.new_buffer((n, length), dtype=x.dtype, device=x.device) for _ in range(4))
    colmean = launch.new_buffer((length,), dtype=ct, device=x.device)
    cc, mc, ln = (launch.new_buffer((), dtype=ct, device=x.device) for _ in range(3))
    programs, final = cfg["fwd_programs"], cfg["finalize"] == 0
    part = None if final else launch.new_buffer((programs, cfg["block_l"] + 4), dtype=ct, device=x.device)
    _code_head_fwd_kernel[(programs,)](
        **_tile_args(cfg, x, y, w, lw),
        raw_ptr=raw,
        mask_ptr=mask,
        code_ptr=code,
        trunc_ptr=trunc,
        part_ptr=part,
        mean_ptr=colmean,
        cc_ptr=cc,
        mc_ptr=mc,
        len_ptr=ln,
        N=n,
        tiles_per_prog=cfg["tiles_per_prog"],
        **_scalars(age),
        FINAL=final,
    )
    if not final:
        _code_head_fwd_finalize_kernel[(1,)](
            part_ptr=part,
            lw_ptr=lw.contiguous(),
            mean_ptr=colmean,
            cc_ptr=cc,
            mc_ptr=mc,
            len_ptr=ln,
            N=n,
            P=programs,
            L=length,
            BLOCK_L=cfg["block_l"],
            BLOCK_P=cfg["block_p"],
            num_warps=4,
        )
    return CodeHead(raw, mask, code, trunc, cc, mc, ln), colmean


def _backward(x, y, age, w, lw, colmean, grads, need_dx, need_dy) -> tuple[Tensor | None, Tensor | None]:
    """(d code_feat, d mask_feat) from the upstream `grads` of the seven outputs (None where an output got none): one
    launch, one tile per program; an input gradient nothing flows into is None."""
    g_raw, g_mask, g_code, g_trunc, g_cc, g_mc, g_len = grads
    need_dx = need_dx and any(g is not None for g in (g_raw, g_code, g_trunc, g_cc))
    need_dy = need_dy and any(g is not None for g in (g_mask, g_trunc, g_mc, g_len))
    if not (need_dx or need_dy):
        return None, None
    n, length = x.shape
    cfg = launch_config(n, length, x.device)
    dx = launch.new_buffer((n, length), dtype=x.dtype, device=x.device) if need_dx else None
    dy = launch.new_buffer((n, length), dtype=y.dtype, device=y.device) if need_dy else None
    _code_head_bwd_kernel[(cfg["bwd_programs"],)](
        **_tile_args(cfg, x, y, w, lw),
        mean_ptr=colmean,
        g_raw_ptr=g_raw,
        sgr_n=_stride(g_raw, 0),
        sgr_l=_stride(g_raw, 1),
        g_mask_ptr=g_mask,
        sgm_n=_stride(g_mask, 0),
        sgm_l=_stride(g_mask, 1),
        g_code_ptr=g_code,
        sgc_n=_stride(g_code, 0),
        sgc_l=_stride(g_code, 1),
        g_trunc_ptr=g_trunc,
        sgt_n=_stride(g_trunc, 0),
        sgt_l=_stride(g_trunc, 1),
        g_cc_ptr=None if g_cc is None else g_cc.reshape(()),
        g_mc_ptr=None if g_mc is None else g_mc.reshape(()),
        g_len_ptr=None if g_len is None else g_len.reshape(()),
        dx_ptr=dx,
        dy_ptr=dy,
        N=n,
        **_scalars(age),
        GR_CONTIG=_contig(g_raw),
        GM_CONTIG=_contig(g_mask),
        GC_CONTIG=_contig(g_code),
        GT_CONTIG=_contig(g_trunc),
        HAS_RAW=g_raw is not None,
        HAS_MASK=g_mask is not None,
        HAS_CODE=g_code is not None,
        HAS_TRUNC=g_trunc is not None,
        HAS_CC=g_cc is not None,
        HAS_MC=g_mc is not None,
        HAS_LEN=g_len is not None,
        NEED_DX=need_dx,
        NEED_DY=need_dy,
    )
    return dx, dy


class _CodeHeadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, code_feat, mask_feat, age, code_weight, length_weight):
        out, colmean = _forward(code_feat, mask_feat, age, code_weight, length_weight)
        ctx.save_for_backward(code_feat, mask_feat, code_weight, length_weight, colmean)
        ctx.age = age
        ctx.set_materialize_grads(False)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        x, y, w, lw, colmean = ctx.saved_tensors
        dx, dy = _backward(x, y, ctx.age, w, lw, colmean, grads, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dy, None, None, None


# --------------------------------------------------------------------------------------------------------------- public
def _check(code_feat, mask_feat, age, code_weight, length_weight) -> float:
    """The checked `age` as a float; a one-line error naming the first bad argument."""
    launch.check_float_matrix(code_feat, "code_head", "code_feat", "[N, L]")
    launch.check_float_matrix(mask_feat, "code_head", "mask_feat", "[N, L]")
    if code_feat.shape != mask_feat.shape:
        raise ValueError(
            f"code_head: code_feat {tuple(code_feat.shape)} and mask_feat {tuple(mask_feat.shape)} "
            "must have the same shape"
        )
    if code_feat.dtype != mask_feat.dtype:
        raise TypeError(
            f"code_head: code_feat ({code_feat.dtype}) and mask_feat ({mask_feat.dtype}) must share a dtype"
        )
    n, length = code_feat.shape
    if n < 1 or length < 1:
        raise ValueError(f"code_head: needs at least one row and one column, got shape {tuple(code_feat.shape)}")
    if length > MAX_L:
        raise ValueError(f"code_head: L = {length} is above the supported {MAX_L}")
    for name, t in (("code_weight", code_weight), ("length_weight", length_weight)):
        if not isinstance(t, Tensor):
            raise TypeError(f"code_head: {name} must be a torch.Tensor of shape [{length}], got {type(t).__name__}")
        if t.shape != (length,):
            raise ValueError(f"code_head: {name} must have shape [{length}] (one weight per bit), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"code_head: {name} must be a floating-point tensor, got {t.dtype}")
    devices = {t.device for t in (code_feat, mask_feat, code_weight, length_weight)}
    if len(devices) != 1:
        raise ValueError(f"code_head: all tensors must be on one device, got {sorted(map(str, devices))}")
    launch.check_device(code_feat, "code_head")
    if isinstance(age, Tensor):
        if age.numel() != 1:
            raise ValueError(f"code_head: age must be a number, got a tensor of shape {tuple(age.shape)}")
        age = age.item()
    if not isinstance(age, numbers.Real) or isinstance(age, bool):
        raise TypeError(f"code_head: age must be a real number, got {type(age).__name__}")
    age = float(age)
    if not math.isfinite(age) or age == -1.0:
        raise ValueError(f"code_head: age must be finite and not -1 (1/(age+1) is used), got {age}")
    return age


def code_head(code_feat: Tensor, mask_feat: Tensor, age: float, code_weight: Tensor, length_weight: Tensor) -> CodeHead:
    """Fused Triton version of `reference.code_head` (same outputs; see the module docstring).

    `code_feat`, `mask_feat`: [N, L] pre-activations (fp16/bf16/fp32/fp64, same dtype and device, any strides).
    `age`: Python float. `code_weight`, `length_weight`: [L] floating tensors (no gradient flows into them).
    """
    age = _check(code_feat, mask_feat, age, code_weight, length_weight)
    return CodeHead(*_CodeHeadFunction.apply(code_feat, mask_feat, age, code_weight, length_weight))


def make_inputs(
    n: int,
    length: int = 40,
    *,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.float32,
    age: float = 1.0,
    base: float = 1.3,
    length_base: float = 2.0,
    scale: float = 1.0,
    requires_grad: bool = True,
    generator: torch.Generator | None = None,
):
    """Random (code_feat, mask_feat, age, code_weight, length_weight) for benchmarks and tests."""
    x = torch.randn(n, length, generator=generator, dtype=torch.float64) * scale
    y = torch.randn(n, length, generator=generator, dtype=torch.float64) * scale
    x, y = (t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in (x, y))
    w = positional_weights(length, base, device=device)
    lw = positional_weights(length, length_base, device=device)
    return x, y, age, w, lw
