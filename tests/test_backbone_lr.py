"""`optim.backbone_lr_scale`: the trained backbone blocks step at a share of the scheduled lr, the heads at all of it;
1.0 (the reference) keeps one parameter group, as older checkpoints' optimizer states have."""

import copy

import pytest
import torch

from infosieve_fast.config.settings import ConfigError, load_config
from infosieve_fast.training.engine import Trainer
from infosieve_fast.training.schedule import epoch_schedule
from infosieve_fast.training.trainer_setup import build_optimizer, load_optimizer_state
from tests.test_compiling import SMALL as COMPILING_SMALL

SMALL = [*COMPILING_SMALL, "optim.name=sgd", "optim.momentum=0.0", "optim.weight_decay=0.0"]  # plain SGD steps


def trainer(*extra) -> Trainer:
    torch.manual_seed(0)
    return Trainer(load_config("configs/demo.yaml", [*SMALL, *extra]))


def trainable_ids(module: torch.nn.Module) -> set[int]:
    return {id(p) for p in module.parameters() if p.requires_grad}


def test_the_backbone_and_the_heads_get_their_own_groups_and_lrs():
    t = trainer("optim.backbone_lr_scale=0.1")
    lr = t.cfg.optim.lr
    backbone, head = t.optimizer.param_groups
    assert {id(p) for p in backbone["params"]} == trainable_ids(t.model.backbone)
    assert {id(p) for p in head["params"]} == trainable_ids(t.model) - trainable_ids(t.model.backbone)
    assert (backbone["lr"], head["lr"]) == (pytest.approx(0.1 * lr), lr)
    reference = trainer()
    (group,) = reference.optimizer.param_groups
    assert {id(p) for p in group["params"]} == trainable_ids(reference.model)


def test_one_plain_sgd_step_moves_the_backbone_by_the_share_of_lr():
    t = trainer("optim.backbone_lr_scale=0.25")
    lr, backbone = t.cfg.optim.lr, trainable_ids(t.model.backbone)
    params = [p for p in t.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    t.optimizer.step()
    for p, old in zip(params, before, strict=True):
        scale = 0.25 if id(p) in backbone else 1.0
        torch.testing.assert_close(p.detach(), old - lr * scale * p.grad, rtol=1e-5, atol=1e-7)


def test_each_epoch_schedules_every_group_at_its_share():
    t = trainer("optim.backbone_lr_scale=0.5", "schedule.epochs=4")
    t.train_epoch(2)
    lr = epoch_schedule(2, t.cfg.schedule, t.cfg.optim).lr
    assert [g["lr"] for g in t.optimizer.param_groups] == [pytest.approx(0.5 * lr), pytest.approx(lr)]


def test_an_older_checkpoints_optimizer_state_loads_and_keeps_this_configs_shares():
    t = trainer()
    saved = copy.deepcopy(t.optimizer.state_dict())
    for group in saved["param_groups"]:
        del group["lr_scale"]  # written before the setting existed
    load_optimizer_state(t.optimizer, saved)
    assert [g["lr_scale"] for g in t.optimizer.param_groups] == [1.0]


def test_moving_the_share_to_or_from_one_on_resume_is_refused_with_the_fix():
    t = trainer()
    scaled = build_optimizer(
        t.model, load_config("configs/demo.yaml", [*SMALL, "optim.backbone_lr_scale=0.1"]).optim, t.device
    )
    with pytest.raises(
        ConfigError,
        match=r"1 parameter group\(s\), this config 2: optim.backbone_lr_scale .* "
        r"Resume with the run's value",
    ):
        load_optimizer_state(scaled, t.optimizer.state_dict())
