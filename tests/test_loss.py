"""`InfoSieveLoss` (docs/reference.md §3.10) on hand-built `ModelOutput`s: the composition, the parity switches, the
pseudo-label/ground-truth handling, edge batches and the fp32 guarantee under autocast.

Every expected value is recomputed here from `kernels.reference` term by term, in a different way from the loss
(the ground-truth SupCon on the labelled subset rather than via -1 labels), or by hand with `math` for the
categorizer and the paper's code constraint.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
import torch.nn.functional as F

import infosieve_kernels as kernels
from infosieve_fast.config.settings import LossConfig
from infosieve_fast.network.loss import InfoSieveLoss
from infosieve_fast.network.model import ModelOutput
from infosieve_kernels import reference as ref

SEED = int(os.environ.get("INFOSIEVE_TEST_SEED", "0"))  # inputs: this and the test name; printed on failure
B, DIM, L, N_OLD = 4, 6, 5, 3
CUSTOM = LossConfig(
    alpha=0.7,
    beta=1.3,
    delta=0.2,
    zeta=0.05,
    mu=0.03,
    eta=0.11,
    sup_con_weight=0.25,
    sup_code_weight=0.45,
    temperature=0.8,
    supcon_temperature=0.1,
    label_smoothing=0.3,
)
PARTS = (
    "total in in_infonce in_supcon_gt in_supcon_pseudo code code_infonce code_supcon_gt code_supcon_pseudo "
    "code_cond mask_cond length category"
).split()


@pytest.fixture(autouse=True)
def _oracle_backend(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)


@pytest.fixture
def gen(request) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + sum(map(ord, request.node.name)))


class Batch:
    """Leaves (requires_grad) -> a ModelOutput as the model would build it, plus targets/labelled/pseudo-labels."""

    def __init__(self, gen, *, age=1.0, base=1.5, length_base=2.0, labelled=(True, True, False, False)):
        r = lambda *s: torch.randn(*s, generator=gen).requires_grad_(True)
        self.leaves = {"proj": r(2 * B, DIM), "code_feat": r(2 * B, L), "mask_feat": r(2 * B, L), "cat_w": r(L, N_OLD)}
        self.age, self.base, self.length_base = age, base, length_base
        self.labelled = torch.tensor(labelled)
        # Unlabelled samples may carry novel-class targets (>= n_old): they must be ignored.
        self.targets = torch.where(self.labelled, torch.randint(0, N_OLD, (B,), generator=gen), N_OLD + 1)
        self.pseudo = torch.randint(0, N_OLD + 2, (B,), generator=gen)

    def output(self) -> ModelOutput:
        v = self.leaves
        weights = ref.positional_weights(L, self.base), ref.positional_weights(L, self.length_base)
        head = ref.code_head(v["code_feat"], v["mask_feat"], self.age, *weights)
        projection = F.normalize(v["proj"], dim=1)
        return ModelOutput(v["proj"].detach(), projection, v["code_feat"], head, head.trunc_code @ v["cat_w"])

    def run(self, cfg: LossConfig, out: ModelOutput | None = None, **overrides):
        args = {"targets": self.targets, "labelled": self.labelled, "pseudo_labels": self.pseudo, **overrides}
        return InfoSieveLoss(cfg, N_OLD, backend="torch")(out or self.output(), **args)


def hand_bce(logits: torch.Tensor, classes: list[int]) -> float:
    """BCEWithLogits against one-hot targets, averaged over every element, by hand."""
    total, count = 0.0, 0
    for row, c in zip(logits.tolist(), classes, strict=True):
        for k, z in enumerate(row):
            p = 1 / (1 + math.exp(-z))
            total -= math.log(p) if k == c else math.log(1 - p)
            count += 1
    return total / count


def hand_ce(logits: torch.Tensor, classes: list[int]) -> float:
    rows = logits.tolist()
    return sum(math.log(sum(math.exp(z) for z in row)) - row[c] for row, c in zip(rows, classes, strict=True)) / len(
        rows
    )


def expected_parts(batch: Batch, out: ModelOutput, cfg: LossConfig, pseudo=None) -> dict[str, torch.Tensor]:
    """docs/reference.md §3.1-3.6/3.10 from the oracle's terms; the GT SupCon runs on the labelled rows only."""
    lab = batch.labelled
    y = batch.targets
    yhat = torch.where(lab, y, batch.pseudo if pseudo is None else pseudo)
    s, t, tau = cfg.label_smoothing, cfg.temperature, cfg.supcon_temperature
    sup_code = out.head.code if cfg.sup_code_input == "code" else out.head.trunc_code

    def labelled_rows(x):
        x0, x1 = x.chunk(2)
        return torch.cat([x0[lab], x1[lab]])

    def block(feats, sup_feats, is_code, weight):
        unsup = ref.info_nce_loss(feats, t, s, is_code)
        if lab.any():
            gt = ref.supcon_loss(labelled_rows(sup_feats), y[lab].repeat(2), tau, tau, is_code)
        else:
            gt = torch.zeros(())
        pseudo_term = ref.supcon_loss(sup_feats, yhat.repeat(2), tau, tau, is_code)
        return unsup, gt, pseudo_term, (1 - weight) * unsup + weight * (gt + pseudo_term) / 2

    p = {}
    p["in_infonce"], p["in_supcon_gt"], p["in_supcon_pseudo"], p["in"] = block(
        out.projection, out.projection, False, cfg.sup_con_weight
    )
    p["code_infonce"], p["code_supcon_gt"], p["code_supcon_pseudo"], p["code"] = block(
        out.head.code_raw, sup_code, True, cfg.sup_code_weight
    )
    z = out.head.code_raw
    # the paper's z01 = (z + 1) / 2: z01^2 (1 - z01)^2 = ((1 - z^2) / 4)^2 (hand-checked in test_paper_code_constraint)
    p["code_cond"] = out.head.code_cond if cfg.code_constraint == "reference" else ((1 - z * z) / 4).pow(2).mean()
    p["mask_cond"], p["length"] = out.head.mask_cond, out.head.length
    logits, classes = labelled_rows(out.category_logits), y[lab].repeat(2)
    if not len(classes):
        p["category"] = torch.zeros(())
    elif cfg.categorizer_loss == "bce":  # -log sigmoid(z) = softplus(-z), -log(1 - sigmoid(z)) = softplus(z)
        onehot = classes[:, None] == torch.arange(N_OLD)
        p["category"] = torch.where(onehot, F.softplus(-logits), F.softplus(logits)).mean()
    else:
        p["category"] = (logits.logsumexp(1) - logits.gather(1, classes[:, None])[:, 0]).mean()
    p["total"] = (
        cfg.alpha * p["in"]
        + cfg.beta * p["code"]
        + cfg.zeta * p["code_cond"]
        + cfg.eta * p["category"]
        + cfg.delta * p["length"]
        + cfg.mu * p["mask_cond"]
    )
    return p


