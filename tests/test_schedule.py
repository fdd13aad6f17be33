import math

import pytest
import torch

from infosieve_fast.config.settings import OptimConfig, ScheduleConfig
from infosieve_fast.training.schedule import epoch_schedule


def test_age_and_base_match_the_reference_at_200_epochs():
    sched, optim = ScheduleConfig(epochs=200), OptimConfig()
    for e in (0, 9, 99, 199):
        s = epoch_schedule(e, sched, optim)
        assert s.age == pytest.approx((e + 1) / 10)  # CT.py:308
        assert s.base == pytest.approx(2 - e / 200)  # CT.py:309
    assert epoch_schedule(199, sched, optim).base == pytest.approx(1.005)


def test_short_runs_still_reach_full_binarisation():
    sched = ScheduleConfig(epochs=10)
    assert epoch_schedule(9, sched, OptimConfig()).age == pytest.approx(20.0)
    assert math.tanh(20.0 * 0.2) > 0.999  # a bit at 0.2 is binarised at the last epoch


def test_cosine_lr_equals_torch_cosine_annealing_stepped_per_epoch():
    optim, sched = OptimConfig(lr=0.1, min_lr_ratio=1e-3), ScheduleConfig(epochs=7)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    torch_sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=7, eta_min=1e-4)
    for e in range(7):
        assert epoch_schedule(e, sched, optim).lr == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9)
        opt.step()
        torch_sched.step()


def test_epoch_out_of_range():
    with pytest.raises(ValueError, match="outside"):
        epoch_schedule(5, ScheduleConfig(epochs=5), OptimConfig())
