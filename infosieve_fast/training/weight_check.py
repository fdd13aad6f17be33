"""The weights checked for NaN/inf once per epoch, before its checkpoint is written: a step can leave the loss it
reported finite and the weights it updated not (an lr of 1e308 does), and a checkpoint of such weights would be
resumed from, evaluated and blamed on the data ("u_feats contains NaN"). One read of the device per epoch, none per
step."""

from __future__ import annotations

import torch

from .loss_monitor import NonFiniteLoss


class NonFiniteWeights(NonFiniteLoss):
    pass


def check_weights(model: torch.nn.Module, epoch: int, lr: float) -> None:
    """Raise `NonFiniteWeights` naming the tensors and the setting to change when any floating weight or buffer of
    `model` is NaN or inf after `epoch` (0-based)."""
    tensors = [(name, t) for name, t in model.state_dict().items() if t.is_floating_point()]
    if not tensors:
        return
    finite = torch.stack([torch.isfinite(t).all() for _, t in tensors]).tolist()
    bad = [name for (name, _), ok in zip(tensors, finite, strict=True) if not ok]
    if bad:
        raise NonFiniteWeights(
            f"training diverged in epoch {epoch + 1}: {len(bad)} of {len(tensors)} weight tensors are NaN or inf "
            f"(first: {bad[0]}); lower optim.lr (now {lr:g}) or try train.amp=off. This epoch's checkpoint was not "
            "written: the run folder keeps the previous epoch's, if any"
        )