def assert_parts(actual: dict, expected: dict, rtol=2e-5, atol=2e-6):
    assert set(actual) == set(PARTS)
    for name in PARTS:
        assert actual[name].dtype == torch.float32 and actual[name].shape == (), name
        torch.testing.assert_close(
            actual[name],
            expected[name].detach().float(),
            rtol=rtol,
            atol=atol,
            msg=lambda m, name=name: f"{name} (seed {SEED}): {m}",
        )


def assert_only_changed(a: dict, b: dict, changed: set[str]):
    """The named parts differ between the two runs (values checked elsewhere); the others are bit-identical."""
    for name in PARTS:
        if name in changed:
            assert not torch.equal(a[name], b[name]), f"{name} should change (seed {SEED})"
        else:
            assert torch.equal(a[name], b[name]), f"{name} should not change: {a[name]} vs {b[name]} (seed {SEED})"


# --------------------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize("cfg", [LossConfig(), CUSTOM], ids=["defaults", "custom"])
def test_total_is_the_documented_weighted_sum(cfg, gen):
    batch = Batch(gen)
    out = batch.output()
    total, parts = batch.run(cfg, out)
    expected = expected_parts(batch, out, cfg)
    assert_parts(parts, expected)
    assert total.requires_grad and torch.equal(total.detach(), parts["total"])
    leaves = list(batch.leaves.values())
    grads = torch.autograd.grad(total, leaves, retain_graph=True)
    want = torch.autograd.grad(expected["total"], leaves, allow_unused=True, materialize_grads=True)
    for name, g, w in zip(batch.leaves, grads, want, strict=True):
        scale = w.abs().max().item()
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * scale + 1e-7, msg=lambda m, n=name: f"d/d{n}: {m}")


