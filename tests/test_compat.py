"""`kernels.compat` against a stand-in of the original module (values and gradients, float32 and float64).

Every test runs once per backend (`INFOSIEVE_KERNELS=torch|triton`). On the CPU the Triton variant runs under the
interpreter (conftest sets TRITON_INTERPRET), so its cases are kept few and tiny.

Tolerances are normwise: max|ours - reference| <= rtol * max|reference| + atol. With at most 25 rows `torch.cdist`
is exact on its diagonal and the two sides differ only by rounding (float64: ~1e-15). Above 25 rows the reference's
diagonal carries matrix-multiply rounding noise (float32 ~7e-4, float64 ~3e-8, docs/reference.md §8) while ours is
exactly 0; only the code variant's row sums see it, and `test_cdist_diagonal_quirk` checks that with its own, looser
bounds.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import sys
import types
from pathlib import Path

import pytest
import torch

import infosieve_kernels as kernels
from benchmarks.published import model as standin
from infosieve_kernels import compat

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
L = 40


def cases(torch_cases: list[tuple], triton_cases: list[tuple]) -> list:
    """(backend, *case) params: the full grid for torch; for triton a few tiny cases under the interpreter."""
    out = [pytest.param("torch", *c, id="-".join(["torch", *map(str, c)])) for c in torch_cases]
    for c in triton_cases if INTERPRETED else torch_cases:
        out.append(pytest.param("triton", *c, id="-".join(["triton", *map(str, c)])))
    return out


DTYPES = [torch.float32, torch.float64]


@pytest.fixture(autouse=True)
def seeded():
    """The same random inputs every run (seed 0); INFOSIEVE_TEST_SEED tries others. Printed, so shown on failure."""
    seed = int(os.environ.get("INFOSIEVE_TEST_SEED", "0"))
    torch.manual_seed(seed)
    random.seed(seed)
    print(f"seed={seed}")
    return seed


def use_backend(monkeypatch, backend: str) -> None:
    monkeypatch.setenv(kernels.ENV_VAR, backend)


def tol(dtype: torch.dtype, backend: str, device: torch.device) -> tuple[float, float]:
    """(rtol, atol), normwise. Triton's fp32 `tl.dot` on a GPU may use TF32 (10-bit mantissa) for the Gram matrix."""
    if dtype == torch.float64:
        return 1e-9, 1e-12
    if backend == "triton" and device.type == "cuda":
        return 3e-2, 3e-3
    return 2e-4, 1e-6


def assert_near(actual, expected, rtol: float, atol: float, what: str) -> None:
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected.double()).abs().max().item()
    bound = rtol * expected.double().abs().max().item() + atol
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def value_and_grad(fn, *inputs):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    value = fn(*leaves)
    return value.detach(), torch.autograd.grad(value, leaves)


def check_pair(ours, theirs, inputs, dtype, backend, device, what):
    """Values and gradients of `ours(*inputs)` against `theirs(*inputs)`."""
    rtol, atol = tol(dtype, backend, device)
    v1, g1 = value_and_grad(ours, *inputs)
    v0, g0 = value_and_grad(theirs, *inputs)
    assert_near(v1, v0, rtol, atol, f"{what} value")
    for i, (a, b) in enumerate(zip(g1, g0, strict=True)):
        assert_near(a, b, rtol, atol, f"{what} grad[{i}]")


def random_views(bsz: int, n_views: int, dim: int, dtype, device, is_code: bool) -> torch.Tensor:
    """[bsz, n_views, dim]: unit-norm embeddings, or position-weighted codes in (-1, 1) for the code variant."""
    x = torch.randn(bsz, n_views, dim, dtype=torch.float64)
    if is_code:
        x = torch.tanh(2 * x) * torch.pow(1.5, -torch.arange(dim, dtype=torch.float64))
    else:
        x = torch.nn.functional.normalize(x, dim=-1)
    return x.to(device=device, dtype=dtype)


def flat_views(x: torch.Tensor) -> torch.Tensor:
    return torch.cat(torch.unbind(x, dim=1), dim=0)


def fresh_standin() -> types.ModuleType:
    """A private copy of the stand-in module, so patching it leaves the shared one alone."""
    spec = importlib.util.spec_from_file_location("standin_copy", Path(standin.__file__))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- info_nce_loss


