"""Fused Triton code head (`kernels/code_head_triton.py`) against the PyTorch oracle `kernels.reference.code_head`.

On the CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), on a GPU compiled; the same
tests run on both. Every buffer the kernels write is allocated NaN-filled (autouse fixture), so an element a kernel
forgot to write fails the comparison. Each test seeds torch from `SEED` (0, or INFOSIEVE_TEST_SEED) and its name, so
its inputs are the same every run; the seed is in each failure message.
"""

from __future__ import annotations

import inspect
import math
import os

import pytest
import torch

import infosieve_kernels as kernels
from infosieve_kernels import code_head_triton as CH
from infosieve_kernels import launch, reference

SEED = int(os.environ.get("INFOSIEVE_TEST_SEED", "0"))

ON_CUDA = torch.cuda.is_available()
OUTPUTS = reference.CodeHead._fields
TENSOR_OUTPUTS = OUTPUTS[:4]
SCALAR_OUTPUTS = OUTPUTS[4:]

# (rtol, atol) per compute dtype; atol is relative to the largest |expected| of the compared tensor (at least 1)
TOL = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-4, 1e-5) if ON_CUDA else (2e-5, 2e-6),
    torch.float16: (1e-2, 2e-3),
    torch.bfloat16: (5e-2, 1e-2),
}

