"""Preemption: SIGTERM or SIGUSR1 ends a training run at its next step boundary with a mid-epoch checkpoint.

A cluster that takes the machines back (SLURM's `--signal=USR1@120`, a preemption's SIGTERM, torchrun passing SIGTERM
on to its workers) gives the run a little time. `StopSignals` records the signal; the trainer asks `requested()` before
every training step and after every epoch, so the current step always finishes. Under torchrun the ranks agree on the
answer (an all-reduce of one integer, on the host), so every rank stops at the same step. Then `MidEpoch` holds what
the rest of the epoch needs beyond the model and optimizer: the step reached, the epoch's pseudo-labels and k-means
inertia, the unreadable samples, and per rank the augmentation generator, torch's generator and the loss sums.
`--resume` skips the epoch's feature pass and k-means, the batches already trained, and goes on bit for bit.

The signal is only recorded while a step can act on it (`StopSignals.deferred`: from the evaluation before training
to the end of the final one). A signal during a feature pass or k-means (of an epoch, or the evaluation before training)
is acted on at the next step boundary: the pass finishes and the run stops before the epoch's first step. The final
evaluation, once begun, finishes (the run then ends normally). Outside that window (opening the data, indexing shards,
a download, building the model) there is no step to wait for, and a second signal means the sender will not wait: both
end the run at once (`StoppedAtOnce`), its last checkpoint as it was.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..common import distributed as dist
from ..common.worker_processes import STOP_SIGNALS as SIGNALS
from . import checkpoint as ckpt

# sysexits.h's EX_TEMPFAIL ("try again later"): not a crash (1), a usage error (2), Ctrl-C (130) nor a process the
# signal killed outright (143 = 128 + SIGTERM), so a batch script can tell "requeue me" from every failure
PREEMPTED_EXIT = 75


class Preempted(Exception):
    """The run stopped on a signal; its checkpoint (mid-epoch or end of epoch) is durable. The message says where."""


class StoppedAtOnce(Preempted):
    """A stop signal where no step could act on it (outside `StopSignals.deferred`), or a second one: raised from the
    handler, wherever the main thread was."""

    def __init__(self, signal_name: str, again: bool):
        self.signal_name, self.again = signal_name, again
        super().__init__(f"{signal_name}{' again' if again else ''}: stopped at once")


class StopSignals:
    """Within: SIGTERM and SIGUSR1 raise `StoppedAtOnce`, except in `deferred()`, where the first one only sets a flag
    that the steps ask (`requested`). Installed only in the main thread, the one Python delivers signals to; the
    previous handlers come back on the way out."""

    def __init__(self):
        self.received: str | None = None  # the first signal's name
        self._deferring = False
        self._previous: dict[int, object] = {}
        self._group = None  # a gloo group for the agreement when the default group runs on NCCL (host, no GPU sync)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        if dist.get_world_size() > 1 and torch.distributed.get_backend() != "gloo":
            self._group = torch.distributed.new_group(backend="gloo")  # every rank calls __enter__ at the same point
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._group is not None:
            torch.distributed.destroy_process_group(self._group)
            self._group = None

    @contextmanager
    def deferred(self) -> Iterator[StopSignals]:
        """Within: the first stop signal is recorded and acted on at the next step boundary."""
        self._deferring = True
        try:
            yield self
        finally:
            self._deferring = False

    def _record(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self._deferring or self.received is not None:
            raise StoppedAtOnce(name, again=self.received is not None)
        self.received = name

    def requested(self) -> bool:
        """Whether any rank received a stop signal (every rank calls this at the same points and gets the same
        answer); the name of the signal is then in `received` on every rank."""
        if dist.get_world_size() == 1:
            return self.received is not None
        flag = torch.tensor([0 if self.received is None else SIGNALS.index(signal.Signals[self.received]) + 1])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        if int(flag) and self.received is None:
            self.received = SIGNALS[int(flag) - 1].name
        return bool(int(flag))


@dataclass
class MidEpoch:
    """Where a stopped epoch stands: `step` steps of `epoch` are trained. `pseudo` is the epoch's pseudo-label table
    (by uq), `ranks` one dict per rank: "augment" (its augmentation generator's state), "torch_rng" (bytes), "loss_sums"
    (the LossMonitor's sums, None before the first step) and "loss_names"; `method` what the method keeps between
    steps (`Method.step_state`)."""

    epoch: int
    step: int
    pseudo: Tensor
    inertia: float | None
    unreadable: list[int]
    ranks: list[dict]
    method: dict[str, Tensor] = field(default_factory=dict)

    def to_state(self) -> dict:
        """The checkpoint's `mid_epoch` entry (tensors, numbers, bytes, lists: readable with weights_only)."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "pseudo": self.pseudo.cpu(),
            "inertia": self.inertia,
            "unreadable": list(self.unreadable),
            "ranks": self.ranks,
            "method": {name: t.cpu() for name, t in self.method.items()},
        }

    @classmethod
    def from_state(cls, state: dict) -> MidEpoch:
        ranks = state["ranks"]
        if len(ranks) != dist.get_world_size():
            raise ValueError(
                f"the checkpoint stopped mid-epoch with {len(ranks)} rank(s) and this run has "
                f"{dist.get_world_size()}: resume it with {len(ranks)} (each rank's augmentation stream is saved)"
            )
        method = state.get("method", {})  # absent from checkpoints written before methods kept any
        return cls(state["epoch"], state["step"], state["pseudo"], state["inertia"], state["unreadable"], ranks, method)

    def rank_state(self) -> dict:
        return self.ranks[dist.get_rank()]


class StoppedMidEpoch(Exception):
    """Raised by `Trainer.train_epoch` when the ranks agreed to stop before one of its steps."""

    def __init__(self, mid_epoch: MidEpoch):
        super().__init__(f"stopped at epoch {mid_epoch.epoch}, step {mid_epoch.step}")
        self.mid_epoch = mid_epoch


def gather_rank_states(augment: torch.Generator, monitor_state: dict) -> list[dict]:
    """Every rank's generator states and `LossMonitor.state`, in rank order (a collective: every rank calls it)."""
    return dist.all_gather_object({"augment": augment.get_state(), "torch_rng": ckpt.rng_state(), **monitor_state})
