"""The loss oracle (`kernels/reference.py`) against docs/reference.md §3, three ways.

1. Independent loop computations: explicit Python loops over rows i, j with `math.sqrt/exp/log/tanh` on float64
   tiny inputs (4 samples x 3 dims, 2 views = 8 rows), written from the formulas of docs/reference.md §3.1-3.5 and
   calling none of the oracle's helpers. The same loops run on 0-d torch tensors (`TorchMath`) to give an analytic
   gradient where finite differences cannot (a zero distance), plus a few fully hand-computed cases.
2. Gradients: `torch.autograd.gradcheck` in float64 on every term, away from zero distances; duplicate rows give a
   finite gradient equal to the analytic one with the duplicate pair's distance contributing 0.
3. The original code's arithmetic: `benchmarks/published/model.py` transcribes `info_nce_logits` (cdist, positive
   in column 0, negatives after it), HobbitLong's `SupConLoss` (max subtraction, `contrast_mode='all'`), `HLoss`
   and `NormPLoss` (`torch.norm(p=1)` over the whole tensor); it is combined here with
   `nn.CrossEntropyLoss(label_smoothing=s)` and the labeller's elementwise forward (docs/reference.md §2.3).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

from benchmarks.published import model as orig
from infosieve_kernels import reference as ref

SEED = int(os.environ.get("INFOSIEVE_TEST_SEED", "0"))  # inputs: this and the test name; printed on failure
B, D = 4, 3  # 4 samples x 3 dims, two views: N = 8 rows
SMOOTHINGS = (0.0, 0.1, 0.5, 1.0)
AGES = (0.1, 1.0, 20.0)


@pytest.fixture
def gen(request) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + sum(map(ord, request.node.name)))


def _rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_(True)


def _labels(gen: torch.Generator, n_classes: int = 2, unlabelled: bool = True) -> torch.Tensor:
    """Per-sample labels repeated over both views; with `unlabelled`, some samples are -1 (at least 2 kept)."""
    y = torch.randint(0, n_classes, (B,), generator=gen)
    if unlabelled:
        y[torch.randperm(B, generator=gen)[: B // 2]] = -1
    return y.repeat(2)


def _close(actual, expected, rtol=1e-11, atol=1e-12, what=""):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{what} (seed {SEED}): {m}",
    )


# ------------------------------------------------------------------------------------------------ loop computations
class TorchMath:
    """`math`'s functions on 0-d tensors, so the loops below also give autograd gradients."""

    sqrt, exp, log, tanh = torch.sqrt, torch.exp, torch.log, torch.tanh


def _rows(x: torch.Tensor, m) -> list:
    return x.detach().tolist() if m is math else [list(r.unbind(0)) for r in x.unbind(0)]


def _normalize(r: list, m) -> list:
    norm = m.sqrt(sum(v * v for v in r))
    return [v / norm for v in r]


def _euclid(a: list, b: list, m):
    """sqrt(sum_k (a_k - b_k)^2); a zero distance is the constant 0 (no gradient), like `torch.cdist`'s backward."""
    s = sum((p - q) ** 2 for p, q in zip(a, b, strict=True))
    return m.sqrt(s) if s > 0 else s * 0.0


def _similarities(f: list, temperature: float, is_code: bool, m) -> list:
    """s_ij = -d_ij / T, or -d_ij / (sum_k d_jk + 1e-10) / T for codes (docs/reference.md §3.2: column j over row j's
    sum)."""
    n = len(f)
    d = [[_euclid(f[i], f[j], m) for j in range(n)] for i in range(n)]
    if is_code:
        col = [sum(d[j]) + 1e-10 for j in range(n)]
        return [[-d[i][j] / col[j] / temperature for j in range(n)] for i in range(n)]
    return [[-d[i][j] / temperature for j in range(n)] for i in range(n)]