@pytest.mark.parametrize(
    "backend,dtype,is_code,smoothing",
    cases(
        [(d, c, s) for d in DTYPES for c in (False, True) for s in (0.0, 0.1, 1.0)],
        [(d, c, 0.1) for d in DTYPES for c in (False, True)],
    ),
)
@pytest.mark.gpu_parity
def test_info_nce_loss(monkeypatch, device, backend, dtype, is_code, smoothing):
    use_backend(monkeypatch, backend)
    bsz, dim = random.randint(5, 12), random.randint(3, 40)
    temperature = random.choice([1.0, 0.5])
    feats = flat_views(random_views(bsz, 2, dim, dtype, device, is_code))
    args = types.SimpleNamespace(n_views=2, temperature=temperature)

    def theirs(f):
        logits, targets = standin.info_nce_logits(f, args, is_code=is_code)
        return torch.nn.CrossEntropyLoss(label_smoothing=smoothing)(logits, targets)

    def ours(f):
        return compat.info_nce_loss(f, temperature=temperature, label_smoothing=smoothing, is_code=is_code)

    check_pair(ours, theirs, [feats], dtype, backend, device, f"info_nce bsz={bsz} D={dim}")


# ---------------------------------------------------------------- SupConLoss


def spy_kernel(monkeypatch) -> list:
    """Record the calls `compat.SupConLoss` makes to the fused SupCon."""
    calls = []
    inner = compat._supcon_loss

    def spy(*args, **kwargs):
        calls.append(args[1])
        return inner(*args, **kwargs)

    monkeypatch.setattr(compat, "_supcon_loss", spy)
    return calls


@pytest.mark.parametrize(
    "backend,dtype,is_code",
    cases(
        [(d, c) for d in DTYPES for c in (False, True)],
        [(d, c) for d in DTYPES for c in (False, True)],
    ),
)
def test_supcon_labels(monkeypatch, device, backend, dtype, is_code):
    use_backend(monkeypatch, backend)
    calls = spy_kernel(monkeypatch)
    bsz, dim = random.randint(5, 12), random.randint(3, 40)
    feats = random_views(bsz, 2, dim, dtype, device, is_code)
    # arbitrary label values (negative, sparse): the reference only compares them; -1 must not mean "excluded" here
    labels = torch.tensor([-1, 7, 3, -5])[torch.randint(0, 4, (bsz,))].to(device)
    ids = compat._dense_ids(labels)
    assert ids.min() >= 0 and torch.equal(ids[:, None] == ids[None, :], labels[:, None] == labels[None, :])
    temperature, base = random.choice([(0.07, 0.07), (0.5, 0.07)])
    check_pair(
        lambda f: compat.SupConLoss(temperature, base_temperature=base)(f, labels=labels, is_code=is_code),
        lambda f: standin.SupConLoss(temperature, base_temperature=base)(f, labels=labels, is_code=is_code),
        [feats],
        dtype,
        backend,
        device,
        f"supcon labels bsz={bsz} D={dim}",
    )
    assert len(calls) == 1, "labels must take the fused path"


