"""The checkpoint you report, chosen honestly (`checkpoint.best`).

RUN/checkpoint.pt is always the last. With `checkpoint.best` set, every epoch's weights are also scored by a criterion
that reads no label of an unlabelled image, and the best epoch is kept:

- "labelled_holdout" (higher is better): GCD's labelled-accuracy criterion for choosing K (`estimate_k.
  labelled_accuracy`). `checkpoint.holdout_fraction` of the labelled images (known classes only, by definition),
  chosen with `checkpoint.holdout_seed`, are held out: while an epoch trains they count as unlabelled (no supervised
  loss, no labelled anchor in the pseudo-label k-means; the sampler still draws them with the labelled images'
  weight). After the epoch, k-means on the test-view features of every
  train image, labels ignored; the score is the clustering accuracy on the held-out images, averaged over
  `KMEANS_RUNS` seeds. The evaluations (before, `train.eval_every`, after) see the labelled set as it is.
- "kmeans_objective" (lower is better): the inertia of k-means on the test-view features of every train image after
  the epoch (`kmeans.n_init` restarts), labels ignored. It reads features only.

Both cluster into the run's K clusters with `train.seed`, so every epoch is scored alike. Ties keep the earlier epoch.

RUN/checkpoint-best.pt  the best epoch's weights, k-means centres and config (no optimizer state), with `best`
RUN/best.json           {"criterion", "epoch", "value", "higher_is_better"}: epoch counts epochs trained (1-based)

Order on disk, per epoch: the log line (with `criterion_<name>`), checkpoint.pt (whose `best` already counts this
epoch), then checkpoint-best.pt and best.json when the epoch is the new best. A resume takes the best so far from
checkpoint.pt and rewrites the two best files when they lag behind it (a kill between the writes), so a run killed
and resumed chooses what the uninterrupted run chooses.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ..common import files as common_files
from .run_files import BEST, BEST_CHECKPOINT, read_best

if TYPE_CHECKING:
    from ..config.settings import CheckpointConfig
    from ..data.reading.base import Batch, GCDSource
    from ..evaluation.evaluator import Evaluator, FeatureSet

HIGHER_IS_BETTER = {"labelled_holdout": True, "kmeans_objective": False}
KMEANS_RUNS = 4  # k-means runs averaged per holdout score (estimate_k's default number of seeds)
_TRAINING_ONLY = ("optimizer", "torch_rng")  # what the best checkpoint leaves out: it is read, never resumed


# ------------------------------------------------------------------------------------------------ the held-out images
def images_held_out_for_selection(source, fraction: float, seed: int) -> Tensor:
    """bool [n_train] (CPU): the labelled images `labelled_holdout` scores. Shards of your own images made with
    `make-shards --holdout` already hold some out (served unlabelled, `data.held_out_labelled`): those. Otherwise
    `fraction` of the labelled samples (rounded, at least one), drawn without replacement by `RandomState(seed)` over
    the labelled samples in uq order. Reads the labelled mask only."""
    from ..data import held_out_labelled  # the training stack, which the run-folder readers of this module skip

    mask = torch.zeros(source.n_train, dtype=torch.bool)
    held_by_the_shards = held_out_labelled(source)
    if len(held_by_the_shards):
        mask[torch.from_numpy(held_by_the_shards)] = True
        return mask
    labelled = getattr(source, "labelled", None)
    if labelled is None:
        raise ValueError(
            f"checkpoint.best=labelled_holdout needs the data source's labelled mask by uq (`labelled`), which "
            f"{type(source).__name__} lacks: use checkpoint.best=kmeans_objective with it"
        )
    labelled = labelled.cpu().numpy() if isinstance(labelled, Tensor) else np.asarray(labelled)
    uq = np.flatnonzero(labelled)
    n_held = max(1, round(fraction * len(uq)))
    if n_held >= len(uq):
        raise ValueError(
            f"checkpoint.holdout_fraction={fraction} holds out {n_held} of the {len(uq)} labelled images, leaving "
            "none to train on: lower it, or use checkpoint.best=kmeans_objective"
        )
    mask[torch.from_numpy(uq[np.sort(np.random.RandomState(seed).choice(len(uq), n_held, replace=False))])] = True
    return mask


# ------------------------------------------------------------------------------------------------ the criteria
def holdout_accuracy(ev: Evaluator, fs: FeatureSet, k: int, holdout: Tensor) -> float:
    """The held-out images' clustering accuracy under k-means of all the features, labels ignored (GCD's criterion)."""
    from ..evaluation.estimate_k import labelled_accuracy

    held = holdout.to(fs.uq.device)[fs.uq]
    targets = ev.gather_table(fs, torch.where(held, fs.targets, -1))  # the held-out images' labels, no other
    held = ev.gather_table(fs, held.long(), fill=0).bool()  # complete tables by uq, as `labels_table` gives
    mean, _ = labelled_accuracy(
        fs.feats,
        targets.cpu().numpy(),
        held.cpu().numpy(),
        k,
        n_seeds=KMEANS_RUNS,
        max_iter=ev.kmeans.max_iter,
        seed=ev.seed,
        labels_table=lambda labels: ev.gather_table(fs, labels.to(fs.feats.device)),
    )
    return mean


def kmeans_objective(ev: Evaluator, fs: FeatureSet, k: int) -> float:
    """The inertia of k-means of all the features (labels ignored): the sum of squared distances to the centres."""
    from ..kmeans import semi_supervised_kmeans

    km = ev.kmeans
    result = semi_supervised_kmeans(
        fs.feats,
        None,
        None,
        k,
        n_init=km.n_init,
        max_iter=km.max_iter,
        tol=km.tol,
        seed=ev.seed,
        backend=km.backend,
        distance_precision=km.distance_precision,
    )
    return float(result.inertia)


class BestCheckpoint:
    """A run's `checkpoint.best`: the held-out images, the scoring of each epoch and the best record so far
    ({"criterion", "epoch", "value", "higher_is_better"}, None before the first epoch). With `checkpoint.best: none`
    every method leaves the run as it is."""

    def __init__(self, settings: CheckpointConfig, source: GCDSource):
        """`settings`: the run's `checkpoint` section; `source`: its train set (the held-out images are drawn from
        it)."""
        self.criterion = settings.best
        self.enabled = settings.best != "none"
        holds_out = settings.best == "labelled_holdout"
        self.holdout = (
            images_held_out_for_selection(source, settings.holdout_fraction, settings.holdout_seed)
            if holds_out
            else None
        )
        self.best: dict | None = None

    def continue_from(self, state: dict) -> None:
        """The best record so far of the checkpoint `state` a resumed run continues from."""
        self.best = state.get("best")

    # -------------------------------------------------------------------------------------------- the held-out images
    def unlabel_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """Training batches with the held-out images marked unlabelled (no supervised loss); as they are without a
        holdout. The sampler still draws them with the labelled images' weight."""
        if self.holdout is None:
            yield from batches
            return
        on_device: dict[torch.device, Tensor] = {}
        for batch in batches:
            device = batch.uq.device
            hidden = on_device.setdefault(device, self.holdout.to(device))[batch.uq]
            yield dataclasses.replace(batch, labelled=batch.labelled & ~hidden)

    def unlabel_features(self, fs: FeatureSet) -> FeatureSet:
        """The pseudo-label round's features with the held-out images unlabelled (no labelled anchor in its
        SS-k-means); `fs` itself without a holdout."""
        if self.holdout is None:
            return fs
        return dataclasses.replace(fs, labelled=fs.labelled & ~self.holdout.to(fs.uq.device)[fs.uq])

    # -------------------------------------------------------------------------------------------- the criterion
    def score(self, ev: Evaluator) -> float:
        """The criterion's value for the evaluator's weights, e.g. `Trainer.evaluator`'s (every rank calls it; all get
        the same value)."""
        fs = ev.features("test")
        k = ev.clusters(fs)
        if self.criterion == "labelled_holdout":
            return holdout_accuracy(ev, fs, k, self.holdout)
        return kmeans_objective(ev, fs, k)

    def judge(self, ev: Evaluator, record: dict) -> None:
        """Score the weights after the epoch of `record` (log.jsonl's line, which gets `criterion_<name>` and the time
        it took, `seconds_criterion`; `seconds` is the epoch's training alone) and keep them as the best when they beat
        it."""
        if not self.enabled:
            return
        start = time.perf_counter()
        value = self.score(ev)
        record.update({f"criterion_{self.criterion}": value, "seconds_criterion": time.perf_counter() - start})
        higher = HIGHER_IS_BETTER[self.criterion]
        if self.best is None or (value > self.best["value"] if higher else value < self.best["value"]):
            self.best = {
                "criterion": self.criterion,
                "epoch": record["epoch"] + 1,
                "value": value,
                "higher_is_better": higher,
            }

    def stamp(self, state: dict) -> dict:
        """A checkpoint's `state` with the best record so far (when the run keeps one)."""
        if self.enabled:
            state["best"] = self.best
        return state

    def holds(self, state: dict) -> bool:
        """Whether the checkpoint `state` (epochs trained: `state["epoch"]`) is the best so far."""
        mid_epoch = state.get("mid_epoch") is not None  # a preempted epoch's weights: not the epoch's end
        return self.enabled and self.best is not None and self.best["epoch"] == state["epoch"] and not mid_epoch

    def restore_files(self, run_dir: Path, state: dict) -> None:
        """On resume (rank 0): when the checkpoint is the best itself and best.json does not say so (a kill between
        checkpoint.pt and the best files), write the best files from it."""
        if self.holds(state) and read_best(run_dir) != self.best:
            write_best(run_dir, state)


def write_best(run_dir: Path, state: dict) -> None:
    """RUN/checkpoint-best.pt (`state` without the optimizer and RNG), then RUN/best.json, each atomically."""
    kept = {k: v for k, v in state.items() if k not in _TRAINING_ONLY}
    common_files.atomic_write(run_dir / BEST_CHECKPOINT, lambda f: torch.save(kept, f))
    common_files.write_json(run_dir / BEST, state["best"])
