"""Per-epoch schedules: model age, positional base, learning rate (docs/reference.md §2.3, §4)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.settings import OptimConfig, ScheduleConfig


@dataclass(frozen=True)
class EpochSchedule:
    epoch: int
    age: float
    base: float
    lr: float


def age(epoch: int, epochs: int, age_max: float) -> float:
    """age_max * (epoch+1) / epochs: the reference's (epoch+1)/10 at 200 epochs, and full binarisation in short runs."""
    return age_max * (epoch + 1) / epochs


def positional_base(epoch: int, epochs: int, base_start: float = 2.0) -> float:
    """base_start - epoch / epochs: 2 at the first epoch, 1.005 at the last of 200 (docs/reference.md §2.3)."""
    return base_start - epoch / epochs


def cosine_lr(epoch: int, epochs: int, lr: float, min_lr_ratio: float) -> float:
    """CosineAnnealingLR(T_max=epochs, eta_min=lr*min_lr_ratio) stepped once per epoch."""
    eta_min = lr * min_lr_ratio
    return eta_min + (lr - eta_min) * (1 + math.cos(math.pi * epoch / epochs)) / 2


def epoch_schedule(epoch: int, sched: ScheduleConfig, optim: OptimConfig) -> EpochSchedule:
    if not 0 <= epoch < sched.epochs:
        raise ValueError(f"epoch {epoch} outside 0..{sched.epochs - 1}")
    return EpochSchedule(
        epoch=epoch,
        age=age(epoch, sched.epochs, sched.age_max),
        base=positional_base(epoch, sched.epochs, sched.base_start),
        lr=cosine_lr(epoch, sched.epochs, optim.lr, optim.min_lr_ratio),
    )
