"""The training loop: per epoch a feature pass, semi-supervised k-means pseudo-labels, then two-view training steps.

Every random draw of an epoch comes from generators seeded by (train.seed, epoch), so a run resumed from its
checkpoint repeats the uninterrupted run's schedule, sampling, augmentation and clustering exactly.

Under torchrun (one process per GPU, `torch.distributed` initialised) the model is wrapped in DistributedDataParallel;
each rank runs the feature pass on its share of the train set, the semi-supervised k-means runs on the shards (exact:
the global clustering) and the pseudo-label and evaluation tables are all-gathered, so every rank holds the complete
table and the same All/Old/New. `data.batch_size` is per rank. `run_folder.py` runs the Trainer in a run folder.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import Tensor
from tqdm import tqdm

from ..common import distributed as dist
from ..common.distributed import rank_seed
from ..config.settings import Config
from ..data import InMemoryGCD, build_source
from ..data.reading.augment import AugmentConfig, DeviceAugment
from ..data.reading.base import Batch, GCDSource
from ..data.reading.decode import DecodeWindow
from ..evaluation.evaluator import ClusterCount, Clustering, Evaluation, Evaluator, FeatureSet, epoch_log
from ..methods import MODEL_OUTPUT, StepTensors
from ..network.compiling import (
    CompileOutcome,
    check_compile_setting,
    compile_with_fallback,
    compiled_modules,
    compiles,
    trace_graphs,
)
from ..network.loss import check_labelled_targets
from ..network.model import Backbone
from ..network.token_cache import TokenCache
from . import checkpoint as ckpt
from .best_checkpoint import BestCheckpoint
from .loss_monitor import LossMonitor
from .peak_memory import peak_memory, reset_peak_memory
from .preemption import MidEpoch, Preempted, StoppedMidEpoch, StopSignals, gather_rank_states
from .schedule import epoch_schedule
from .step_graph import GraphedStep, StepInputs, StepOutputs
from .trainer_setup import (
    autocast_enabled,
    build_method,
    build_model,
    build_optimizer,
    check_source_fits,
    epoch_seed,
    load_optimizer_state,
    method_classes,
    resolve_device,
)
from .weight_check import check_weights


class EpochRecorder(Protocol):
    """Where a run's epochs go (`run_folder.RunFolderRecorder`): each finished epoch's log line and checkpoint, and the
    checkpoints of a stop."""

    def epoch_done(self, trainer: Trainer, record: dict) -> None: ...

    def stopped_mid_epoch(self, trainer: Trainer, mid: MidEpoch) -> Preempted: ...

    def preempted(self, trainer: Trainer, epoch: int, step: int) -> Preempted: ...

    def ended_early(self) -> None: ...


class Trainer:
    """Training of `cfg` on `source` (built from `cfg.data` when None) on `device`: a run hands down the one its start
    resolved (`trainer_setup.started_run`); None resolves `train.device` for a trainer used alone (a run read back, a
    test). `pretrained=False` for a trainer a checkpoint fills (`load_state_dict`, `load_model_state`): its backbone is
    built without `model.pretrained`."""

    def __init__(
        self,
        cfg: Config,
        source: GCDSource | None = None,
        backbone: Backbone | None = None,
        *,
        device: torch.device | None = None,
        pretrained: bool = True,
    ):
        """Everything a run needs, built once, in the order a step uses it."""
        self.cfg = cfg
        self.device = device if device is not None else resolve_device(cfg.train.device)

        # The data: the train set (labelled and unlabelled samples by uq) and, where there is one, the test split.
        self.source = source if source is not None else build_source(cfg.data, cfg.train, self.device)
        check_source_fits(cfg, self.source)
        if self.device.type == "cuda" and isinstance(self.source, InMemoryGCD):
            self.source = self.source.to(self.device)  # small by definition; batches then never cross the bus

        # The model and the method's loss. The method's heads are part of the model, so they are saved, optimised,
        # compiled and wrapped by DDP with it.
        torch.manual_seed(cfg.train.seed)
        self.method = build_method(cfg, self.source.n_old).to(self.device)
        n_classes = self.source.n_classes
        self.model = build_model(cfg, self.source.n_old, backbone, pretrained, self.method, n_classes).to(self.device)
        # `self.model` stays the plain module (checkpoints, feature passes); `self.net` runs the training forward.
        # Every trainable parameter takes part in every loss (the categorizer too: an empty labelled batch gives it a
        # zero gradient, not none), and the frozen backbone prefix has requires_grad=False, so DDP needs no
        # find_unused_parameters.
        self.net: torch.nn.Module = self.model
        if dist.get_world_size() > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)

        # The two views of a step, augmented on the device; bf16 autocast; the optimiser.
        d = cfg.data
        self.augment = DeviceAugment(AugmentConfig(d.crop_size, d.hflip, tuple(d.mean), tuple(d.std), d.color_jitter))
        self.amp = autocast_enabled(cfg.train.amp, self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device, self.method.decay_on_1d)

        # Compiling waits for the first epoch (`compile_once`), so a trainer that only evaluates stays eager; the
        # CUDA graph (`train.cuda_graph`) captures the first step of each epoch.
        check_compile_setting(cfg.train.compile, self.device)
        self.step_graph = GraphedStep.for_setting(
            cfg.train.cuda_graph, self.device, dist.get_world_size(), self.optimizer
        )
        # a capture must not keep autocast's weight casts; every forward runs with the same setting, so a compiled
        # module (whose guards read it) is compiled once
        self._autocast_cache = not self.step_graph.active
        self.token_cache = TokenCache(cfg.train.token_cache, self.device, cfg.data.memory_threshold_mb)
        self.decoding = DecodeWindow(self.source)  # each epoch record: the images decoded since the last, by where

        # The evaluator: feature passes, SS-k-means and scoring of the current weights, for the pseudo-labels of each
        # epoch and for every evaluation. It keeps the run's unreadable samples and K (a head's outputs, or the first
        # SS-k-means round's).
        self.evaluator = Evaluator(
            model=self.model,
            source=self.source,
            augment=self.augment,
            device=self.device,
            kmeans=cfg.kmeans,
            protocol=cfg.train.eval_protocol,
            seed=cfg.train.seed,
            feature_batch_size=cfg.data.feature_batch_size,
            token_cache=self.token_cache,
            autocast=self.autocast,
            compiled=None,  # `compile_once`'s outcome
            unreadable=[],
            k=ClusterCount(method_classes(cfg, n_classes) if self.method.predicts == "head" else None),
        )
        # The best-checkpoint judge (`checkpoint.best`), and the labelled images it holds out of training.
        self.best = BestCheckpoint(cfg.checkpoint, self.source)

        self.centers: Tensor | None = None  # the latest SS-k-means centres [K, D] (CPU): the epoch's, then the final
        self.stop: StopSignals | None = None  # asked before every step (run_folder.train sets it)
        self.mid_epoch: MidEpoch | None = None  # a preempted epoch to finish (`load_state_dict`)

    @property
    def compiled(self) -> CompileOutcome | None:
        """`compile_once`'s outcome (None before it), which the evaluator's passes read (a compiled model sees one
        batch size)."""
        return self.evaluator.compiled

    @property
    def unreadable(self) -> list[int]:
        """uq of the train samples no rank could read (the evaluator's feature passes find them)."""
        return self.evaluator.unreadable

    # ------------------------------------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """All/Old/New accuracy of SS-k-means on test-view backbone features, on the unlabelled train samples (all
        ranks' shares: every rank returns the same numbers)."""
        return self.evaluate_full().metrics

    def evaluate_full(self) -> Evaluation:
        """`evaluate`, with the clustering it scored (`Evaluator.evaluate`); a method that predicts by its head
        (`Method.predicts`) is scored on the head's predictions (`Evaluator.assign` to its prediction centres)."""
        ev = self.evaluator
        fs = ev.features("test")
        if self.method.predicts == "head":
            return ev.score_clustering(fs, ev.assign(fs, self.method.prediction_centres(self.model.method_heads)))
        return ev.evaluate(fs)

    # ------------------------------------------------------------------------------------------------ the epochs
    def train_epochs(self, start: int, recorder: EpochRecorder, stop_after: Callable[[int], bool] | None) -> bool:
        """The epochs from `start` on, each handed to `recorder` (the run folder's log line and checkpoint). False when
        `stop_after(epoch)` ended the run early; `Preempted` when a stop signal did (mid-epoch or after an epoch).
        However they end, the last checkpoint is durable when this returns (or raises)."""
        every = self.cfg.train.eval_every
        try:
            for epoch in range(start, self.cfg.schedule.epochs):
                measures_peak = reset_peak_memory(self.device)
                try:
                    record = self.train_epoch(epoch)
                except StoppedMidEpoch as stopped:  # a stop signal: checkpoint where the epoch stopped
                    raise recorder.stopped_mid_epoch(self, stopped.mid_epoch) from None
                check_weights(self.model, epoch, self.cfg.optim.lr)  # before anything evaluates or saves them
                self.best.judge(self.evaluator, record)
                if every and (epoch + 1) % every == 0:
                    record.update(epoch_log(self.evaluator, self.evaluate_full()))
                if measures_peak:
                    record.update(peak_memory(self.device))
                recorder.epoch_done(self, record)
                if stop_after is not None and stop_after(epoch):
                    recorder.ended_early()
                    return False
                if self.stop is not None and self.stop.requested():
                    raise recorder.preempted(self, epoch + 1, 0)
            return True
        finally:
            ckpt.wait_for_checkpoint()

    def train_epoch(self, epoch: int) -> dict:
        """One epoch: the schedule's values for it, the pseudo-labels (a feature pass and SS-k-means, unless the method
        reads none), then its training steps; the epoch's log record. A stop signal between steps raises
        `StoppedMidEpoch` with what resuming the epoch needs."""
        cfg = self.cfg
        start = time.perf_counter()
        sched = epoch_schedule(epoch, cfg.schedule, cfg.optim)
        length_base = 2.0 if cfg.loss.length_weights == "stale" else sched.base
        if self.model.labeller is not None:
            self.model.labeller.set_schedule(sched.age, sched.base, length_base)
        self.method.set_epoch(epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = sched.lr * group["lr_scale"]
        # the graph's memory (its gradients too) is free for the feature pass; the first step captures the new values
        self.step_graph.release()
        self.optimizer.zero_grad(set_to_none=True)

        name = f"epoch {epoch + 1}/{cfg.schedule.epochs}"
        compile_record = self.compile_once()
        resumed, self.mid_epoch = self.mid_epoch, None
        if resumed is None:
            pseudo, inertia, features_done, kmeans_done = self._pseudo_labels(name, epoch)
        else:  # finishing a preempted epoch: its pseudo-labels (and centres) are the checkpoint's
            self.unreadable[:] = resumed.unreadable
            self.source.exclude(self.unreadable)
            pseudo, inertia = resumed.pseudo.to(self.device), resumed.inertia
            self.method.load_step_state(resumed.method)
            features_done = kmeans_done = time.perf_counter()

        monitor = self._run_steps(name, epoch, pseudo, resumed)
        if monitor.stopped is not None:
            stopped = MidEpoch(epoch, monitor.steps, pseudo, inertia, self.unreadable, monitor.stopped)
            stopped.method = self.method.step_state()
            raise StoppedMidEpoch(stopped)
        losses = {f"loss_{k}": v for k, v in monitor.means().items()}
        end = time.perf_counter()  # monitor.check() read the device: the steps have finished
        return {
            "epoch": epoch,
            "lr": sched.lr,
            "age": sched.age,
            "base": sched.base,
            "steps": monitor.steps,
            "unreadable": len(self.unreadable),
            **losses,
            "kmeans_inertia": inertia,
            "seconds": end - start,
            "seconds_features": features_done - start,
            "seconds_kmeans": kmeans_done - features_done,
            "seconds_steps": end - kmeans_done,
            **compile_record,
            **self.decoding.fields(),
            "cuda_graph": self.step_graph.path,
            "seconds_cuda_graph_capture": self.step_graph.seconds_capture,
        }

    def _pseudo_labels(self, name: str, epoch: int) -> tuple[Tensor, float | None, float, float]:
        """The epoch's feature pass and SS-k-means round: the pseudo-label table, the inertia, and the times each
        finished; the round's centres become `self.centers`. A method that reads no labels (`Method.labels`) skips
        both: a table of -1 (no label) and no inertia."""
        cfg = self.cfg
        if self.method.labels == "none":
            now = time.perf_counter()
            return torch.full((self.source.n_train,), -1, dtype=torch.long, device=self.device), None, now, now
        status = status_line(f"{name}: feature pass ({self.source.n_train} samples)")
        fs = self.evaluator.features("train", seed=epoch_seed(cfg.train.seed, epoch, 1))
        fs = self.best.unlabel_features(fs)  # the judge's held-out images: no labelled anchor in the k-means
        check_labelled_targets(fs.targets, fs.labelled, self.source.n_old)  # once here, not in every step
        features_done = time.perf_counter()  # the checks above read the device: the feature pass has finished
        status.close()  # each phase its own line, so each line's timer shows that phase's time
        status = status_line(f"{name}: SS-k-means pseudo-labels")
        seed = epoch_seed(cfg.train.seed, epoch, 2)
        clustering = self.evaluator.cluster(fs, seed=seed, balanced=cfg.kmeans.balanced)
        self.centers = clustering.centers.cpu()
        labels = clustering.labels
        if self.method.labels == "hierarchy":
            labels = self._label_levels(fs, clustering, seed)
        kmeans_done = time.perf_counter()  # so has the clustering (its inertia is a host float)
        status.close()
        return labels, clustering.inertia, features_done, kmeans_done

    def _label_levels(self, fs: FeatureSet, level0: Clustering, seed: int) -> Tensor:
        """A "hierarchy" method's labels [levels, n_train] from the epoch's round `level0`: each further level is a
        round of the same balanced SS-k-means (`seed`) of `fs` with the labelled samples and K the method says."""
        ev = self.evaluator

        def cluster(labelled: Tensor, targets: Tensor, k: int) -> tuple[Tensor, Tensor]:
            level_fs = dataclasses.replace(fs, labelled=labelled[fs.uq], targets=targets[fs.uq])
            result = ev.cluster(level_fs, seed=seed, balanced=self.cfg.kmeans.balanced, n_clusters=k)
            return result.labels, result.centers

        labelled = ev.gather_table(fs, fs.labelled.long(), fill=0).bool()
        return self.method.label_levels(level0.labels, level0.centers, labelled, self.source.n_old, cluster)

    def _run_steps(self, name: str, epoch: int, pseudo: Tensor, resumed: MidEpoch | None) -> LossMonitor:
        """The epoch's training steps on its pseudo-labels (after `resumed`'s, when it finishes a preempted epoch),
        under a progress bar; returns their checked losses. When the ranks agree to stop (`self.stop`) before a step,
        it returns at once with every rank's generators and loss sums in the monitor's `stopped`."""
        cfg = self.cfg
        gen = torch.Generator(device=self.device).manual_seed(rank_seed(epoch_seed(cfg.train.seed, epoch, 3)))
        monitor = LossMonitor(epoch)
        if resumed is not None:
            mine = resumed.rank_state()
            gen.set_state(mine["augment"])
            monitor.resume(resumed.step, mine, self.device)
            ckpt.restore_rng_state(mine["torch_rng"])
        batches = self.source.train_batches(cfg.data.batch_size, epoch, cfg.train.seed, skip=monitor.steps)
        batches = self.best.unlabel_batches(batches)  # the judge's held-out images: no supervised loss
        bar = steps_bar(batches, name, monitor.steps, self.steps_per_epoch())
        for batch in bar:
            if cfg.train.max_steps_per_epoch is not None and monitor.steps >= cfg.train.max_steps_per_epoch:
                break
            if self.stop is not None and self.stop.requested():
                monitor.stopped = gather_rank_states(gen, monitor.state())
                bar.close()
                return monitor
            self.train_step(batch, pseudo, gen, monitor)
            if monitor.steps % cfg.train.check_every == 0:
                bar.set_postfix(loss=f"{monitor.check():.3f}")
        if monitor.steps == 0:
            raise RuntimeError(
                "the epoch had no full batch: lower data.batch_size (per rank) or use more training data"
            )
        monitor.check()
        return monitor

    def compile_once(self) -> dict:
        """`train.compile`, before the first epoch of this process (`train_epoch` calls it): the epoch record's
        `compile` (the path that runs), `compile_graphs` (each module class's outcome) and `seconds_compile` (what
        this call paid: 0 once done)."""
        paid = 0.0
        if self.compiled is None:
            setting = self.cfg.train.compile
            # the line only where something compiles: on the CPU `auto` stays eager
            status = status_line(f"train.compile={setting}: compiling") if compiles(setting, self.device) else None
            self.evaluator.compiled = compile_with_fallback(
                compiled_modules(self.model), setting, self.device, self._trace_graphs
            )
            if status is not None:
                status.close()
            paid = self.compiled.seconds
        return {"compile": self.compiled.path, "compile_graphs": self.compiled.graphs, "seconds_compile": paid}

    def _trace_graphs(self) -> None:
        """`compiling.trace_graphs` of this run: the probe `compile_once` runs after compiling each module class."""
        trace_graphs(self.model, self.optimizer, self.cfg.data, self.device, self.autocast)

    def steps_per_epoch(self) -> int:
        """Training steps of an epoch: full global batches of the readable samples, capped by
        `train.max_steps_per_epoch` (as `train_epoch` runs them; the unreadable ones are known after a feature pass)."""
        t = self.cfg.train
        steps = (self.source.n_train - len(self.unreadable)) // (self.cfg.data.batch_size * dist.get_world_size())
        return steps if t.max_steps_per_epoch is None else min(steps, t.max_steps_per_epoch)

    def autocast(self) -> torch.autocast:
        """bf16 autocast as `train.amp` says, for every forward pass of the model."""
        cache = self._autocast_cache
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp, cache_enabled=cache)

    def train_step(self, batch: Batch, pseudo: Tensor, gen: torch.Generator, monitor: LossMonitor) -> None:
        """One two-view step, eager or replayed from a CUDA graph (`train.cuda_graph`); nothing in it waits for the
        device (the monitor reads the loss later)."""
        batch = batch.to(self.device, non_blocking=True)
        views = self.augment.train_views(batch.images, 2, gen, batch.sizes)
        inputs = StepInputs(views, batch.targets, batch.labelled, pseudo[..., batch.uq])  # [B], or [levels, B]
        monitor.record(self.step_graph(self._step, inputs, self._baked_host_values()))

    def _step(self, inputs: StepInputs) -> StepOutputs:
        """Forward, loss, backward and update on `inputs`; the loss terms (what a CUDA graph records)."""
        with self.autocast():
            out = self.net(inputs.views)
        heads = {**out.heads, MODEL_OUTPUT: out}
        pseudo = None if self.method.labels == "none" else inputs.pseudo
        step = StepTensors(out.backbone, out.projection, inputs.targets, inputs.labelled, pseudo, heads)
        total, parts = self.method(step)
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        self.optimizer.step()
        return parts

    def _baked_host_values(self) -> tuple:
        """The host numbers a captured step holds as kernel arguments: the groups' lr and the code head's age."""
        age = () if self.model.labeller is None else (self.model.labeller._age,)
        return (*(group["lr"] for group in self.optimizer.param_groups), *age)

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self, next_epoch: int, before: dict) -> dict:
        return {
            "epoch": next_epoch,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "before": before,
            "config": self.cfg.to_dict(),
            "torch_rng": ckpt.rng_state(),
            "centers": self.centers,
            "class_names": list(self.source.class_names),
            "n_old": self.source.n_old,
            "n_clusters": self.evaluator.k.value,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue training from a checkpoint: `load_model_state`, then the optimizer state and the RNG (and, from a
        preempted epoch's checkpoint, where that epoch stopped: `train_epoch` finishes it)."""
        self.load_model_state(state)
        load_optimizer_state(self.optimizer, state["optimizer"])
        ckpt.restore_rng_state(state["torch_rng"])
        self.best.continue_from(state)
        if state.get("mid_epoch") is not None:
            self.mid_epoch = MidEpoch.from_state(state["mid_epoch"])

    def load_model_state(self, state: dict) -> None:
        """A checkpoint's weights, k-means centres and K: what evaluating or reading a finished run needs."""
        self.model.load_state_dict(state["model"])
        self.token_cache.clear()  # the frozen prefix's weights may have changed
        self.centers = state.get("centers")
        self.evaluator.k.value = state.get("n_clusters")


def steps_bar(batches: Iterator[Batch], name: str, done: int, total: int) -> tqdm:
    """The progress bar over an epoch's `batches` (rank 0), from the `done` steps a resumed epoch had run."""
    return tqdm(
        batches,
        desc=name,
        initial=done,
        total=total,
        unit="step",
        leave=False,
        dynamic_ncols=True,
        disable=not dist.is_main_process(),
    )


def status_line(text: str) -> tqdm:
    """A one-line progress note on the terminal (rank 0) for a stage without steps to count: the feature pass,
    k-means; it shows the time spent so far and disappears when closed."""
    return tqdm(
        total=0,
        desc=text,
        bar_format="{desc} ({elapsed})",
        leave=False,
        dynamic_ncols=True,
        disable=not dist.is_main_process(),
    )