@pytest.mark.parametrize("backend,dtype", cases([(d,) for d in DTYPES], [(torch.float64,)]))
def test_supcon_simclr_and_label_mask(monkeypatch, device, backend, dtype):
    """labels=None, mask=None (SimCLR) and a mask that is a 0/1 equivalence relation both run the fused kernel."""
    use_backend(monkeypatch, backend)
    calls = spy_kernel(monkeypatch)
    bsz, dim = random.randint(5, 12), random.randint(3, 40)
    feats = random_views(bsz, 2, dim, dtype, device, False)
    labels = torch.randint(0, 3, (bsz,), device=device)
    mask = (labels[:, None] == labels[None, :]).float()
    for kwargs, what in (({}, "simclr"), ({"mask": mask}, "equivalence mask")):
        check_pair(
            lambda f, kw=kwargs: compat.SupConLoss()(f, **kw),
            lambda f, kw=kwargs: standin.SupConLoss()(f, **kw),
            [feats],
            dtype,
            backend,
            device,
            f"supcon {what}",
        )
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_supcon_fallbacks(monkeypatch, device, dtype):
    """Masks that are not label patterns and contrast_mode='one' (the torch fallback), and 3 views, vs the stand-in."""
    use_backend(monkeypatch, "torch")
    bsz, dim = random.randint(5, 12), random.randint(3, 40)
    feats = random_views(bsz, 2, dim, dtype, device, False)
    asymmetric = (torch.rand(bsz, bsz, device=device) < 0.4).float()
    asymmetric.fill_diagonal_(1.0)
    weighted = torch.rand(bsz, bsz, device=device, dtype=dtype)
    calls = spy_kernel(monkeypatch)
    rtol, atol = tol(dtype, "torch", device)
    for mask, is_code in ((asymmetric, False), (asymmetric, True), (weighted, False)):
        check_pair(
            lambda f, m=mask, c=is_code: compat.SupConLoss()(f, mask=m, is_code=c),
            lambda f, m=mask, c=is_code: standin.SupConLoss()(f, mask=m, is_code=c),
            [feats],
            dtype,
            "torch",
            device,
            "supcon mask fallback",
        )
    labels = torch.randint(0, 3, (bsz,), device=device)
    check_pair(
        lambda f: compat.SupConLoss(contrast_mode="one")(f, labels=labels),
        lambda f: standin.SupConLoss(contrast_mode="one")(f, labels=labels),
        [feats],
        dtype,
        "torch",
        device,
        "supcon contrast_mode='one'",
    )
    assert calls == [], "these cases cannot be written as labels: they must not reach the kernel"
    three = random_views(bsz, 3, dim, dtype, device, False)
    ours = compat.SupConLoss()(three, labels=labels)
    assert len(calls) == 1, "3 views with labels still use the kernel"
    assert_near(ours, standin.SupConLoss()(three, labels=labels), rtol, atol, "supcon 3 views")
    with pytest.raises(ValueError, match="both"):
        compat.SupConLoss()(feats, labels=labels, mask=asymmetric)
    with pytest.raises(ValueError, match="Num of labels"):
        compat.SupConLoss()(feats, labels=labels[:-1])
    with pytest.raises(ValueError, match="at least 3 dimensions"):
        compat.SupConLoss()(feats[:, 0])


# ---------------------------------------------------------------- HLoss, NormPLoss, Norm0Loss


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_losses(device, dtype):
    rtol, atol = tol(dtype, "torch", device)
    n = random.randint(5, 12) * 2
    z = torch.tanh(3 * torch.randn(n, L, dtype=dtype, device=device))
    m = torch.rand(n, L, dtype=dtype, device=device)
    for is_mask, x in ((False, z), (True, m)):
        check_pair(compat.HLoss(is_mask), standin.HLoss(is_mask), [x], dtype, "torch", device, f"HLoss({is_mask})")
    # weights in the input's dtype: fp32 weights make the original's ||1/w|| an fp32 sum of 2^0..2^39, whose rounding
    # depends on the reduction order (1e-7 relative on CUDA), not on the code under test
    w0 = kernels.positional_weights(L, 2.0, device=device, dtype=dtype)
    for pnorm, weight in ((1, w0), (2, w0), (1, None)):
        check_pair(
            compat.NormPLoss(pnorm, weight),
            standin.NormPLoss(pnorm, weight),
            [m],
            dtype,
            "torch",
            device,
            f"NormPLoss(p={pnorm})",
        )
    assert compat.Norm0Loss()(z).item() == standin.Norm0Loss()(z).item()
    assert compat.Norm0Loss()(z).dtype == torch.float32


def test_normploss_keeps_its_weights(device):
    """The stale-weight behaviour: rebinding the labeller's code_weight does not reach the length loss."""
    w0 = kernels.positional_weights(L, 2.0, device=device)
    head = compat.DINOLABELLING(8, nlayers=2, hidden_dim=8, bottleneck_dim=L, code_weight=w0, nclasses=3)
    ours, theirs = compat.NormPLoss(pnorm=1, code_weight=head.code_weight), standin.NormPLoss(1, w0)
    head.code_weight = kernels.positional_weights(L, 1.5, device=device)
    assert ours.code_weight is w0
    m = torch.rand(10, L, device=device)
    assert_near(ours(m), theirs(m), 2e-4, 1e-6, "length loss")
    assert_near(ours(m), (m * 2.0 ** torch.arange(L, device=device)).sum() / (2.0**L - 1), 2e-4, 1e-6, "base-2 sum")


