"""SimGCD's head and loss (`infosieve_fast.methods.simgcd`) against the published step transcribed in
`benchmarks/published/simgcd.py` (docs/reference.md §12.2): loss terms and gradients through the head, fp32; the
teacher-temperature schedule and the entropy regulariser as properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks.published.simgcd import DistillLoss, SimGCDHead, simgcd_loss
from infosieve_fast.methods import SimGCD, StepTensors
from infosieve_fast.methods.simgcd import HEAD, TEACHER, PrototypeHead, mean_entropy_gap, teacher_temperature
from tests.methods_helpers import assert_close, batch

B, FEAT, N_CLASSES, N_OLD, EPOCHS = 8, 24, 6, 3, 200


def _pair(seed: int):
    """The published head and the fast side's pieces with the same weights: its MLP (the shared projection head's
    job) and a PrototypeHead holding the published last layer."""
    torch.manual_seed(seed)
    published = SimGCDHead(FEAT, N_CLASSES, hidden_dim=32, bottleneck_dim=16)
    prototypes = PrototypeHead(FEAT, N_CLASSES)
    prototypes.last_layer.weight_v.data.copy_(published.last_layer.weight_v.data)
    mlp = SimGCDHead(FEAT, N_CLASSES, hidden_dim=32, bottleneck_dim=16).mlp
    mlp.load_state_dict(published.mlp.state_dict())
    return published, prototypes, mlp


def test_prototype_head_is_the_published_weight_normed_layer_on_normalised_features():
    published, prototypes, _ = _pair(0)
    x = torch.randn(2 * B, FEAT) * 5
    x_fast, x_pub = x.clone().requires_grad_(), x.clone().requires_grad_()
    logits = prototypes(x_fast)
    _, pub_logits = published(x_pub)
    assert_close(logits, pub_logits, 1e-6, "logits")
    assert logits.abs().max() <= 1 + 1e-6  # cosines: unit rows times a unit input
    logits.square().sum().backward()
    pub_logits.square().sum().backward()
    assert_close(x_fast.grad, x_pub.grad, 1e-5, "d / d features")
    assert_close(prototypes.last_layer.weight_v.grad, published.last_layer.weight_v.grad, 1e-5, "d / d weight_v")
    assert not prototypes.last_layer.weight_g.requires_grad and torch.all(prototypes.last_layer.weight_g == 1)


@pytest.mark.parametrize("seed, epoch", [(0, 0), (1, 13), (2, 29), (3, 120)])
def test_terms_and_gradients_equal_the_published_step(seed, epoch):
    published, prototypes, mlp = _pair(seed)
    feats = torch.randn(2 * B, FEAT) * 2
    targets, labelled = batch(seed, B, N_CLASSES, N_OLD)
    feats_fast, feats_pub = feats.clone().requires_grad_(), feats.clone().requires_grad_()
    method = SimGCD(memax_weight=2.0)
    method.set_epoch(epoch)
    heads = {HEAD: prototypes(feats_fast)}
    step = StepTensors(backbone=feats_fast, projection=mlp(feats_fast), targets=targets, labelled=labelled, heads=heads)
    total, parts = method(step)
    x_proj, logits = published(feats_pub)
    criterion = DistillLoss(30, EPOCHS)
    pub_total, pub_parts = simgcd_loss(x_proj, logits, targets, labelled, epoch, criterion, memax_weight=2.0)
    for name, value in pub_parts.items():
        assert_close(parts[name], value, 2e-6, name)
    assert_close(total, pub_total, 2e-6, "total")
    total.backward()
    pub_total.backward()
    assert_close(feats_fast.grad, feats_pub.grad, 1e-5, "d total / d backbone features")
    assert_close(prototypes.last_layer.weight_v.grad, published.last_layer.weight_v.grad, 1e-5, "d / d prototypes")
    for (name, p), q in zip(mlp.named_parameters(), published.mlp.parameters(), strict=True):
        assert_close(p.grad, q.grad, 1e-5, f"d / d mlp.{name}")


def test_teacher_temperature_warms_from_007_to_004_over_30_epochs_then_stays():
    table = np.linspace(0.07, 0.04, 30)  # the published table's warm-up part
    values = [teacher_temperature(e) for e in range(EPOCHS)]
    assert np.allclose(values[:30], table, rtol=0, atol=1e-15)
    assert values[0] == 0.07 and all(v == 0.04 for v in values[29:])
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    method = SimGCD()
    method.set_epoch(7)
    assert method.teacher_temperature.item() == pytest.approx(table[7], abs=1e-8)  # fp32 buffer
    with pytest.raises(ValueError, match="epoch"):
        teacher_temperature(-1)


def test_mean_entropy_term_is_log_k_minus_the_entropy_and_descends_towards_uniform():
    uniform = torch.zeros(2 * B, N_CLASSES)
    assert mean_entropy_gap(uniform).abs().item() < 1e-6
    logits = torch.randn(2 * B, N_CLASSES) * 4
    logits[:, 0] += 5  # a batch leaning towards class 0
    logits.requires_grad_()
    gap = mean_entropy_gap(logits)
    p = torch.softmax(logits, 1).mean(0)
    entropy = -(p * p.log()).sum()
    assert gap.item() == pytest.approx(math.log(N_CLASSES) - entropy.item(), abs=1e-6)
    assert gap.item() > 0
    gap.backward()
    stepped = torch.softmax(logits.detach() - 0.5 * logits.grad, 1).mean(0)
    assert -(stepped * stepped.log()).sum() > entropy  # descending the term raises the mean prediction's entropy


def test_a_separate_teacher_replaces_the_detached_student_only_in_the_distillation():
    _, prototypes, mlp = _pair(4)
    feats = torch.randn(2 * B, FEAT)
    targets, labelled = batch(4, B, N_CLASSES, N_OLD)
    logits = prototypes(feats)
    teacher = torch.randn(2 * B, N_CLASSES) * 0.3
    method = SimGCD()
    method.set_epoch(40)
    base = StepTensors(feats, mlp(feats), targets, labelled, heads={HEAD: logits})
    own = StepTensors(feats, base.projection, targets, labelled, heads={HEAD: logits, TEACHER: teacher})
    _, parts = method(base)
    _, parts_own = method(own)
    expected = DistillLoss(30, EPOCHS)(logits, teacher, 40)
    assert_close(parts_own["distill"], expected, 1e-6, "distill with a separate teacher")
    assert not torch.allclose(parts_own["distill"], parts["distill"])
    for name in ("cls", "memax", "infonce", "supcon"):
        assert torch.equal(parts_own[name], parts[name])


def test_the_loss_traces_as_one_graph_without_breaks():
    """No host sync or data-dependent Python branch in the step's loss: dynamo sees one graph (the teacher
    temperature is a buffer, so a new epoch needs no new graph)."""
    _, prototypes, mlp = _pair(5)
    targets, labelled = batch(5, B, N_CLASSES, N_OLD)
    method = SimGCD()
    method.set_epoch(3)

    def loss(feats):
        step = StepTensors(feats, mlp(feats), targets, labelled, heads={HEAD: prototypes(feats)})
        return method(step)[0]

    explained = torch._dynamo.explain(loss)(torch.randn(2 * B, FEAT))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