def test_default_weights_are_the_reference_coefficients():
    cfg = LossConfig()  # docs/reference.md §3.8
    assert (cfg.alpha, cfg.beta, cfg.delta, cfg.zeta, cfg.mu, cfg.eta) == (1.0, 1.0, 0.1, 0.01, 0.01, 0.01)
    assert (cfg.sup_con_weight, cfg.sup_code_weight, cfg.temperature, cfg.supcon_temperature) == (0.35, 0.35, 1.0, 0.07)
    assert cfg.label_smoothing == 1.0
    assert (cfg.length_weights, cfg.sup_code_input, cfg.code_constraint, cfg.categorizer_loss) == (
        "stale",
        "code",
        "reference",
        "bce",
    )


# -------------------------------------------------------------------------------------------------- parity switches
def test_length_weights_switch_changes_only_the_length(gen):
    """The switch picks the labeller's length weights (engine: base 2 when "stale", this epoch's base when
    "current"); the loss reads the resulting head, so only `length` (and the total) move."""
    cfg_stale, cfg_current = LossConfig(), dataclasses.replace(LossConfig(), length_weights="current")
    batch = Batch(gen, base=1.3, length_base=2.0)
    _, stale = batch.run(cfg_stale)
    _, same = batch.run(cfg_current)  # the loss object itself ignores the switch: the head carries the weights
    assert all(torch.equal(stale[k], same[k]) for k in PARTS)
    batch.length_base = batch.base
    _, current = batch.run(cfg_current)
    assert_only_changed(stale, current, {"length", "total"})
    mask = batch.output().head.mask.detach().double()
    for parts, base in ((stale, 2.0), (current, 1.3)):  # sum_ik m_ik base^k / sum_k base^k, a batch sum
        powers = [base**k for k in range(L)]
        want = sum(mask[i, k].item() * powers[k] for i in range(2 * B) for k in range(L)) / sum(powers)
        assert parts["length"].item() == pytest.approx(want, rel=1e-6)


def test_sup_code_input_switch_changes_only_the_code_supcon(gen):
    batch = Batch(gen)
    out = batch.output()
    _, code = batch.run(LossConfig(), out)
    cfg = dataclasses.replace(LossConfig(), sup_code_input="trunc_code")
    _, trunc = batch.run(cfg, out)
    assert_only_changed(code, trunc, {"code_supcon_gt", "code_supcon_pseudo", "code", "total"})
    assert_parts(trunc, expected_parts(batch, out, cfg))


def test_code_constraint_switch_changes_only_code_cond(gen):
    batch = Batch(gen, age=3.0)
    out = batch.output()
    _, reference = batch.run(LossConfig(), out)
    cfg = dataclasses.replace(LossConfig(), code_constraint="paper")
    _, paper = batch.run(cfg, out)
    assert_only_changed(reference, paper, {"code_cond", "total"})
    assert_parts(paper, expected_parts(batch, out, cfg))


def test_paper_code_constraint_hand_value():
    # z = [[1, -1], [0, 0.5]] -> z01 = [[1, 0], [0.5, 0.75]] -> z01^2 (1 - z01)^2 = [[0, 0], [1/16, 9/256]];
    # mean = (16/256 + 9/256) / 4 = 25/1024.
    code_raw = torch.tensor([[1.0, -1.0], [0.0, 0.5]])
    head = ref.CodeHead(code_raw, *[torch.zeros(())] * 6)
    out = ModelOutput(code_raw, code_raw, code_raw, head, code_raw)
    loss = InfoSieveLoss(dataclasses.replace(LossConfig(), code_constraint="paper"), N_OLD)
    assert loss._code_constraint(out).item() == pytest.approx(25 / 1024, rel=1e-6)


@pytest.mark.parametrize("kind", ["bce", "ce"])
def test_categorizer_switch_and_hand_values(kind, gen):
    batch = Batch(gen)
    out = batch.output()
    _, bce = batch.run(LossConfig(), out)
    cfg = dataclasses.replace(LossConfig(), categorizer_loss=kind)
    _, parts = batch.run(cfg, out)
    assert_only_changed(bce, parts, set() if kind == "bce" else {"category", "total"})
    lab2 = batch.labelled.repeat(2)
    logits, classes = out.category_logits[lab2].detach(), batch.targets.repeat(2)[lab2].tolist()
    want = hand_bce(logits, classes) if kind == "bce" else hand_ce(logits, classes)
    assert parts["category"].item() == pytest.approx(want, rel=1e-5)