# ---------------------------------------------------------------- DINOLABELLING


def labeller_pair(device, dtype, in_dim=24, nclasses=7):
    w0 = kernels.positional_weights(L, 2.0, device=device)
    kw = dict(nlayers=2, hidden_dim=16, bottleneck_dim=L, code_weight=w0, nclasses=nclasses)
    theirs = standin.DINOLABELLING(in_dim, **kw)
    with torch.no_grad():  # O(1) pre-activations instead of the tiny init, so tanh/age really matter
        for p in theirs.parameters():
            p.normal_(0, 0.5)
    ours = compat.DINOLABELLING(in_dim, **kw)
    missing, unexpected = ours.load_state_dict(theirs.state_dict())
    assert not missing and not unexpected
    return ours.to(device, dtype), theirs.to(device, dtype)


@pytest.mark.parametrize("backend,dtype", cases([(d,) for d in DTYPES], [(d,) for d in DTYPES]))
def test_dinolabelling_matches_after_load(monkeypatch, device, backend, dtype):
    use_backend(monkeypatch, backend)
    rtol, atol = tol(dtype, backend, device)
    ours, theirs = labeller_pair(device, dtype)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    x = torch.randn(random.randint(5, 12) * 2, 24, dtype=dtype, device=device)
    epochs = 200
    for epoch in (0, 9, 199):  # the training loop's per-epoch reassignment (docs/reference.md §2.3)
        for head in (ours, theirs):
            head.age = (epoch + 1) / 10
            head.code_weight = torch.pow(2 - epoch / epochs, torch.arange(0, -L, -1, dtype=torch.float32)).to(device)
        out1, out0 = ours(x), theirs(x)
        assert len(out1) == 5
        for name, a, b in zip(("code_feat", "mask", "code_raw", "code", "trunc_code"), out1, out0, strict=True):
            assert a.dtype == b.dtype, name
            assert_near(a, b, rtol, atol, f"epoch {epoch} {name}")
    # gradients through all five outputs, w.r.t. the input and the first coder/masker layers
    weights = [torch.randn(x.shape[0], L, dtype=dtype, device=device) for _ in range(5)]
    grads = []
    for head in (ours, theirs):
        xx = x.clone().requires_grad_(True)
        total = sum((o * w).sum() for o, w in zip(head(xx), weights, strict=True))
        grads.append(torch.autograd.grad(total, [xx, head.coder[0].weight, head.masker[0].weight]))
    for i, (a, b) in enumerate(zip(*grads, strict=True)):
        assert_near(a, b, rtol, atol, f"labeller grad[{i}]")
    # the categorizer is called on its own, as in the reference loop
    codes = torch.randn(6, L, dtype=dtype, device=device)
    assert_near(ours.categorizer(codes), theirs.categorizer(codes), rtol, atol, "categorizer")


@pytest.mark.parametrize("use_bn,nlayers", [(True, 2), (False, 1), (False, 3)])
def test_dinolabelling_structure(use_bn, nlayers):
    kw = dict(use_bn=use_bn, nlayers=nlayers, hidden_dim=8, bottleneck_dim=L, nclasses=3)
    ours, theirs = compat.DINOLABELLING(12, **kw), standin.DINOLABELLING(12, **kw)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    ours.load_state_dict(theirs.state_dict())
    ours.eval(), theirs.eval()
    x = torch.randn(4, 12)
    for a, b in zip(ours(x), theirs(x), strict=True):  # default code_weight=1, age=20
        assert_near(a, b, 2e-4, 1e-6, "default-constructed labeller")


# ---------------------------------------------------------------- patch_reference


