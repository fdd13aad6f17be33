"""The training loss watched without waiting for the device: `LossMonitor`, and `NonFiniteLoss` when a step went bad."""

from __future__ import annotations

import torch
from torch import Tensor

from ..common import distributed as dist


class NonFiniteLoss(RuntimeError):
    pass


class LossMonitor:
    """An epoch's loss terms, summed on the device, checked for non-finite totals every few steps.

    `record` runs inside the step and never reads the device; `check` (every `train.check_every` steps and at the end
    of the epoch) reads the steps since the last check at once, raises `NonFiniteLoss` on every rank when any rank had
    a non-finite total (naming the earliest such step, the ranks it happened on, and this rank's terms there), and
    returns the last total for the progress bar. A bad step is reported up to `check_every` steps late; the run folder
    still holds the last good checkpoint.
    """

    def __init__(self, epoch: int):
        self.epoch, self.steps = epoch, 0
        self.names: list[str] = []
        self._sums: Tensor | None = None
        self._window: list[Tensor] = []  # each unchecked step's terms
        self._last = float("nan")
        self.stopped: list[dict] | None = None  # every rank's `preemption.gather_rank_states`, set by a stop

    def record(self, parts: dict[str, Tensor]) -> None:
        values = torch.stack([v.float() for v in parts.values()])
        if self._sums is None:
            self.names, self._sums = list(parts), torch.zeros_like(values)
        self._sums += values
        self._window.append(values)
        self.steps += 1

    def state(self) -> dict:
        """The running sums (checked first: `check`), for an epoch stopped mid-way (`preemption.MidEpoch`)."""
        self.check()
        sums = None if self._sums is None else self._sums.detach().cpu()
        return {"loss_names": list(self.names), "loss_sums": sums}

    def resume(self, steps: int, state: dict, device: torch.device) -> None:
        """Go on after `steps` steps with `state`'s sums (onto `device`), as the stopped epoch's monitor would have."""
        self.steps, self.names = steps, list(state["loss_names"])
        sums = state["loss_sums"]
        self._sums = None if sums is None else sums.to(device)

    def check(self) -> float:
        if not self._window:  # every rank ran the same steps, so every rank returns here together
            return self._last
        window = torch.stack(self._window)
        start = self.steps - len(window)
        self._window = []
        steps = torch.arange(len(window), device=window.device)
        first = torch.where(torch.isfinite(window[:, 0]), len(window), steps).min().reshape(1)
        firsts = dist.all_gather_cat(first)[0].tolist()  # one read of the device for every rank's window
        earliest = min(firsts)
        self._last = float(window[-1, 0])
        if earliest == len(window):
            return self._last
        where = ""
        if len(firsts) > 1:
            ranks = [r for r, f in enumerate(firsts) if f == earliest]
            where = f" on rank(s) {ranks} (this is rank {dist.get_rank()})"
        terms = ", ".join(f"{k}={v:.4g}" for k, v in zip(self.names, window[earliest].tolist(), strict=True))
        raise NonFiniteLoss(
            f"non-finite loss at epoch {self.epoch}, step {start + earliest}{where}: {terms}. Hint: lower optim.lr, "
            "try train.amp=off, and check the inputs for NaN/inf; the last good checkpoint is in the run folder"
        )

    def means(self) -> dict[str, float]:
        """Each term's mean over the steps (over every rank's steps under torchrun: all ran `steps`)."""
        sums = self._sums
        if dist.get_world_size() > 1:
            sums = dist.all_reduce_sum(sums) / dist.get_world_size()
        return {k: float(v) / self.steps for k, v in zip(self.names, sums.tolist(), strict=True)}