# small tiles and few programs: several tiles per program, ragged last tile and program, and the finalize kernel
# looping over the programs' partial sums in two chunks, the last one ragged
SMALL_TILES = {"block_n": 4, "block_p": 2, "max_programs": 3, "single_program_elements": 1}


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every buffer the kernels write starts as NaN; returns the list of allocated shapes."""
    shapes = []

    def nan_buffer(size, dtype, device):
        shapes.append(tuple(size))
        return torch.full(size, math.nan, dtype=dtype, device=device)

    monkeypatch.setattr(launch, "new_buffer", nan_buffer)
    return shapes


@pytest.fixture(autouse=True)
def seeded(request):
    torch.manual_seed(SEED + sum(map(ord, request.node.name)))


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _inputs(n, length, dtype, device, *, age=1.0, base=1.3, length_base=2.0, scale=1.0, seed=None):
    g = torch.Generator().manual_seed(_seed() if seed is None else seed)
    return CH.make_inputs(
        n, length, device=device, dtype=dtype, age=age, base=base, length_base=length_base, scale=scale, generator=g
    )


def _upstream(n, length, dtype, device, lw, which=OUTPUTS):
    """Random grads for the tensor outputs; the scalar terms weighted so that their per-element grads are O(1)."""
    inv_w = 1.0 / lw.double()
    scalar_scale = {"code_cond": n * length, "mask_cond": 16.0 * n * length, "length": float(inv_w.sum() / inv_w.max())}
    grads = {}
    for name in which:
        if name in TENSOR_OUTPUTS:
            grads[name] = torch.randn(n, length, dtype=torch.float64).to(device=device, dtype=dtype)
        else:
            grads[name] = float(torch.randn(()) * scalar_scale[name])
    return grads


def _run(fn, x, y, age, w, lw, grads, cast=None):
    """Outputs and (d code_feat, d mask_feat) of sum_j <out_j, g_j>; `cast` re-types the inputs first (reference)."""
    xi = x.detach().to(cast or x.dtype).requires_grad_(x.requires_grad)
    yi = y.detach().to(cast or y.dtype).requires_grad_(y.requires_grad)
    wi, lwi = (w, lw) if cast is None else (w.to(cast), lw.to(cast))
    out = fn(xi, yi, age, wi, lwi)
    loss = 0.0
    for name, g in grads.items():
        o = getattr(out, name)
        loss = loss + ((o * g.to(o.dtype)).sum() if isinstance(g, torch.Tensor) else o * g)
    wrt = [t for t in (xi, yi) if t.requires_grad]
    dx = dy = None
    if wrt and grads:
        got = iter(torch.autograd.grad(loss, wrt, allow_unused=True))
        dx = next(got) if xi.requires_grad else None
        dy = next(got) if yi.requires_grad else None
    return out, dx, dy


def _close(actual, expected, dtype, what, seed):
    rtol, atol = TOL[dtype]
    assert actual is not None and expected is not None, what
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values (unwritten element?) [seed {seed}]"
    scale = max(1.0, float(e.abs().max())) if e.numel() else 1.0
    err = (a - e).abs() - rtol * e.abs()
    worst = float(err.max())
    assert worst <= atol * scale, f"{what}: max excess error {worst:.3g} > {atol * scale:.3g} [seed {seed}]"


def _check_against_reference(n, length, dtype, device, *, age, length_base, base=1.3, which=OUTPUTS, fn=None, **kw):
    seed = _seed()
    x, y, age, w, lw = _inputs(n, length, dtype, device, age=age, base=base, length_base=length_base, seed=seed, **kw)
    grads = _upstream(n, length, dtype, device, lw, which)
    out, dx, dy = _run(fn or CH.code_head, x, y, age, w, lw, grads)
    ref, rdx, rdy = _run(reference.code_head, x, y, age, w, lw, grads, cast=torch.float64)
    scalar_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for name in OUTPUTS:
        got = getattr(out, name)
        want_dtype = dtype if name in TENSOR_OUTPUTS else scalar_dtype
        assert got.dtype == want_dtype, f"{name}: dtype {got.dtype}, expected {want_dtype}"
        assert got.device == x.device
        _close(got, getattr(ref, name), dtype, f"{name} [{n}x{length} {dtype} age={age}]", seed)
    if dx is not None or rdx is not None:
        _close(dx, rdx, dtype, f"d code_feat [{n}x{length} {dtype} age={age} {sorted(grads)}]", seed)
    if dy is not None or rdy is not None:
        _close(dy, rdy, dtype, f"d mask_feat [{n}x{length} {dtype} age={age} {sorted(grads)}]", seed)
    return out


# (N, L, age, length base, tuning): ragged N and L, ages 0.1 / 1 / 20, stale base-2 and current-base length weights
CASES = [
    (1, 1, 0.1, 2.0, None),
    (2, 7, 1.0, 1.3, None),
    (37, 40, 20.0, 2.0, None),
    (37, 40, 0.1, 1.3, SMALL_TILES),
    (300, 40, 1.0, 2.0, None),
    (300, 40, 20.0, 1.3, SMALL_TILES),
    (37, 130, 1.0, 1.5, None),  # 2^129 overflows fp32, so no base 2 at L = 130
    (13, 130, 0.1, 1.3, SMALL_TILES),
]


@pytest.mark.gpu_parity
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("n,length,age,length_base,tuning", CASES)
def test_values_and_grads_match_reference(device, dtype, n, length, age, length_base, tuning):
    with CH._override(**(tuning or {})):
        _check_against_reference(n, length, dtype, device, age=age, length_base=length_base)


@pytest.mark.gpu_parity
@pytest.mark.parametrize("n,length,age,length_base", [(37, 40, 1.0, 2.0), (300, 7, 20.0, 1.3), (5, 130, 0.1, 1.5)])
def test_half_precision(device, n, length, age, length_base):
    _check_against_reference(n, length, torch.float16, device, age=age, length_base=length_base)


@pytest.mark.gpu_parity
@pytest.mark.skipif(not ON_CUDA, reason="bf16 arithmetic is wrong in Triton's CPU interpreter")
@pytest.mark.parametrize("n,length", [(37, 40), (300, 130)])
def test_bfloat16_on_cuda(device, n, length):
    _check_against_reference(n, length, torch.bfloat16, device, age=1.0, length_base=2.0 if length < 100 else 1.5)


@pytest.mark.parametrize("which", [(name,) for name in OUTPUTS] + [("code_raw", "mask_cond"), ("trunc_code",)])
def test_each_output_gradient_alone(device, which):
    """Each output's gradient path on its own (absent grads are switched off at compile time)."""
    _check_against_reference(23, 40, torch.float64, device, age=1.0, length_base=2.0, which=which)