@pytest.mark.gpu_parity
@pytest.mark.parametrize("backend", cases([()], [()]))
def test_patch_reference(monkeypatch, device, backend):
    use_backend(monkeypatch, backend)
    module = fresh_standin()
    originals = {name: getattr(module, name) for name in compat.PATCHED_NAMES if hasattr(module, name)}
    bsz = random.randint(5, 8)
    feats = random_views(bsz, 2, 16, torch.float64, device, False)
    labels = torch.randint(0, 3, (bsz,), device=device)
    mask = torch.rand(bsz, L, dtype=torch.float64, device=device)
    w0 = kernels.positional_weights(L, 2.0, device=device, dtype=torch.float64)  # see test_small_losses

    def losses(mod):
        return [
            mod.SupConLoss()(feats, labels=labels),
            mod.SupConLoss()(feats, labels=labels, is_code=True),
            mod.HLoss()(mask * 2 - 1) + mod.HLoss(is_mask=True)(mask),
            mod.NormPLoss(pnorm=1, code_weight=w0)(mask),
        ]

    before = losses(module)
    replaced = compat.patch_reference(module)
    assert replaced == {**originals, "info_nce_loss": None}
    for name in compat.PATCHED_NAMES:
        assert getattr(module, name) is getattr(compat, name), name
    assert module.info_nce_logits.__module__ == module.__name__, "info_nce_logits itself is left in place"
    for i, (a, b) in enumerate(zip(losses(module), before, strict=True)):
        assert_near(a, b, 1e-9, 1e-12, f"loss {i} through the patched module")
    # the replaced InfoNCE call pair, and a labeller built after patching that loads a reference state dict
    args = types.SimpleNamespace(n_views=2, temperature=1.0)
    flat = flat_views(feats)
    ce = torch.nn.CrossEntropyLoss(label_smoothing=0.5)(*module.info_nce_logits(flat, args))
    assert_near(module.info_nce_loss(flat, 1.0, 0.5), ce, 1e-9, 1e-12, "fused info_nce via the module")
    head = module.DINOLABELLING(16, nlayers=2, bottleneck_dim=L, code_weight=w0, nclasses=4)
    assert isinstance(head, compat.DINOLABELLING)
    head.load_state_dict(originals["DINOLABELLING"](16, nlayers=2, bottleneck_dim=L, nclasses=4).state_dict())
    compat.unpatch_reference(module, replaced)
    assert not hasattr(module, "info_nce_loss")
    for name, obj in originals.items():
        assert getattr(module, name) is obj
    with pytest.raises(ValueError):
        compat.patch_reference(module, names=["K_Means"])


# ---------------------------------------------------------------- the cdist diagonal quirk, and the docs example


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-3), (torch.float64, 1e-7)])
def test_cdist_diagonal_quirk(monkeypatch, device, dtype, rtol):
    """Above 25 rows the reference's cdist diagonal is noise, not 0; only the code variant feels it (row sums).

    Measured: float32 value ~1e-7 / gradient ~1e-5 relative; float64 ~1e-12 / ~1e-9 (vs ~1e-15 without the quirk).
    """
    use_backend(monkeypatch, "torch")
    bsz = 16  # 32 rows: cdist takes the matrix-multiply path
    feats = random_views(bsz, 2, L, dtype, device, True)
    labels = torch.randint(0, 4, (bsz,), device=device)
    args = types.SimpleNamespace(n_views=2, temperature=1.0)
    v1, g1 = value_and_grad(lambda f: compat.SupConLoss()(f, labels=labels, is_code=True), feats)
    v0, g0 = value_and_grad(lambda f: standin.SupConLoss()(f, labels=labels, is_code=True), feats)
    assert_near(v1, v0, rtol, 0.0, "code supcon value")
    assert_near(g1[0], g0[0], rtol, 0.0, "code supcon grad")
    flat = flat_views(feats)
    v1, g1 = value_and_grad(lambda f: compat.info_nce_loss(f, 1.0, 0.1, True), flat)
    v0, g0 = value_and_grad(
        lambda f: torch.nn.CrossEntropyLoss(label_smoothing=0.1)(*standin.info_nce_logits(f, args, True)), flat
    )
    assert_near(v1, v0, rtol, 0.0, "code info_nce value")
    assert_near(g1[0], g0[0], rtol, 0.0, "code info_nce grad")


@pytest.mark.parametrize("doc", ["docs/compat.md", "README.md"])
def test_docs_example_runs(monkeypatch, doc):
    """Every runnable python block (the ones using the stand-in module) of the doc runs as written."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setitem(sys.modules, "benchmarks.published.model", fresh_standin())
    monkeypatch.setattr(sys.modules["benchmarks.published"], "model", sys.modules["benchmarks.published.model"])
    text = (ROOT / doc).read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "benchmarks.published" in b]
    assert blocks, f"{doc} has no runnable compat example"
    for block in blocks:
        exec(compile(block, doc, "exec"), {"__name__": "__docs__"})
