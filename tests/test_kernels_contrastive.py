"""Fused Euclidean contrastive kernels (`kernels/contrastive_triton.py`) vs the PyTorch oracle (`kernels/reference.py`).

On the CPU the Triton kernels run under the interpreter (conftest sets TRITON_INTERPRET=1), where tl.dot is exact
fp32; on a GPU the same tests run the compiled kernels, whose fp32 Gram is TF32, so fp32 tolerances are looser there.
The oracle always runs in float64 on the same (upcast) inputs. Every buffer the kernels write is allocated NaN-filled
and checked after each test (autouse fixture), so an element a kernel fails to write fails the test. Inputs come from
`SEED` (0, or INFOSIEVE_TEST_SEED) and the test's name, so a failure replays.
"""

from __future__ import annotations

import ast
import inspect
import os
import re

import pytest
import torch

import infosieve_kernels as kernels
from infosieve_kernels import code_head_triton as CH
from infosieve_kernels import contrastive_triton as C
from infosieve_kernels import launch
from infosieve_kernels import reference as ref

GRAMS = ("triton", "mm")
SEED = int(os.environ.get("INFOSIEVE_TEST_SEED", "0"))


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every buffer the kernels write starts as NaN; after the test each must be fully written (finite)."""
    buffers = []

    def nan_buffer(shape, dtype, device):
        buffers.append(torch.full(shape, float("nan"), dtype=dtype, device=device))
        return buffers[-1]

    monkeypatch.setattr(launch, "new_buffer", nan_buffer)
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    yield buffers
    for i, t in enumerate(buffers):
        assert torch.isfinite(t).all(), f"buffer {i} {tuple(t.shape)} has unwritten/non-finite entries (seed {SEED})"


@pytest.fixture
def gen(request) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + sum(map(ord, request.node.name)))


def _tol(dtype: torch.dtype, device: torch.device, gram: str) -> tuple[float, float]:
    """(relative loss tolerance, gradient tolerance relative to max |grad|)."""
    if dtype == torch.float64:
        return 1e-10, 1e-9
    if dtype == torch.float32:
        if device.type == "cuda":
            return (2e-3, 2e-2) if gram == "triton" else (1e-4, 1e-3)
        return 2e-5, 2e-4
    return 3e-2, 1e-1  # fp16 / bf16 inputs (the oracle sees the same rounded values in fp64)


def _run(fn, x: torch.Tensor, *args, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    loss = fn(x, *args, **kwargs)
    loss.backward()
    return loss.detach(), x.grad


def _backward_outputs(buffers, shape, gram) -> int:
    """How many backward passes wrote into an allocated buffer: M [N, N] on the "mm" path, dF [N, D] when tiled."""
    n, d = shape
    return [tuple(t.shape) for t in buffers].count((n, n) if gram == "mm" else (n, d))


def _compare(ours_fn, ref_fn, x, args, *, gram, kwargs=None, buffers=None, duplicates=False, gfloor=1e-30):
    """Run both (the oracle in float64 on the same values); check dtype, loss and gradient.

    `buffers` (the `poisoned_buffers` fixture): also check that the backward wrote into a NaN-poisoned buffer.

    `duplicates`: the oracle's float64 distance between exact duplicate rows is sqrt(rounding error) ~ 1e-8, where
    the kernels give exactly 0 (sq_i is the Gram diagonal), so float64 is compared at 1e-6 there.
    """
    loss, grad = _run(ours_fn, x, *args, **(kwargs or {}))
    want_loss, want_grad = _run(ref_fn, x.double(), *args)
    expect = torch.float64 if x.dtype == torch.float64 else torch.float32
    assert loss.dtype == expect and loss.shape == ()
    assert grad.dtype == x.dtype and grad.shape == x.shape
    rtol, gtol = _tol(x.dtype, x.device, gram)
    if duplicates and x.dtype == torch.float64:
        rtol, gtol = 1e-6, 1e-5
    scale = max(abs(want_loss.item()), 1e-3)
    assert abs(loss.double().item() - want_loss.item()) <= rtol * scale, (
        f"loss {loss.item()!r} vs {want_loss.item()!r} (seed {SEED})"
    )
    gscale = want_grad.abs().max().item()
    err = (grad.double() - want_grad).abs().max().item()
    assert err <= gtol * gscale + gfloor, f"grad error {err:.3e} vs max |grad| {gscale:.3e} (seed {SEED})"
    if buffers is not None:
        assert _backward_outputs(buffers, x.shape, gram) == 1
    return loss, grad


def _features(n, d, dtype, device, gen, scale=1.0):
    return (torch.randn(n, d, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def _labels(n, device, gen, n_classes=4):
    """Labels with -1 rows and singleton classes mixed in."""
    y = torch.randint(0, n_classes, (n,), generator=gen)
    y[torch.randperm(n, generator=gen)[: n // 5]] = -1
    y[0], y[1] = 100, 101  # singletons: no positive, still contrasts
    return y.to(device)


# ------------------------------------------------------------------------------------------------------- InfoNCE


@pytest.mark.gpu_parity
@pytest.mark.parametrize("gram", GRAMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("is_code", [False, True])
@pytest.mark.parametrize("temperature,smoothing", [(1.0, 0.0), (0.07, 0.1), (1.0, 1.0)])
def test_info_nce_matches_reference(gram, dtype, is_code, temperature, smoothing, device, gen, poisoned_buffers):
    x = _features(70, 45, dtype, device, gen)  # 70 rows, 45 columns: ragged against the 32-wide test tiles
    # The code variant at smoothing 1 is nearly inert (docs/reference.md §3.2, §3.9): its gradient (~1e-9) is what is
    # left after per-pair terms ~1e4 times larger cancel, so fp32 rounding of those terms needs an absolute floor.
    inert = is_code and smoothing == 1.0 and dtype != torch.float64
    _compare(
        C.info_nce_loss,
        ref.info_nce_loss,
        x,
        (temperature, smoothing, is_code),
        gram=gram,
        kwargs=dict(gram=gram),
        buffers=poisoned_buffers,
        gfloor=1e-11 if inert else 1e-30,
    )


@pytest.mark.parametrize("gram", GRAMS)
@pytest.mark.parametrize("is_code", [False, True])
def test_info_nce_two_rows(gram, is_code, device, gen):
    """N = 2: one class per row, so the loss and the gradient are exactly 0 whatever the smoothing."""
    x = _features(2, 17, torch.float64, device, gen)
    for eps in (0.0, 0.5, 1.0):
        # Exact zeros on the interpreter; a compiled kernel may leave fp64 rounding (~1e-17) in the gradient.
        loss, grad = _compare(
            C.info_nce_loss, ref.info_nce_loss, x, (0.07, eps, is_code), gram=gram, kwargs={"gram": gram}, gfloor=1e-12
        )
        assert abs(loss.item()) < 1e-12 and grad.abs().max().item() < 1e-12


@pytest.mark.parametrize("gram", GRAMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("is_code", [False, True])
def test_info_nce_duplicate_rows(gram, dtype, is_code, device, gen):
    """Exact duplicates off the diagonal (incl. a positive pair and a scaled copy): distance 0, gradient finite."""
    x = _features(40, 33, torch.float64, device, gen)
    x[5] = x[25]  # row 5's positive is row 25: zero positive distance
    x[7] = x[3]
    x[30] = 2.0 * x[3]  # the same direction after normalisation (exact: scaling by 2)
    x = x.to(dtype)
    for eps in (0.0, 0.1):
        _compare(
            C.info_nce_loss,
            ref.info_nce_loss,
            x,
            (0.07, eps, is_code),
            gram=gram,
            kwargs={"gram": gram},
            duplicates=True,
        )


@pytest.mark.parametrize("gram", GRAMS)
def test_info_nce_strided_input_and_via_dispatch(gram, device, gen, monkeypatch):
    """A transposed (non-contiguous) input, through `kernels.info_nce_loss(..., backend="triton")`."""
    monkeypatch.setattr(C, "GRAM", gram)
    base = _features(37, 66, torch.float64, device, gen)
    x = base.t()  # [66, 37], strides (1, 66)
    fn = lambda f, *a: kernels.info_nce_loss(f, *a, backend="triton")
    _compare(fn, ref.info_nce_loss, x, (0.5, 0.1, False), gram=gram)
    _compare(fn, ref.info_nce_loss, x, (0.5, 0.1, True), gram=gram)


# --------------------------------------------------------------------------------- InfoNCE with a smoothing target


def _soft_target(n, device, gen, dtype=torch.float64):
    """A SelEx-like target: non-negative, zeros mixed in, rows summing to anything but 1, the diagonal non-zero (the
    losses must ignore it)."""
    c = torch.rand(n, n, generator=gen, dtype=torch.float64) * 3.0 / n
    c[torch.rand(n, n, generator=gen) < 0.3] = 0.0
    return c.to(device=device, dtype=dtype)


def test_soft_target_twin_equals_the_published_selex_cross_entropy(device, gen):
    """The torch twin with a smoothing target against SelEx's published form (`benchmarks/published/selex.py`: the
    logits and the target laid out [positive, negatives] by mask selection, CrossEntropyLoss on the soft target); a
    uniform target 1/(N-1) is the plain smoothed loss. Smoothing 0.25: the published one-hot is fp32, so 1 - s must be
    exact there for an fp64 comparison."""
    from benchmarks.published import selex as published

    x, c = _features(16, 9, torch.float64, device, gen), _soft_target(16, device, gen)

    def theirs(f):
        logits, zeros, confs = published.info_nce_logits(f, c, temperature=0.5)
        return published.label_smoothing_loss(logits, zeros, confs, 0.25)

    ours = _run(ref.info_nce_loss, x, 0.5, 0.25, False, c)
    torch.testing.assert_close(ours, _run(theirs, x), rtol=1e-12, atol=1e-14)
    uniform = torch.full((16, 16), 1 / 15, dtype=torch.float64, device=device)
    plain = _run(ref.info_nce_loss, x, 0.5, 0.4)
    torch.testing.assert_close(_run(ref.info_nce_loss, x, 0.5, 0.4, False, uniform), plain, rtol=1e-12, atol=1e-14)


@pytest.mark.gpu_parity
@pytest.mark.parametrize("gram", GRAMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("is_code,smoothing", [(False, 1.0), (False, 0.3), (True, 0.3)])
def test_info_nce_soft_target_matches_reference(gram, dtype, is_code, smoothing, device, gen, poisoned_buffers):
    """Loss and gradient with a dense smoothing target, ragged against the test tiles (70 rows, 45 columns)."""
    x = _features(70, 45, dtype, device, gen)
    c = _soft_target(70, device, gen, dtype)
    args = (0.5, smoothing, is_code, c)
    _compare(C.info_nce_loss, ref.info_nce_loss, x, args, gram=gram, kwargs=dict(gram=gram), buffers=poisoned_buffers)


@pytest.mark.parametrize("gram", GRAMS)
def test_soft_target_through_the_shared_gram_and_the_dispatch(gram, device, gen, monkeypatch):
    """`kernels.info_nce_and_supcon(..., smoothing_target=C, backend="triton")` (InfoNCE and SupCon from one Gram on
    the "mm" path) equals the oracle; a uniform target gives the plain smoothed loss."""
    monkeypatch.setattr(C, "GRAM", gram)
    x = _features(38, 20, torch.float64, device, gen)
    y, c = _labels(38, device, gen), _soft_target(38, device, gen)

    def total(terms):
        nce, (sup,) = terms
        return 0.65 * nce + 0.35 * sup

    fused = lambda f: total(kernels.info_nce_and_supcon(f, [y], 1.0, 0.5, smoothing_target=c, backend="triton"))
    _compare(fused, lambda f: total(ref.info_nce_and_supcon(f, [y], 1.0, 0.5, smoothing_target=c)), x, (), gram=gram)
    uniform = torch.full((38, 38), 1 / 37, dtype=torch.float64, device=device)
    soft = _run(kernels.info_nce_loss, x, 1.0, 0.5, False, uniform, backend="triton")
    plain = _run(kernels.info_nce_loss, x, 1.0, 0.5, backend="triton")
    torch.testing.assert_close(soft, plain, rtol=1e-12, atol=1e-14)


# -------------------------------------------------------------------------------------------------------- SupCon


@pytest.mark.gpu_parity
@pytest.mark.parametrize("gram", GRAMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("is_code", [False, True])
@pytest.mark.parametrize("temperature,base", [(0.07, 0.07), (1.0, 0.07)])
def test_supcon_matches_reference(gram, dtype, is_code, temperature, base, device, gen, poisoned_buffers):
    x = _features(67, 41, dtype, device, gen, scale=0.3)
    y = _labels(67, device, gen)
    _compare(
        C.supcon_loss,
        ref.supcon_loss,
        x,
        (y, temperature, base, is_code),
        gram=gram,
        kwargs=dict(gram=gram),
        buffers=poisoned_buffers,
    )


@pytest.mark.parametrize("gram", GRAMS)
@pytest.mark.parametrize("is_code", [False, True])
def test_supcon_no_anchor(gram, is_code, device, gen):
    """All -1, only singletons, or a single kept row: loss 0 and gradient 0 (as the reference)."""
    x = _features(36, 20, torch.float64, device, gen)
    cases = [
        torch.full((36,), -1),
        torch.arange(36),
        torch.where(torch.arange(36) == 4, 3, -1),
    ]
    for y in cases:
        loss, grad = _compare(
            C.supcon_loss, ref.supcon_loss, x, (y.to(device), 0.07, 0.07, is_code), gram=gram, kwargs={"gram": gram}
        )
        assert loss.item() == 0.0 and grad.abs().max().item() == 0.0


@pytest.mark.parametrize("gram", GRAMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("is_code", [False, True])
def test_supcon_duplicate_rows_and_large_distances(gram, dtype, is_code, device, gen):
    """Duplicates inside and across classes, and far-apart rows (logits ~ -1e3: the online LSE must rescale)."""
    x = _features(50, 24, torch.float64, device, gen, scale=3.0)
    x[10] = x[20]
    x[11] = x[12]
    x[40:] *= 8.0
    y = _labels(50, device, gen, n_classes=3)
    y[10], y[20], y[11], y[12] = 1, 1, 2, 0
    _compare(
        C.supcon_loss,
        ref.supcon_loss,
        x.to(dtype),
        (y, 0.07, 0.07, is_code),
        gram=gram,
        kwargs={"gram": gram},
        duplicates=True,
    )


@pytest.mark.parametrize("gram", GRAMS)
def test_supcon_via_dispatch(gram, device, gen, monkeypatch):
    monkeypatch.setattr(C, "GRAM", gram)
    x = _features(34, 19, torch.float64, device, gen)
    y = _labels(34, device, gen).to(torch.int32)
    fn = lambda f, *a: kernels.supcon_loss(f, *a, backend="triton")
    _compare(fn, ref.supcon_loss, x, (y, 0.1, 0.07, True), gram=gram)
    _compare(fn, ref.supcon_loss, x, (y, 0.1, 0.07, False), gram=gram)


# --------------------------------------------------------------------------------------------- dtypes and paths


@pytest.mark.gpu_parity
@pytest.mark.parametrize("gram", GRAMS)
def test_half_inputs(gram, device, gen):
    """fp16 (and bf16 on CUDA; the interpreter's bf16 arithmetic is wrong): fp32 loss, gradient in the input dtype."""
    dtypes = [torch.float16] + ([torch.bfloat16] if device.type == "cuda" else [])
    for dtype in dtypes:
        x = _features(38, 48, dtype, device, gen)
        y = _labels(38, device, gen)
        _compare(C.info_nce_loss, ref.info_nce_loss, x, (0.5, 0.1, False), gram=gram, kwargs={"gram": gram})
        _compare(C.supcon_loss, ref.supcon_loss, x, (y, 0.5, 0.07, False), gram=gram, kwargs={"gram": gram})


@pytest.mark.gpu_parity
@pytest.mark.parametrize("gram", GRAMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("is_code", [False, True])
def test_shared_gram_terms_equal_separate_calls_and_the_oracle(gram, dtype, is_code, device, gen, poisoned_buffers):
    """InfoNCE + two SupCon terms from one Gram matrix ("mm": one GEMM forward, one backward) give the separate calls'
    losses and the oracle's, and the gradient of a weighted sum of the three."""
    x = _features(70, 45, dtype, device, gen)
    gt, pseudo = _labels(70, device, gen), _labels(70, device, gen, n_classes=7)
    args = (1.0, 0.3, 0.07, 0.1, is_code)

    def total(terms):
        nce, (a, b) = terms
        return 0.65 * nce + 0.35 * (a + b) / 2

    def shared(f):
        return total(C.info_nce_and_supcon(f, [gt, pseudo], *args, gram=gram))

    def separate(f):
        nce = C.info_nce_loss(f, 1.0, 0.3, is_code, gram=gram)
        return total((nce, [C.supcon_loss(f, y, 0.07, 0.1, is_code, gram=gram) for y in (gt, pseudo)]))

    def oracle(f):
        return total(ref.info_nce_and_supcon(f, [gt, pseudo], *args))

    loss, grad = _compare(shared, oracle, x, (), gram=gram)
    assert _backward_outputs(poisoned_buffers, x.shape, gram) == 3  # all three terms wrote poisoned buffers
    want = _run(separate, x)
    rtol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(loss, want[0], rtol=rtol, atol=0)
    torch.testing.assert_close(grad, want[1], rtol=rtol * 10, atol=rtol * want[1].abs().max().item())


def test_shared_gram_runs_one_gemm_each_way(device, gen, monkeypatch):
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a: calls.append(a[0].shape) or real_mm(*a))
    x = _features(16, 300, torch.float32, device, gen).requires_grad_(True)
    y = _labels(16, device, gen)
    nce, (a, b) = C.info_nce_and_supcon(x, [y, y.flip(0)], gram="mm")
    assert len(calls) == 1
    (nce + a + b).backward()
    assert len(calls) == 2


def test_paths_agree_and_size_rule(device, gen):
    x = _features(48, 40, torch.float64, device, gen)
    a = _run(C.info_nce_loss, x, 0.3, 0.1, True, gram="triton")
    b = _run(C.info_nce_loss, x, 0.3, 0.1, True, gram="mm")
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    assert C._pick_gram(256, 65536, None) == "mm"  # the training shape: cuBLAS Gram
    assert C._pick_gram(65536, 256, None) == "triton"  # N^2 does not fit: tiled, O(N D) memory
    assert C._pick_gram(65536, 256, "mm") == "mm"


@pytest.mark.slow
def test_larger_ragged(device, gen):
    """Several tiles in every direction on the tl.dot path (N = 134, D = 80), fp32, code variant (3 passes)."""
    x = _features(134, 80, torch.float32, device, gen)
    y = _labels(134, device, gen, n_classes=6)
    _compare(C.info_nce_loss, ref.info_nce_loss, x, (0.07, 0.1, True), gram="triton", kwargs={"gram": "triton"})
    _compare(C.supcon_loss, ref.supcon_loss, x, (y, 0.07, 0.07, True), gram="triton", kwargs={"gram": "triton"})


@pytest.mark.gpu_parity
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-sync detection needs CUDA")
@pytest.mark.parametrize("gram", GRAMS)
def test_no_host_sync(gram, gen, monkeypatch):
    x = _features(64, 96, torch.float32, torch.device("cuda"), gen).requires_grad_(True)
    y = _labels(64, x.device, gen)
    C.info_nce_loss(x, 1.0, 0.1, True, gram=gram)  # compile outside the check
    C.supcon_loss(x, y, 0.07, 0.07, True, gram=gram)
    C.info_nce_and_supcon(x, [y, y.flip(0)], gram=gram)
    target = _soft_target(64, x.device, gen, torch.float32)
    C.info_nce_loss(x, 1.0, 0.5, False, target, gram=gram)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = C.info_nce_loss(x, 1.0, 0.1, True, gram=gram) + C.supcon_loss(x, y, 0.07, 0.07, True, gram=gram)
        nce, (a, b) = C.info_nce_and_supcon(x, [y, y.flip(0)], gram=gram)
        soft = C.info_nce_loss(x, 1.0, 0.5, False, target, gram=gram)
        (loss + nce + a + b + soft).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------------------------------------------- errors


def test_errors(device):
    x = torch.randn(6, 8, device=device)
    y = torch.zeros(6, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="even number of rows"):
        C.info_nce_loss(torch.randn(5, 8, device=device))
    with pytest.raises(ValueError, match="even number of rows"):
        C.info_nce_loss(torch.randn(0, 8, device=device))
    with pytest.raises(ValueError, match="2-D"):
        C.info_nce_loss(torch.randn(6, 8, 2, device=device))
    with pytest.raises(ValueError, match="2-D"):
        C.supcon_loss(torch.randn(6, device=device), y)
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        C.info_nce_loss(torch.ones(6, 8, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="temperature"):
        C.info_nce_loss(x, 0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        C.info_nce_loss(x, 1.0, 1.5)
    with pytest.raises(ValueError, match="base_temperature"):
        C.supcon_loss(x, y, 0.07, -1.0)
    with pytest.raises(ValueError, match="one entry per feature row"):
        C.supcon_loss(x, y[:5])
    with pytest.raises(TypeError, match="integer"):
        C.supcon_loss(x, y.float())
    with pytest.raises(ValueError, match="gram"):
        C.info_nce_loss(x, gram="cublas")
    with pytest.raises(ValueError, match=r"smoothing_target must be 2-D \[N, N\]"):
        C.info_nce_loss(x, 1.0, 0.5, False, torch.ones(36, device=device))
    with pytest.raises(ValueError, match=r"smoothing_target must be \[N, N\] for the 6 feature rows"):
        C.info_nce_loss(x, 1.0, 0.5, False, torch.ones(6, 5, device=device))
    with pytest.raises(TypeError, match="smoothing_target must be a torch.Tensor"):
        C.info_nce_and_supcon(x, [y], smoothing_target=[[1.0]])
    if device.type == "cuda":
        with pytest.raises(ValueError, match="labels are on"):
            C.supcon_loss(x, y.cpu())
    else:
        with pytest.raises(ValueError, match="labels are on"):
            C.supcon_loss(x, y.to("meta"))


@pytest.mark.parametrize(
    ("module", "ops"),
    [(C, {"info_nce_loss", "supcon_loss", "info_nce_and_supcon"}), (CH, {"code_head"})],
    ids=["contrastive", "code_head"],
)
def test_all_lists_every_public_name_and_every_op_the_dispatch_fetches(module, ops):
    """`__all__` of each kernel module holds every public name it defines and every op `dispatch.py` fetches from it
    by name (`_impl("<module>", "<op>", ...)`), and nothing it lacks."""
    group = module.__name__.rsplit(".", 1)[1].removesuffix("_triton")
    fetched = set(re.findall(rf'_impl\("{group}", "(\w+)"', inspect.getsource(kernels.dispatch)))
    assert fetched == ops  # the reader found every op
    defined = set()
    for node in ast.parse(inspect.getsource(module)).body:  # what the module defines, not what it imports
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    defined = {name for name in defined if not name.startswith("_")}
    assert fetched | defined <= set(module.__all__)
    assert all(hasattr(module, name) for name in module.__all__)