def test_dispatch_triton_backend(device):
    """`kernels.code_head(..., backend="triton")`, called twice: the dispatch stays a function after it imports the
    Triton module."""
    for _ in range(2):
        _check_against_reference(
            37,
            40,
            torch.float64,
            device,
            age=0.1,
            length_base=1.3,
            fn=lambda *a: kernels.code_head(*a, backend="triton"),
        )
    assert inspect.isfunction(kernels.code_head)
    x, y, age, w, lw = _inputs(3, 5, torch.float64, device)
    assert torch.equal(
        kernels.code_head(x, y, age, w, lw, backend="torch").code, reference.code_head(x, y, age, w, lw).code
    )


def test_only_one_input_requires_grad(device):
    seed = _seed()
    x, y, age, w, lw = _inputs(19, 40, torch.float64, device, seed=seed)
    grads = _upstream(19, 40, torch.float64, device, lw)
    for x_grad in (True, False):
        xi, yi = x.detach().requires_grad_(x_grad), y.detach().requires_grad_(not x_grad)
        _, dx, dy = _run(CH.code_head, xi, yi, age, w, lw, grads)
        _, rdx, rdy = _run(reference.code_head, xi, yi, age, w, lw, grads)
        assert (dx is None) == (rdx is None) and (dy is None) == (rdy is None)
        _close(dx if x_grad else dy, rdx if x_grad else rdy, torch.float64, "single input grad", seed)


def test_strided_inputs_and_expanded_grads(device):
    """Non-contiguous inputs and zero-stride upstream grads (what `out.code.sum().backward()` produces)."""
    seed = _seed()
    torch.manual_seed(seed)
    n, length = 29, 40
    x_base = torch.randn(n, 2 * length, dtype=torch.float64, device=device)
    y_base = torch.randn(length, n, dtype=torch.float64, device=device)
    w = reference.positional_weights(length, 1.3, device=device)
    lw = reference.positional_weights(length, 2.0, device=device)
    results = []
    for fn in (CH.code_head, reference.code_head):
        x = x_base[:, ::2].detach().requires_grad_()  # column stride 2
        y = y_base.t().detach().requires_grad_()  # column-major
        out = fn(x, y, 20.0, w, lw)
        loss = out.code.sum() + (out.trunc_code * 0.5).sum() + out.mask.mean() + 3.0 * out.code_cond + out.length
        results.append((out, *torch.autograd.grad(loss, (x, y))))
    (out, dx, dy), (ref, rdx, rdy) = results
    for name in OUTPUTS:
        _close(getattr(out, name), getattr(ref, name), torch.float64, name, seed)
    _close(dx, rdx, torch.float64, "d code_feat", seed)
    _close(dy, rdy, torch.float64, "d mask_feat", seed)


def test_tiny_and_huge_preactivations_keep_precision(device):
    """Early training has code_feat ~ 3e-5 (code_raw ~ 1e-6): tanh must keep its relative precision there."""
    seed = _seed()
    for dtype in (torch.float32, torch.float64):
        x, y, _, w, lw = _inputs(37, 40, dtype, device, scale=3e-5, seed=seed)
        out = CH.code_head(x, y, 0.1, w, lw)
        ref = reference.code_head(x.double(), y.double(), 0.1, w.double(), lw.double())
        rel = ((out.code_raw.double() - ref.code_raw) / ref.code_raw).abs().max()
        assert rel < (1e-6 if dtype == torch.float32 else 1e-13), f"{dtype}: relative error {rel:.3g} [seed {seed}]"
        # across the series / exp switch at |age x| = 1/16
        grid = torch.linspace(-0.2, 0.2, 37 * 40, dtype=torch.float64).reshape(37, 40)
        x = (grid + 1e-3 * torch.rand(37, 40, dtype=torch.float64)).to(device=device, dtype=dtype)
        got = CH.code_head(x, x, 1.0, w, lw).code_raw.double()
        want = torch.tanh(x.double())
        rel = ((got - want) / want).abs().max()
        limit = {torch.float64: 1e-14, torch.float32: 4e-6 if ON_CUDA else 1e-6}[dtype]
        assert rel < limit, f"{dtype}: tanh relative error {rel:.3g} near the switch [seed {seed}]"
        x, y, _, w, lw = _inputs(37, 40, dtype, device, scale=1e3, seed=seed)
        out = CH.code_head(x, y, 20.0, w, lw)
        for name in OUTPUTS:
            assert torch.isfinite(getattr(out, name)).all(), name