def test_categorizer_hand_numbers():
    # One labelled sample of class 1, two views, n_old = 2, logits [0, ln 3] on both views:
    #   BCE: sigmoid(0) = 1/2 -> -log(1 - 1/2) = ln 2; sigmoid(ln 3) = 3/4 -> -log(3/4); mean over 4 elements
    #        = (ln 2 + ln(4/3)) / 2 = ln(8/3) / 2.
    #   CE:  softmax = [1/4, 3/4] -> -log(3/4) = ln(4/3) per row.
    logits = torch.tensor([[0.0, math.log(3.0)]] * 2)
    assert hand_bce(logits, [1, 1]) == pytest.approx(math.log(8 / 3) / 2)
    assert hand_ce(logits, [1, 1]) == pytest.approx(math.log(4 / 3))
    for kind, want in (("bce", math.log(8 / 3) / 2), ("ce", math.log(4 / 3))):
        loss = InfoSieveLoss(dataclasses.replace(LossConfig(), categorizer_loss=kind), n_old=2)
        labelled = torch.tensor([True, True])
        assert loss._category(logits, torch.tensor([1, 1]), labelled).item() == pytest.approx(want, rel=1e-6)
        # An unlabelled row (any target, even outside the known classes) changes nothing.
        rows = torch.cat([logits, torch.tensor([[5.0, -3.0]])])
        got = loss._category(rows, torch.tensor([1, 1, 7]), torch.tensor([True, True, False])).item()
        assert got == pytest.approx(want, rel=1e-6)


# ----------------------------------------------------------------------------------------- labels and edge batches
def test_pseudo_label_supcon_uses_ground_truth_on_labelled_samples(gen):
    batch = Batch(gen, labelled=(True, False, True, False))
    out = batch.output()
    # GT puts samples 0 and 2 apart; their raw pseudo-labels put them together (a different partition).
    batch.targets = torch.tensor([0, N_OLD + 1, 1, N_OLD + 1])
    batch.pseudo = torch.tensor([2, 3, 2, 4])
    _, parts = batch.run(CUSTOM, out)
    assert_parts(parts, expected_parts(batch, out, CUSTOM))
    raw = ref.supcon_loss(out.projection, batch.pseudo.repeat(2), 0.1, 0.1).item()
    assert abs(parts["in_supcon_pseudo"].item() - raw) > 1e-4, "the raw pseudo-labels of labelled samples were used"
    # Pseudo-labels of labelled samples are irrelevant; an unlabelled sample's pseudo-label moves only the pseudo terms.
    _, again = batch.run(CUSTOM, out, pseudo_labels=torch.where(batch.labelled, N_OLD + 7, batch.pseudo))
    assert_only_changed(parts, again, set())
    moved = batch.pseudo.clone()
    moved[1] = moved[3]  # unlabelled samples 1 and 3 now share a pseudo-class
    _, other = batch.run(CUSTOM, out, pseudo_labels=moved)
    assert_parts(other, expected_parts(batch, out, CUSTOM, pseudo=moved))
    assert_only_changed(parts, other, {"in_supcon_pseudo", "code_supcon_pseudo", "in", "code", "total"})


def test_batch_without_labelled_samples(gen):
    batch = Batch(gen, labelled=(False,) * B)
    out = batch.output()
    total, parts = batch.run(CUSTOM, out)
    for name in ("in_supcon_gt", "code_supcon_gt", "category"):
        assert parts[name].item() == 0.0, name
    assert all(torch.isfinite(v) for v in parts.values())
    assert_parts(parts, expected_parts(batch, out, CUSTOM))
    grads = torch.autograd.grad(total, list(batch.leaves.values()), allow_unused=True, materialize_grads=True)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("bad", [N_OLD, N_OLD + 5, -1])
def test_labelled_targets_outside_the_known_classes_raise(bad, gen):
    batch = Batch(gen)
    targets = batch.targets.clone()
    targets[0] = bad  # sample 0 is labelled
    with pytest.raises(ValueError, match="known classes"):
        batch.run(LossConfig(), targets=targets)
    batch.run(LossConfig(), targets=torch.where(batch.labelled, batch.targets, bad))  # unlabelled: ignored


# -------------------------------------------------------------------------------------------------------- precision
def test_fp32_under_cpu_bf16_autocast(gen):
    batch = Batch(gen)
    out = batch.output()
    _, fp32 = batch.run(CUSTOM, out)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probe = out.projection @ out.projection.T
        total, parts = batch.run(CUSTOM, out)
    assert probe.dtype == torch.bfloat16, "the autocast context is not active, the test would prove nothing"
    assert total.dtype == torch.float32
    assert_parts(parts, fp32, rtol=1e-6, atol=1e-7)
    (g,) = torch.autograd.grad(total, batch.leaves["proj"])
    assert g.dtype == torch.float32 and torch.isfinite(g).all()