def loop_info_nce(x: torch.Tensor, temperature=1.0, smoothing=0.0, is_code=False, m=math):
    """docs/reference.md §3.1: row i's classes are the 2B-1 other rows, the positive is i +- B;
    l_i = (1 - s)(-log p_pos) + s * mean_c(-log p_c); the loss is the mean over rows."""
    f = [_normalize(r, m) for r in _rows(x, m)]
    n = len(f)
    z = _similarities(f, temperature, is_code, m)
    total = 0.0
    for i in range(n):
        classes = [j for j in range(n) if j != i]
        lse = m.log(sum(m.exp(z[i][j]) for j in classes))
        nll_pos = lse - z[i][(i + n // 2) % n]
        nll_mean = sum(lse - z[i][j] for j in classes) / len(classes)
        total = total + (1 - smoothing) * nll_pos + smoothing * nll_mean
    return total / n


def loop_supcon(x: torch.Tensor, labels, temperature=0.07, base=0.07, is_code=False, m=math):
    """docs/reference.md §3.1: over the rows with a label >= 0, loss_i = -(tau/base) mean_{j in P(i)} log p_ij with
    p_ij = exp(s_ij) / sum_{k != i} exp(s_ik); the mean over anchors that have a positive (0 when none)."""
    labels = [int(v) for v in labels]
    keep = [i for i, v in enumerate(labels) if v >= 0]
    rows = _rows(x, m)
    f, y = [rows[i] for i in keep], [labels[i] for i in keep]
    z = _similarities(f, temperature, is_code, m)
    per_anchor = []
    for i in range(len(f)):
        others = [k for k in range(len(f)) if k != i]
        lse = m.log(sum(m.exp(z[i][k]) for k in others))
        pos = [j for j in others if y[j] == y[i]]
        if pos:
            per_anchor.append(-(temperature / base) * sum(z[i][j] - lse for j in pos) / len(pos))
    return sum(per_anchor) / len(per_anchor) if per_anchor else 0.0


def loop_code_head(cf: torch.Tensor, mf: torch.Tensor, age: float, w: torch.Tensor, lw: torch.Tensor) -> dict:
    """docs/reference.md §2.3 forward and §3.3-3.5 terms, element by element."""
    cf, mf, w, lw = cf.tolist(), mf.tolist(), w.tolist(), lw.tolist()
    n, length = len(cf), len(w)
    z = [[math.tanh(age * v) for v in r] for r in cf]
    mask = [[(math.tanh(v + 1 / (age + 1)) + 1) / 2 for v in r] for r in mf]
    code = [[z[i][k] * w[k] for k in range(length)] for i in range(n)]
    trunc = [[mask[i][k] * code[i][k] for k in range(length)] for i in range(n)]
    binary = sum(1 - v * v for r in z for v in r) / (n * length)
    balance = sum((sum(z[i][k] for i in range(n)) / n) ** 2 for k in range(length)) / length
    mask_cond = sum((v * (1 - v)) ** 2 for r in mask for v in r) / (n * length)
    lengths = sum(mask[i][k] / lw[k] for i in range(n) for k in range(length)) / sum(1 / v for v in lw)
    return {
        "code_raw": z,
        "mask": mask,
        "code": code,
        "trunc_code": trunc,
        "code_cond": binary + balance,
        "mask_cond": mask_cond,
        "length": lengths,
    }


# --------------------------------------------------------------------------------------------- hand-computed cases
@pytest.mark.parametrize("smoothing", SMOOTHINGS)
def test_info_nce_hand_two_samples_1d(smoothing):
    # 2 samples in 1-D, rows [view0 s0, view0 s1, view1 s0, view1 s1] = [1, -1, 2, -3]; normalised: [1, -1, 1, -1].
    # Every row's positive (the other view) sits at distance 0 and its 2 negatives at distance 2, so with T = 1 the
    # 3 logits of every row are (0, -2, -2):
    #   -log p_pos        = log(e^0 + 2 e^-2) - 0            = log(1 + 2 e^-2)             = 0.2395447...
    #   mean_c(-log p_c)  = log(1 + 2 e^-2) - (0 - 2 - 2)/3  = log(1 + 2 e^-2) + 4/3
    #   l = (1 - s) * log(1 + 2 e^-2) + s * (log(1 + 2 e^-2) + 4/3) = log(1 + 2 e^-2) + 4 s / 3, the same for all rows.
    x = torch.tensor([[1.0], [-1.0], [2.0], [-3.0]], dtype=torch.float64)
    expected = math.log(1 + 2 * math.exp(-2)) + 4 * smoothing / 3
    _close(ref.info_nce_loss(x, 1.0, smoothing), expected, what="euclidean")
    _close(loop_info_nce(x, 1.0, smoothing), expected, what="loop")
    # Codes: every row of d is (0, 2, 0, 2) in some order, so every row sum is 4 and the logits are (0, -1/2, -1/2):
    #   l = log(1 + 2 e^-0.5) + s * (0 + 1/2 + 1/2) / 3 = log(1 + 2 e^-0.5) + s / 3   (the 1e-10 is far below rtol)
    expected = math.log(1 + 2 * math.exp(-0.5)) + smoothing / 3
    _close(ref.info_nce_loss(x, 1.0, smoothing, rowsum_normalize=True), expected, rtol=1e-9, what="code")
    # T = 0.5 doubles the logits: log(1 + 2 e^-4) + 8 s / 3.
    _close(ref.info_nce_loss(x, 0.5, smoothing), math.log(1 + 2 * math.exp(-4)) + 8 * smoothing / 3, what="T=0.5")


def test_supcon_hand_1d():
    # Rows (view-major) [0, 3, 0, 3] in 1-D with labels [0, 1, 0, 1]; tau = 0.5, base = 1 (the factor tau/base = 0.5).
    # Anchor 0: others are rows 1, 2, 3 at distances 3, 0, 3 -> logits -6, 0, -6; its only positive is row 2:
    #   log p_02 = 0 - log(2 e^-6 + 1);  loss_0 = -0.5 * log p_02 = 0.5 log(1 + 2 e^-6); every anchor is alike.
    x = torch.tensor([[0.0], [3.0], [0.0], [3.0]], dtype=torch.float64)
    _close(ref.supcon_loss(x, torch.tensor([0, 1, 0, 1]), 0.5, 1.0), 0.5 * math.log(1 + 2 * math.exp(-6)))
    # All one class: P(0) = {1, 2, 3}, mean log p = (-6 + 0 - 6)/3 - log(1 + 2 e^-6) -> 0.5 (4 + log(1 + 2 e^-6)).
    _close(ref.supcon_loss(x, torch.tensor([5, 5, 5, 5]), 0.5, 1.0), 0.5 * (4 + math.log(1 + 2 * math.exp(-6))))
    # Label -1 drops rows 1 and 3: rows 0 and 2 coincide, logits (0) only -> log p = 0 and the loss is 0.
    _close(ref.supcon_loss(x, torch.tensor([0, -1, 0, -1]), 0.5, 1.0), 0.0)
    # Codes, labels [0, 1, 0, 1]: each row of d is a permutation of (0, 3, 0, 3), row sum 6, so s = -d/6 in {0, -1/2},
    # /tau -> {0, -1}:  loss = 0.5 log(1 + 2 e^-1).
    value = ref.supcon_loss(x, torch.tensor([0, 1, 0, 1]), 0.5, 1.0, rowsum_normalize=True)
    _close(value, 0.5 * math.log(1 + 2 / math.e))


def test_code_head_hand():
    # age = 2, L = 2, two rows. code_feat = [[0.5, -0.5], [0.5, 0.5]] -> z = tanh(2 * +-0.5) = +-t, t = tanh(1).
    #   mean(1 - z^2) = 1 - t^2; column means (t, 0) -> balance = (t^2 + 0) / 2; code_cond = 1 - t^2 / 2.
    # mask_feat = -1/3 = -1/(age+1) everywhere -> mask = (tanh(0) + 1)/2 = 1/2; mask_cond = (1/2 * 1/2)^2 = 1/16.
    # length, base 2 (w = [1, 1/2], 1/w = [1, 2]): sum_i sum_k m_ik / w_k / (1 + 2) = 2 * (0.5 + 1) / 3 = 1.
    # code_weight base 4 (w = [1, 1/4]): code = [[t, -t/4], [t, t/4]], trunc_code = code / 2.
    t = math.tanh(1.0)
    cf = torch.tensor([[0.5, -0.5], [0.5, 0.5]], dtype=torch.float64)
    mf = torch.full((2, 2), -1 / 3, dtype=torch.float64)
    head = ref.code_head(cf, mf, 2.0, ref.positional_weights(2, 4.0), ref.positional_weights(2, 2.0))
    _close(head.code_cond, 1 - t * t / 2)
    _close(head.mask_cond, 1 / 16)
    _close(head.length, 1.0)
    _close(head.code, [[t, -t / 4], [t, t / 4]])
    _close(head.trunc_code, [[t / 2, -t / 8], [t / 2, t / 8]])
    _close(ref.positional_weights(3, 1.5, dtype=torch.float64), [1.0, 2 / 3, 4 / 9])


# --------------------------------------------------------------------------------------- oracle vs loop computations
@pytest.mark.parametrize("is_code", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("smoothing", SMOOTHINGS)
def test_info_nce_matches_loops(smoothing, temperature, is_code, gen):
    x = _rand(gen, 2 * B, D)
    _close(ref.info_nce_loss(x, temperature, smoothing, is_code), loop_info_nce(x, temperature, smoothing, is_code))


@pytest.mark.parametrize("is_code", [False, True])
@pytest.mark.parametrize("unlabelled", [False, True])
@pytest.mark.parametrize("temperature,base", [(0.07, 0.07), (0.5, 0.1)])
def test_supcon_matches_loops(temperature, base, unlabelled, is_code, gen):
    x, y = _rand(gen, 2 * B, D, scale=0.3), _labels(gen, unlabelled=unlabelled)
    _close(ref.supcon_loss(x, y, temperature, base, is_code), loop_supcon(x, y, temperature, base, is_code))


@pytest.mark.parametrize("is_code", [False, True])
def test_supcon_anchors_without_positive_are_left_out(is_code, gen):
    """Per-row labels (not repeated over views): anchors with no positive have no term and are not averaged in."""
    x = _rand(gen, 2 * B, D, scale=0.5)
    # 7 kept rows; only rows 0, 4 (class 0) and 2, 6 (class 2) have a positive, so the mean runs over those 4 anchors
    # (the loop skips the others), while rows 1, 5 and 7 still enter every denominator.
    y = torch.tensor([0, 1, 2, -1, 0, 3, 2, 4])
    _close(ref.supcon_loss(x, y, 0.3, 0.07, is_code), loop_supcon(x, y, 0.3, 0.07, is_code))
    distinct = torch.arange(2 * B)  # no anchor at all: 0, with a zero (finite) gradient
    value = ref.supcon_loss(x, distinct, rowsum_normalize=is_code)
    assert value.item() == 0.0 and torch.equal(torch.autograd.grad(value, x)[0], torch.zeros_like(x))


@pytest.mark.parametrize("base", [2.0, 1.3])
@pytest.mark.parametrize("age", AGES)
def test_code_head_matches_loops(age, base, gen):
    cf, mf = _rand(gen, 2 * B, 5), _rand(gen, 2 * B, 5)
    w, lw = ref.positional_weights(5, base, dtype=torch.float64), ref.positional_weights(5, 2.0, dtype=torch.float64)
    head, loops = ref.code_head(cf, mf, age, w, lw), loop_code_head(cf, mf, age, w, lw)
    for name, value in loops.items():
        _close(getattr(head, name), value, what=name)


# -------------------------------------------------------------------------------------------------------- gradients
def test_pairwise_distances_gradcheck_and_cdist(gen):
    x = _rand(gen, 2 * B, D)
    d = ref.pairwise_distances(x)
    _close(d, [[_euclid(a, b, math) for b in x.tolist()] for a in x.tolist()], what="loops")
    _close(d, torch.cdist(x, x), what="torch.cdist")
    assert torch.equal(d.diagonal(), torch.zeros(2 * B, dtype=torch.float64))
    assert torch.autograd.gradcheck(ref.pairwise_distances, (x,))


@pytest.mark.parametrize("is_code", [False, True])
@pytest.mark.parametrize("smoothing", SMOOTHINGS)
def test_info_nce_gradcheck(smoothing, is_code, gen):
    x = _rand(gen, 2 * B, D)
    assert torch.autograd.gradcheck(lambda t: ref.info_nce_loss(t, 0.7, smoothing, is_code), (x,))


@pytest.mark.parametrize("is_code", [False, True])
def test_supcon_gradcheck(is_code, gen):
    x = _rand(gen, 2 * B, D, scale=0.3)
    for y in (_labels(gen, unlabelled=False), _labels(gen, unlabelled=True)):
        assert torch.autograd.gradcheck(lambda t, y=y: ref.supcon_loss(t, y, 0.3, 0.07, is_code), (x,))


@pytest.mark.parametrize("age", AGES)
def test_code_head_gradcheck(age, gen):
    cf, mf = _rand(gen, 2 * B, 4, scale=min(1.0, 1 / age)), _rand(gen, 2 * B, 4)
    w, lw = ref.positional_weights(4, 1.4, dtype=torch.float64), ref.positional_weights(4, 2.0, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: tuple(ref.code_head(a, b, age, w, lw)), (cf, mf))


def _grad(fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    value = fn(x)
    (g,) = torch.autograd.grad(value, x)
    return value.detach(), g


@pytest.mark.parametrize("rows", ["exact", "random"])
@pytest.mark.parametrize("is_code", [False, True])
@pytest.mark.parametrize("term", ["info_nce", "supcon"])
def test_duplicate_rows_gradient(term, is_code, rows, gen):
    """Rows 1 and 7 identical (not a positive pair), and sample 2's two views identical (a zero-distance positive).

    "exact": +-1 entries in 4-D, whose normalised values (+-1/2) and Gram are exact, so a duplicate pair's distance is
    exactly 0 and everything must match to rounding. "random": Gaussian rows, where the Gram path leaves a duplicate
    pair at a distance of about |x| sqrt(eps) (~1e-8 in float64) instead of 0; value and gradient stay finite and
    within that noise of the analytic ones.
    """
    if rows == "exact":
        x = torch.randint(0, 2, (2 * B, 4), generator=gen).double() * 2 - 1
    else:
        x = torch.randn(2 * B, D, generator=gen, dtype=torch.float64)
    x[7], x[6] = x[1], x[2]
    if term == "info_nce":
        ours = lambda t: ref.info_nce_loss(t, 1.0, 0.3, is_code)
        loops = lambda t: loop_info_nce(t, 1.0, 0.3, is_code, m=TorchMath)
        theirs = lambda t: nn.CrossEntropyLoss(label_smoothing=0.3)(*orig.info_nce_logits(t, _ARGS, is_code))
    else:
        y = torch.tensor([0, 1, 2, 1] * 2)
        ours = lambda t: ref.supcon_loss(t, y, 0.2, 0.07, is_code)
        loops = lambda t: loop_supcon(t, y, 0.2, 0.07, is_code, m=TorchMath)
        theirs = lambda t: orig.SupConLoss(0.2, base_temperature=0.07)(_stack(t), labels=y[:B], is_code=is_code)
    value, grad = _grad(ours, x)
    assert torch.isfinite(grad).all(), f"non-finite gradient through a zero distance (seed {SEED})"
    expected_value, expected_grad = _grad(loops, x)
    scale = expected_grad.abs().max().item()
    rtol, gtol = (1e-11, 1e-10) if rows == "exact" else (1e-6, 1e-5)
    _close(value, expected_value, rtol=rtol, what="value")
    what = "gradient with the zero-distance pairs contributing 0"
    _close(grad, expected_grad, rtol=0, atol=gtol * scale, what=what)
    _close(grad, _grad(theirs, x)[1], rtol=0, atol=gtol * scale, what="gradient vs torch.cdist transcription")


# ------------------------------------------------------------------------------------ the original code transcribed
class _Args:
    n_views, temperature = 2, 1.0


_ARGS = _Args()


def _stack(x: torch.Tensor) -> torch.Tensor:
    """[2B, ...] view-major rows -> SupConLoss's [B, n_views, ...]."""
    return torch.stack(x.chunk(2), dim=1)


@pytest.mark.parametrize("is_code", [False, True])
@pytest.mark.parametrize("smoothing", SMOOTHINGS)
def test_info_nce_matches_original(smoothing, is_code, gen):
    x = _rand(gen, 2 * B, D)
    args = _Args()
    args.temperature = 0.6
    logits, targets = orig.info_nce_logits(x, args, is_code=is_code)
    assert logits.shape == (2 * B, 2 * B - 1)
    theirs = nn.CrossEntropyLoss(label_smoothing=smoothing)(logits, targets)
    ours = ref.info_nce_loss(x, 0.6, smoothing, is_code)
    _close(ours, theirs)
    _close(torch.autograd.grad(ours, x)[0], torch.autograd.grad(theirs, x)[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("is_code", [False, True])
def test_supcon_matches_original_and_minus_one_is_the_labelled_subset(is_code, gen):
    x = _rand(gen, 2 * B, D, scale=0.5)
    y = torch.tensor([3, 1, 3, 0])
    lab = torch.tensor([True, False, True, True])
    # All samples with their labels (the pseudo-label term).
    ours = ref.supcon_loss(x, y.repeat(2), rowsum_normalize=is_code)
    theirs = orig.SupConLoss()(_stack(x), labels=y, is_code=is_code)
    _close(ours, theirs)
    _close(torch.autograd.grad(ours, x)[0], torch.autograd.grad(theirs, x)[0], rtol=1e-10, atol=1e-12)
    # The ground-truth term: label -1 on unlabelled rows == SupConLoss on stack([F0[lab], F1[lab]], 1) with y[lab].
    ours = ref.supcon_loss(x, torch.where(lab, y, -1).repeat(2), rowsum_normalize=is_code)
    f0, f1 = x.chunk(2)
    theirs = orig.SupConLoss()(torch.stack([f0[lab], f1[lab]], 1), labels=y[lab], is_code=is_code)
    _close(ours, theirs)
    _close(torch.autograd.grad(ours, x)[0], torch.autograd.grad(theirs, x)[0], rtol=1e-10, atol=1e-12)
    _close(ours, ref.supcon_loss(torch.cat([f0[lab], f1[lab]]), y[lab].repeat(2), rowsum_normalize=is_code))


@pytest.mark.parametrize("weights", ["stale", "current"])
@pytest.mark.parametrize("age", AGES)
def test_code_head_matches_original(age, weights, gen):
    """DINOLABELLING's forward + HLoss + NormPLoss(p=1, code_weight) at L = 40 (docs/reference.md §2.3, §3.3-3.5)."""
    n, length, base = 2 * B, 40, 1.6
    cf, mf = _rand(gen, n, length), _rand(gen, n, length)
    code_weight = torch.pow(torch.tensor(base, dtype=torch.float64), torch.arange(0, -length, -1))  # CT.py:309
    initial = torch.pow(torch.tensor(2.0, dtype=torch.float64), torch.arange(0, -length, -1))  # CT.py:955
    norm_weight = initial if weights == "stale" else code_weight
    head = ref.code_head(cf, mf, age, ref.positional_weights(length, base, dtype=torch.float64), norm_weight)

    code_raw = torch.tanh(cf * age)
    mask = (torch.tanh(mf + 1 / (age + 1)) + 1) / 2.0
    code = code_raw * code_weight
    theirs = {
        "code_raw": code_raw,
        "mask": mask,
        "code": code,
        "trunc_code": mask * code,
        "code_cond": orig.HLoss(is_mask=False)(code_raw),
        "mask_cond": orig.HLoss(is_mask=True)(mask),
        "length": orig.NormPLoss(pnorm=1, code_weight=norm_weight)(mask),
    }
    for name, value in theirs.items():
        _close(getattr(head, name), value, what=name)
        if value.dim() == 0:
            ours_grads = torch.autograd.grad(
                getattr(head, name), (cf, mf), allow_unused=True, materialize_grads=True, retain_graph=True
            )
            their_grads = torch.autograd.grad(
                value, (cf, mf), allow_unused=True, materialize_grads=True, retain_graph=True
            )
            for a, b in zip(ours_grads, their_grads, strict=True):
                _close(a, b, rtol=1e-10, atol=1e-14, what=f"d {name}")
    # docs/reference.md §3.5: the stale length is a batch sum, sum_ik m_ik 2^k / (2^L - 1), no 1/N.
    if weights == "stale":
        k = torch.arange(length, dtype=torch.float64)
        _close(head.length, (mask * 2.0**k).sum() / (2.0**length - 1), what="batch-sum length")


def test_length_is_a_batch_sum_and_current_weights_differ(gen):
    """At the reference's start (mask ~ 0.86) the stale length is ~0.86 N, not a per-sample mean."""
    n, length = 32, 40
    mask_feat = torch.randn(n, length, generator=gen, dtype=torch.float64) * 1e-3
    stale = ref.code_head(mask_feat, mask_feat, 0.1, torch.ones(length), ref.positional_weights(length, 2.0)).length
    _close(stale, n * (math.tanh(1 / 1.1) + 1) / 2, rtol=1e-3, what="~0.86 N")
    current = ref.code_head(mask_feat, mask_feat, 0.1, torch.ones(length), ref.positional_weights(length, 1.5)).length
    assert abs(current.item() - stale.item()) > 1e-9 * n


# ------------------------------------------------------------------------------ docs/reference.md §3.9 sign property
@pytest.mark.parametrize("trial", range(3))
def test_smoothing_flips_the_sign_of_the_positive_distance_gradient(trial, gen, monkeypatch):
    """dL/d(d_pos) > 0 at s = 0 (positives pulled together) and < 0 at s = 1 when the positive is the nearest row.

    A shift t is added to every positive distance inside the oracle (wrapping its `pairwise_distances`), so dL/dt is
    the gradient through the positive distances alone; it must equal mean_i [(1 - s) + s / C - p_i,pos].
    """
    n = 16
    view0 = torch.randn(n // 2, 8, generator=gen, dtype=torch.float64)
    x = torch.cat([view0, view0 + 0.2 * torch.randn(n // 2, 8, generator=gen, dtype=torch.float64)])
    positive = torch.roll(torch.eye(n, dtype=torch.float64), n // 2, dims=1)
    distances = ref.pairwise_distances
    slopes = {}
    for s in (0.0, 0.5, 1.0):
        t = torch.zeros((), dtype=torch.float64, requires_grad=True)
        monkeypatch.setattr(ref, "pairwise_distances", lambda f, t=t: distances(f) + t * positive)
        (slopes[s],) = torch.autograd.grad(ref.info_nce_loss(x, 1.0, s), t)
        monkeypatch.setattr(ref, "pairwise_distances", distances)
        logits = (-distances(torch.nn.functional.normalize(x, dim=1))).masked_fill(
            torch.eye(n, dtype=torch.bool), -math.inf
        )
        p_pos = (torch.softmax(logits, dim=1) * positive).sum(1)
        _close(slopes[s], ((1 - s) + s / (n - 1) - p_pos).mean(), rtol=1e-10, what=f"dL/dt at s={s}")
    assert slopes[0.0] > 0, f"s=0 must pull positives together (seed {SEED})"
    assert slopes[1.0] < 0, f"s=1 pushes the nearest-row positives apart (seed {SEED})"
