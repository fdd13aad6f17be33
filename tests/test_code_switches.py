"""The code-learning switches of `LossConfig` (docs/tree.md): defaults bit-identical to the reference, each switch
against a hand-computed case, both kernel backends, and the config checks.

Hand case: B = 2 samples, 2 views, 2 digits. Rows [s0 view0, s1 view0, s0 view1, s1 view1] with codes (1, 0), (0, 1),
(1, 0), (0, 1): every row's positive is at distance 0 and its two negatives at sqrt(2) (normalised codes).
- Row-sum (reference): each column sums to 2 sqrt(2), so the logits are 0 and -1/2 / T twice:
  InfoNCE(eps) = log(1 + 2 exp(-1/(2T))) + eps (2/3) / (2T).
- Euclidean: logits 0 and -sqrt(2)/T: InfoNCE(eps) = log(1 + 2 exp(-sqrt(2)/T)) + eps (2/3) sqrt(2)/T
  ((1 - eps)(-log p_pos) + eps mean_c(-log p_c), the mean over the 3 candidates adding eps * 2 sqrt(2)/(3T)).
- SupCon (pseudo-labels s0 -> 0, s1 -> 1, no labelled sample) on the weighted code, weights (1, 1/2): rows (1, 0) and
  (0, 1/2), negatives at sqrt(1 + 1/4); Euclidean: log(1 + 2 exp(-sqrt(5/4)/tau)) per anchor. The ground-truth term
  has no anchor: 0.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import infosieve_kernels as kernels
from infosieve_fast.config.settings import ConfigError, LossConfig, load_config
from infosieve_fast.network.loss import InfoSieveLoss
from infosieve_fast.network.model import ModelOutput
from infosieve_kernels import reference as ref
from tests.test_loss import PARTS, Batch, assert_only_changed, assert_parts, expected_parts

N_OLD = 3
TREE = dict(code_distance="euclidean", code_temperature=0.2, code_supcon_temperature=0.1, code_label_smoothing=0.0)


@pytest.fixture(autouse=True)
def _oracle_backend(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)


def hand_output() -> ModelOutput:
    code_raw = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    w = torch.tensor([1.0, 0.5])
    zero = torch.zeros(())
    head = ref.CodeHead(code_raw, torch.ones(4, 2), code_raw * w, code_raw * w, zero, zero, zero)
    projection = F.normalize(torch.arange(12.0).reshape(4, 3) + 1, dim=1)
    return ModelOutput(projection, projection, code_raw, head, torch.zeros(4, N_OLD))


def hand_parts(**switches) -> dict[str, torch.Tensor]:
    loss = InfoSieveLoss(dataclasses.replace(LossConfig(), **switches), N_OLD, backend="torch")
    no_label = torch.tensor([False, False])
    _, parts = loss(hand_output(), torch.tensor([0, 1]), no_label, torch.tensor([0, 1]))
    return parts


def test_defaults_are_the_reference_and_explicit_copies_change_nothing():
    cfg = LossConfig()
    assert (cfg.code_distance, cfg.code_temperature, cfg.code_supcon_temperature, cfg.code_label_smoothing) == (
        "rowsum",
        None,
        None,
        None,
    )
    assert InfoSieveLoss(cfg, N_OLD)._settings(True) == (1.0, 1.0, 0.07, True)
    assert InfoSieveLoss(cfg, N_OLD)._settings(False) == (1.0, 1.0, 0.07, False)
    gen = torch.Generator().manual_seed(0)
    batch = Batch(gen)
    out = batch.output()
    _, default = batch.run(cfg, out)
    same = dataclasses.replace(cfg, code_temperature=1.0, code_supcon_temperature=0.07, code_label_smoothing=1.0)
    _, explicit = batch.run(same, out)
    assert_only_changed(default, explicit, set())  # bit-identical


def test_rowsum_code_infonce_by_hand_sits_near_chance():
    a = 0.5  # the negatives' logit magnitude, whatever the codes: |d| / (row sum) = sqrt(2) / (2 sqrt(2))
    for eps in (1.0, 0.0):  # the reference's smoothing 1, then none
        parts = hand_parts(code_label_smoothing=eps)
        assert parts["code_infonce"].item() == pytest.approx(math.log(1 + 2 * math.exp(-a)) + eps * 2 * a / 3, rel=1e-6)
    assert hand_parts()["code_infonce"] == hand_parts(code_label_smoothing=1.0)["code_infonce"]


@pytest.mark.parametrize("t, eps", [(1.0, 0.0), (0.2, 0.0), (0.2, 0.3), (0.5, 1.0)])
def test_euclidean_code_infonce_by_hand(t, eps):
    parts = hand_parts(code_distance="euclidean", code_temperature=t, code_label_smoothing=eps)
    s = math.sqrt(2) / t
    want = math.log(1 + 2 * math.exp(-s)) + eps * 2 * s / 3
    assert parts["code_infonce"].item() == pytest.approx(want, rel=1e-5, abs=1e-6)  # fp32
    assert parts["in_infonce"].item() == pytest.approx(hand_parts()["in_infonce"].item(), rel=0, abs=0)


@pytest.mark.parametrize("tau", [0.5, 2.0])  # a loss well above fp32 resolution
def test_euclidean_code_supcon_by_hand(tau):
    parts = hand_parts(code_distance="euclidean", code_supcon_temperature=tau)
    want = math.log(1 + 2 * math.exp(-math.sqrt(1.25) / tau))
    assert parts["code_supcon_pseudo"].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert parts["code_supcon_gt"].item() == 0.0
    # row-sum: each column of the weighted codes sums to 2 sqrt(5/4), so the negatives' logits are -1/2 / tau
    parts = hand_parts(code_supcon_temperature=tau)
    assert parts["code_supcon_pseudo"].item() == pytest.approx(math.log(1 + 2 * math.exp(-0.5 / tau)), rel=1e-5)


def test_each_switch_moves_only_the_code_terms():
    gen = torch.Generator().manual_seed(1)
    batch = Batch(gen, age=2.0)
    out = batch.output()
    _, reference = batch.run(LossConfig(), out)
    code = {"code", "total"}
    for switch, changed in (
        ({"code_distance": "euclidean"}, code | {"code_infonce", "code_supcon_gt", "code_supcon_pseudo"}),
        ({"code_temperature": 0.3}, code | {"code_infonce"}),
        ({"code_label_smoothing": 0.0}, code | {"code_infonce"}),
        ({"code_supcon_temperature": 0.2}, code | {"code_supcon_gt", "code_supcon_pseudo"}),
        ({"code_infonce_input": "code"}, code | {"code_infonce"}),
    ):
        _, parts = batch.run(dataclasses.replace(LossConfig(), **switch), out)
        assert_only_changed(reference, parts, changed)


def test_tree_settings_compose_as_documented():
    """The whole loss under the tree switches: `test_loss.expected_parts` (the input terms and the regularisers) with
    the code terms recomputed from the oracle with Euclidean distances and the code T / smoothing / tau."""
    gen = torch.Generator().manual_seed(2)
    batch = Batch(gen, age=2.0)
    out = batch.output()
    cfg = dataclasses.replace(LossConfig(), **TREE)
    _, parts = batch.run(cfg, out)
    want = expected_parts(batch, out, cfg)  # its code block uses the input's settings: replaced below
    lab, y = batch.labelled, batch.targets
    code = out.head.code
    code_lab = torch.cat([code.chunk(2)[0][lab], code.chunk(2)[1][lab]])
    want["code_infonce"] = ref.info_nce_loss(out.head.code_raw, 0.2, 0.0, False)
    want["code_supcon_gt"] = ref.supcon_loss(code_lab, y[lab].repeat(2), 0.1, 0.1, False)
    want["code_supcon_pseudo"] = ref.supcon_loss(code, torch.where(lab, y, batch.pseudo).repeat(2), 0.1, 0.1, False)
    w = cfg.sup_code_weight
    want["code"] = (1 - w) * want["code_infonce"] + w * (want["code_supcon_gt"] + want["code_supcon_pseudo"]) / 2
    want["total"] = (
        cfg.alpha * want["in"]
        + cfg.beta * want["code"]
        + cfg.zeta * want["code_cond"]
        + cfg.eta * want["category"]
        + cfg.delta * want["length"]
        + cfg.mu * want["mask_cond"]
    )
    assert_parts(parts, want)


def test_triton_kernels_run_the_tree_switches():
    """Every switch value is a plain argument of the fused kernels (no fallback needed): the Triton path (the
    interpreter on the CPU) matches the reference under the tree settings, values and gradients."""
    gen = torch.Generator().manual_seed(3)
    batch = Batch(gen, age=2.0)
    cfg = dataclasses.replace(LossConfig(), **TREE)
    leaves = list(batch.leaves.values())
    results = {}
    for backend in ("torch", "triton"):
        args = {"targets": batch.targets, "labelled": batch.labelled, "pseudo_labels": batch.pseudo}
        total, parts = InfoSieveLoss(cfg, N_OLD, backend=backend)(batch.output(), **args)
        grads = torch.autograd.grad(total, leaves, allow_unused=True, materialize_grads=True)
        results[backend] = (parts, grads)
    (p_ref, g_ref), (p_tri, g_tri) = results["torch"], results["triton"]
    for k in PARTS:
        torch.testing.assert_close(p_tri[k], p_ref[k], rtol=1e-5, atol=1e-6, msg=k)
    for a, b in zip(g_tri, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_config_checks_and_the_tree_configs():
    for bad in ("loss.code_label_smoothing=1.5", "loss.code_temperature=0", "loss.code_supcon_temperature=-1"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="loss.code_distance must be one of"):
        load_config(None, ["loss.code_distance=cosine"])
    for name in ("demo-tree", "cub100-tree"):
        cfg = load_config(f"configs/{name}.yaml")
        assert cfg.loss.code_distance == "euclidean" and cfg.loss.code_label_smoothing == 0.0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_code_infonce_on_the_weighted_code(backend):
    """`code_infonce_input: code`: the code InfoNCE of the positionally weighted code (the oracle on `head.code`);
    with `sup_code_input: code` both code terms then share one Gram matrix, which must not change the SupCon terms."""
    gen = torch.Generator().manual_seed(3)
    batch = Batch(gen, age=2.0)
    out = batch.output()
    cfg = dataclasses.replace(LossConfig(), **TREE, code_infonce_input="code")

    def run(c):
        return InfoSieveLoss(c, N_OLD, backend=backend)(out, batch.targets, batch.labelled, batch.pseudo)[1]

    parts = run(cfg)
    want = ref.info_nce_loss(out.head.code, 0.2, 0.0, False)
    torch.testing.assert_close(parts["code_infonce"], want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(want, ref.info_nce_loss(out.head.code_raw, 0.2, 0.0, False))  # the weights matter here
    raw = run(dataclasses.replace(cfg, code_infonce_input="code_raw"))
    for term in ("code_supcon_gt", "code_supcon_pseudo"):
        torch.testing.assert_close(parts[term], raw[term], rtol=1e-6, atol=1e-7)