@pytest.mark.gpu_parity
def test_no_grad_and_deterministic(device):
    x, y, age, w, lw = _inputs(300, 40, torch.float32, device)
    with CH._override(**SMALL_TILES), torch.no_grad():
        a, b = CH.code_head(x, y, age, w, lw), CH.code_head(x, y, age, w, lw)
    for name in OUTPUTS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert not getattr(a, name).requires_grad


def test_every_written_buffer_is_poisoned(device, poisoned_buffers):
    """The NaN allocator really backs the outputs (so the value tests catch unwritten elements)."""
    x, y, age, w, lw = _inputs(37, 40, torch.float32, device)
    with CH._override(**SMALL_TILES):
        out = CH.code_head(x, y, age, w, lw)
        out.trunc_code.sum().backward()
        cfg = CH.launch_config(37, 40, x.device)
    assert poisoned_buffers.count((37, 40)) == 4 + 2  # four outputs, two input grads
    assert poisoned_buffers.count(()) == 3 and (40,) in poisoned_buffers
    assert (cfg["fwd_programs"], cfg["block_l"] + 4) in poisoned_buffers
    assert torch.isfinite(x.grad).all() and torch.isfinite(y.grad).all()


def test_launch_config_large_batch(device):
    for n, length in ((1 << 20, 40), (1 << 20, 256), (256, 40), (1000003, 7)):
        cfg = CH.launch_config(n, length, device)
        assert cfg["block_l"] >= length and cfg["block_n"] * cfg["block_l"] <= CH.TILE_ELEMENTS
        assert cfg["tiles"] * cfg["block_n"] >= n
        assert cfg["fwd_programs"] * cfg["tiles_per_prog"] >= cfg["tiles"]
        assert (cfg["fwd_programs"] - 1) * cfg["tiles_per_prog"] < cfg["tiles"]  # no empty program
        if n >= 1 << 20:  # more tiles than the device's programs: spread over more than half of them, then finalized
            cap = CH._max_programs(torch.device(device))
            assert cfg["tiles"] >= cap and cap // 2 < cfg["fwd_programs"] <= cap and cfg["finalize"]
    assert CH.launch_config(256, 40, device)["fwd_programs"] == 1  # the training shape: one launch, no finalize


def _valid(device):
    x = torch.randn(4, 6, device=device)
    w = reference.positional_weights(6, 1.3, device=device)
    return x, x.clone(), 1.0, w, w.clone()


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda a: (a[0][0], *a[1:]), ValueError, "2-D"),
        (lambda a: (a[0], a[1][:3], *a[2:]), ValueError, "same shape"),
        (lambda a: (a[0], a[1].double(), *a[2:]), TypeError, "share a dtype"),
        (lambda a: (a[0].int(), a[1].int(), *a[2:]), TypeError, "dtype"),
        (lambda a: (*a[:3], a[3][:5], a[4]), ValueError, r"code_weight must have shape \[6\]"),
        (lambda a: (*a[:4], a[4][None]), ValueError, "length_weight"),
        (lambda a: (*a[:4], torch.ones(6, dtype=torch.int64, device=a[0].device)), TypeError, "floating"),
        (lambda a: (*a[:3], a[3].tolist(), a[4]), TypeError, "torch.Tensor"),
        (lambda a: (a[0][:0], a[1][:0], *a[2:]), ValueError, "at least one row"),
        (lambda a: (*a[:2], -1.0, *a[3:]), ValueError, "not -1"),
        (lambda a: (*a[:2], float("nan"), *a[3:]), ValueError, "finite"),
        (lambda a: (*a[:2], "1.0", *a[3:]), TypeError, "real number"),
        (lambda a: (*a[:3], a[3].to("meta"), a[4]), ValueError, "one device"),
    ],
)
def test_input_validation(device, mutate, error, match):
    with pytest.raises(error, match=match):
        CH.code_head(*mutate(_valid(device)))


def test_too_long_code_is_rejected(device):
    x = torch.zeros(1, CH.MAX_L + 1, device=device)
    w = torch.ones(CH.MAX_L + 1, device=device)
    with pytest.raises(ValueError, match="above the supported"):
        CH.code_head(x, x, 1.0, w, w)
