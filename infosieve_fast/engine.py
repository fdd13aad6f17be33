"""The training loop: per epoch a feature pass, semi-supervised k-means pseudo-labels, then two-view training steps.

Every random draw of an epoch comes from generators seeded by (train.seed, epoch), so a run resumed from its
checkpoint repeats the uninterrupted run's schedule, sampling, augmentation and clustering exactly.

Under torchrun (one process per GPU, `torch.distributed` initialised) the model is wrapped in DistributedDataParallel;
each rank runs the feature pass on its share of the train set, the semi-supervised k-means runs on the shards (exact:
the global clustering) and the pseudo-label and evaluation tables are all-gathered, so every rank holds the complete
table and the same All/Old/New. `data.batch_size` is per rank. Only rank 0 writes the run folder and prints.
"""

from __future__ import annotations

import copy
import json
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from . import checkpoint as ckpt
from . import distributed as dist
from .config import Config, ConfigError, config_drift, save_config
from .data import InMemoryGCD, build_source
from .data.augment import AugmentConfig, DeviceAugment
from .data.base import Batch, GCDSource
from .kmeans import semi_supervised_kmeans
from .loss import InfoSieveLoss, check_labelled_targets
from .metrics import evaluate_split
from .model import Backbone, InfoSieve
from .schedule import epoch_schedule
from .tree import build_tree, code_strings


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

    def record(self, parts: dict[str, Tensor]) -> None:
        values = torch.stack([v.float() for v in parts.values()])
        if self._sums is None:
            self.names, self._sums = list(parts), torch.zeros_like(values)
        self._sums += values
        self._window.append(values)
        self.steps += 1

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


@dataclass
class FeatureSet:
    """Backbone features of this rank's share of the train set (all of it with one process) in uq order."""

    feats: Tensor  # float32 [n, D], L2-normalised
    targets: Tensor  # long [n]
    labelled: Tensor  # bool [n]
    uq: Tensor  # long [n], increasing
    all_uq: Tensor  # long [M]: every rank's `uq` concatenated in rank order (each readable sample once)


@dataclass
class Clustering:
    """One SS-k-means round over the train samples (tables indexed by uq, complete on every rank)."""

    labels: Tensor  # long [n_train]: cluster id, -1 for unreadable samples
    inertia: float
    centers: Tensor  # float32 [K, D]: row c is cluster c's centre (clusters 0..n_old-1 hold the known classes)


@dataclass
class Evaluation:
    """The evaluation's clustering of the test-view features and its All/Old/New on the unlabelled samples."""

    metrics: dict[str, float]
    clustering: Clustering
    targets: Tensor  # long [n_train], -1 for unreadable samples
    unlabelled: Tensor  # bool [n_train]: unlabelled and readable (the samples the metrics are computed on)


def resolve_device(name: str) -> torch.device:
    """The device named by `train.device`; under torchrun a CUDA device is this process's `cuda:LOCAL_RANK`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"train.device={name!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name!r} but no CUDA device is available: use train.device=cpu or auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"train.device={name!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "cuda" and dist.get_world_size() > 1:
        if device.index is not None:
            raise ValueError(f"train.device={name!r}: under torchrun each rank uses cuda:LOCAL_RANK; set cuda or auto")
        device = torch.device("cuda", dist.local_rank())
    return device


def wants_cuda(name: str) -> bool:
    return name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())


def autocast_enabled(amp: str, device: torch.device) -> bool:
    return amp == "bf16" or (amp == "auto" and device.type == "cuda")


def epoch_seed(seed: int, epoch: int, stream: int) -> int:
    """Independent, reproducible seeds per (run seed, epoch, purpose)."""
    return (seed * 1_000_003 + epoch * 101 + stream) % (2**63)


def rank_seed(seed: int) -> int:
    """`seed` on rank 0 (so one process draws exactly as before), a different stream on every other rank."""
    return (seed + dist.get_rank() * 7_919_000_003) % (2**63)


def build_optimizer(model: torch.nn.Module, o, device: torch.device) -> torch.optim.Optimizer:
    """SGD or AdamW over the trainable parameters; one fused kernel per step on CUDA (same update, fewer launches),
    the foreach implementation elsewhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, **impl)
    return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, **impl)


def compile_model(model: InfoSieve, device: torch.device) -> None:
    """`train.compile`: compile the backbone's blocks and the projection head in place (state-dict keys unchanged).
    The blocks share one graph; the frozen and trained ones differ only in grad mode."""
    if device.type != "cuda":
        raise ValueError("train.compile=true needs CUDA (torch.compile on the CPU does not pay here): set it false")
    for block in getattr(model.backbone.net, "blocks", []):
        block.compile(dynamic=False)
    model.projection.compile(dynamic=False)


class Trainer:
    def __init__(self, cfg: Config, source: GCDSource | None = None, backbone: Backbone | None = None):
        self.cfg = cfg
        self.device = resolve_device(cfg.train.device)
        self.source = source if source is not None else build_source(cfg.data, cfg.train, self.device)
        per_step = cfg.data.batch_size * dist.get_world_size()
        if per_step > self.source.n_train:
            raise ValueError(
                f"data.batch_size={cfg.data.batch_size} (x {dist.get_world_size()} ranks) is more than the "
                f"{self.source.n_train} train samples, so an epoch has no full batch: lower data.batch_size"
            )
        km = cfg.kmeans
        if km.cluster_size is not None and km.n_clusters != "auto":
            k = km.n_clusters or self.source.n_classes
            if km.cluster_size * k < self.source.n_train:
                raise ConfigError(
                    f"kmeans.cluster_size={km.cluster_size} x {k} clusters holds fewer than the {self.source.n_train} "
                    f"train samples: set it >= {-(-self.source.n_train // k)}, or null for ceil(N / K)"
                )
        if self.device.type == "cuda" and isinstance(self.source, InMemoryGCD):
            self.source = self.source.to(self.device)  # small by definition; batches then never cross the bus
        torch.manual_seed(cfg.train.seed)
        t = cfg.train
        self.model = InfoSieve(cfg.model, self.source.n_old, backbone, t.frozen_bf16, t.checkpoint_blocks)
        self.model.to(self.device)
        self.model.kernel_backend = cfg.train.kernels
        self.model.labeller_grad_stop = cfg.loss.labeller_grad_stop
        self.loss_fn = InfoSieveLoss(cfg.loss, self.source.n_old, backend=cfg.train.kernels)
        d = cfg.data
        self.augment = DeviceAugment(AugmentConfig(d.crop_size, d.hflip, tuple(d.mean), tuple(d.std), d.color_jitter))
        self.amp = autocast_enabled(cfg.train.amp, self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        if cfg.train.compile:
            compile_model(self.model, self.device)
        # `self.model` stays the plain module (checkpoints, feature passes); `self.net` runs the training forward.
        # Every trainable parameter takes part in every loss (the categorizer too: an empty labelled batch gives it a
        # zero gradient, not none), and the frozen backbone prefix has requires_grad=False, so DDP needs no
        # find_unused_parameters.
        self.net: torch.nn.Module = self.model
        self.unreadable: list[int] = []  # uq of the train samples no rank could read (found by the feature passes)
        # the latest SS-k-means centres [K, D] (CPU): the epoch's pseudo-label round, then the final evaluation's
        self.centers: Tensor | None = None
        self.n_clusters: int | None = None  # K, resolved by `clusters` on the first round (kept in checkpoints)
        if dist.get_world_size() > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)

    # ------------------------------------------------------------------------------------------------ feature pass
    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    @torch.no_grad()
    def extract_features(self, view: str, seed: int = 0, embed: Callable[[Tensor], Tensor] | None = None) -> FeatureSet:
        """Backbone features of this rank's share of the train samples: `view="train"` (augmented view 0, as the
        reference's pseudo-labelling pass) or `"test"` (centre crop, as its evaluation). Checks that the shares
        together hold every train sample exactly once. `embed` replaces the backbone features (e.g. by codes)."""
        embed = embed or self.model.features
        dist.broadcast_buffers(self.model)  # e.g. BatchNorm statistics: each rank's last DDP forward left its own
        self.model.eval()
        gen = self._generator(rank_seed(seed))
        parts: list[tuple[Tensor, ...]] = []
        for batch in self.source.feature_batches(self.cfg.data.feature_batch_size):
            batch = batch.to(self.device, non_blocking=True)
            x = (
                self.augment.train_views(batch.images, 1, gen, batch.sizes)
                if view == "train"
                else self.augment.test_view(batch.images, batch.sizes)
            )
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                f = embed(x)
            parts.append((f, batch.targets, batch.labelled, batch.uq))
        self.model.train()
        if parts:
            feats, targets, labelled, uq = (torch.cat(t) for t in zip(*parts, strict=True))
        else:  # a rank with an empty share (fewer samples than ranks)
            feats = torch.empty(0, self.model.backbone.feat_dim, device=self.device)
            targets, labelled = torch.empty(0, dtype=torch.long, device=self.device), torch.empty(0, device=self.device)
            uq = torch.empty(0, dtype=torch.long, device=self.device)
        uq, order = uq.long().sort()
        all_uq = dist.all_gather_cat(uq)[0]
        unreadable = dist.all_gather_cat(torch.as_tensor(self.source.unreadable(), dtype=torch.long,
                                                         device=self.device))[0].unique()  # fmt: skip
        n = self.source.n_train
        seen = torch.bincount(torch.cat([all_uq, unreadable]).clamp(0, n - 1), minlength=n)
        if len(all_uq) + len(unreadable) != n or bool((seen != 1).any()):
            raise RuntimeError(
                f"the feature pass delivered {len(all_uq)} samples and {len(unreadable)} unreadable ones for a train "
                f"set of {n}, not every uq once: check the data source's uq ids (and, under torchrun, that each rank "
                "reads only its share)"
            )
        if len(unreadable) != len(self.unreadable):
            self.unreadable = unreadable.tolist()
            self.source.exclude(self.unreadable)  # never drawn for training
        return FeatureSet(feats[order], targets[order].long(), labelled[order].bool(), uq, all_uq)

    def gather_table(self, fs: FeatureSet, values: Tensor, fill: int = -1) -> Tensor:
        """Per-sample `values` of this rank's share (aligned with `fs.uq`) as the complete table indexed by uq,
        identical on every rank; `fill` where a sample is unreadable."""
        gathered = dist.all_gather_cat(values)[0]
        table = torch.full((self.source.n_train, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
        table[fs.all_uq] = gathered
        return table

    def clusters(self, fs: FeatureSet) -> int:
        """K of every SS-k-means round: `kmeans.n_clusters`, the dataset's classes when null; "auto" is estimated once,
        from the first features clustered (the test-view features before training), on every rank alike."""
        if self.n_clusters is None:
            k = self.cfg.kmeans.n_clusters
            if k is None:
                self.n_clusters = self.source.n_classes
            elif k == "auto":
                from .estimate_k import estimate_k

                feats, targets, labelled = (
                    dist.all_gather_cat(t)[0].cpu() for t in (fs.feats, fs.targets, fs.labelled)
                )
                self.n_clusters = estimate_k(feats.numpy(), targets.numpy(), labelled.numpy(), self.source.n_old)["k"]
                if dist.is_main_process():
                    print(f"kmeans.n_clusters=auto: estimated K = {self.n_clusters} (the dataset has "
                          f"{self.source.n_classes} classes)")  # fmt: skip
            else:
                self.n_clusters = int(k)
        return self.n_clusters

    def cluster(self, fs: FeatureSet, seed: int, balanced: bool) -> Clustering:
        """SS-k-means cluster id of every train sample, indexed by uq (complete on every rank), the inertia and the
        centres."""
        k = self.cfg.kmeans
        lab = fs.labelled
        result = semi_supervised_kmeans(
            fs.feats[~lab], fs.feats[lab], fs.targets[lab], self.clusters(fs),
            n_init=k.n_init, max_iter=k.max_iter, tol=k.tol, balanced=balanced, balance=k.balance,
            cluster_size=k.cluster_size if balanced else None, freeze_labelled_centers=k.freeze_labelled_centers,
            seed=seed, backend=k.backend, distance_precision=k.distance_precision,
        )  # fmt: skip
        labels = result.labels.to(self.device)
        mine = torch.empty_like(fs.targets)
        n_lab = int(lab.sum())
        mine[lab.nonzero().squeeze(1)] = labels[:n_lab]
        mine[(~lab).nonzero().squeeze(1)] = labels[n_lab:]
        return Clustering(self.gather_table(fs, mine), float(result.inertia), result.centers.float())

    def evaluate(self) -> dict[str, float]:
        """All/Old/New accuracy of SS-k-means on test-view backbone features, on the unlabelled train samples (all
        ranks' shares: every rank returns the same numbers)."""
        return self.evaluate_full().metrics

    def evaluate_full(self) -> Evaluation:
        """`evaluate`, with the clustering it scored."""
        fs = self.extract_features("test")
        clustering = self.cluster(fs, seed=0, balanced=self.cfg.kmeans.eval_balanced)
        targets = self.gather_table(fs, fs.targets)
        unl = self.gather_table(fs, (~fs.labelled).long(), fill=0).bool()  # unlabelled and readable
        y = targets[unl]
        metrics = evaluate_split(y, clustering.labels[unl], y < self.source.n_old, self.cfg.train.eval_protocol)
        return Evaluation(metrics, clustering, targets, unl)

    @torch.no_grad()
    def evaluate_test(self, centers: Tensor) -> dict[str, float]:
        """Inductive All/Old/New on the held-out test split (the published "Test ACC"): each test image goes to the
        nearest of `centers` (a clustering of the train samples), scored with the run's protocol."""
        if not hasattr(self.source, "test_batches"):
            raise ValueError(
                f"the data source ({type(self.source).__name__}) has no test split: the digits demo has none; train "
                "from shards (make-shards writes the test split) to evaluate on it"
            )
        self.model.eval()
        centers = centers.to(self.device).float()
        preds, targets = [], []
        for batch in self.source.test_batches(self.cfg.data.feature_batch_size):
            batch = batch.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                f = self.model.features(self.augment.test_view(batch.images, batch.sizes))
            preds.append(torch.cdist(f.float(), centers).argmin(1))
            targets.append(batch.targets)
        self.model.train()
        y = dist.all_gather_cat(torch.cat(targets))[0]
        p = dist.all_gather_cat(torch.cat(preds))[0]
        return evaluate_split(y, p, y < self.source.n_old, self.cfg.train.eval_protocol)

    def evaluate_epoch(self) -> dict:
        """`train.eval_every`'s log entries: All/Old/New on the unlabelled train samples and, where the source has
        one, on the test split (nearest centre of the train clustering); `eval_codes`: what the codes hold
        (`code_metrics.evaluate_codes`: one more pass of the model over the train set, one k-means round on codes)."""
        from .code_metrics import evaluate_codes

        ev = self.evaluate_full()
        out = {"eval": ev.metrics}
        n_test = getattr(self.source, "manifest", {}).get("counts", {}).get("test", 1)  # 0: shards without test split
        if hasattr(self.source, "test_batches") and n_test:
            out["eval_test"] = self.evaluate_test(ev.clustering.centers)
        out["eval_codes"] = evaluate_codes(self)
        return out

    # ------------------------------------------------------------------------------------------------ training
    def train_epoch(self, epoch: int) -> dict:
        cfg = self.cfg
        start = time.perf_counter()
        sched = epoch_schedule(epoch, cfg.schedule, cfg.optim)
        length_base = 2.0 if cfg.loss.length_weights == "stale" else sched.base
        self.model.labeller.set_schedule(sched.age, sched.base, length_base)
        for group in self.optimizer.param_groups:
            group["lr"] = sched.lr

        name = f"epoch {epoch + 1}/{cfg.schedule.epochs}"
        status = status_line(f"{name}: feature pass ({self.source.n_train} samples)")
        fs = self.extract_features("train", seed=epoch_seed(cfg.train.seed, epoch, 1))
        check_labelled_targets(fs.targets, fs.labelled, self.source.n_old)  # once here, not in every step
        features_done = time.perf_counter()  # the checks above read the device: the feature pass has finished
        status.set_description_str(f"{name}: SS-k-means pseudo-labels")
        clustering = self.cluster(fs, seed=epoch_seed(cfg.train.seed, epoch, 2), balanced=cfg.kmeans.balanced)
        pseudo, self.centers = clustering.labels, clustering.centers.cpu()
        kmeans_done = time.perf_counter()  # so has the clustering (its inertia is a host float)
        status.close()

        gen = self._generator(rank_seed(epoch_seed(cfg.train.seed, epoch, 3)))
        monitor = LossMonitor(epoch)
        batches = self.source.train_batches(cfg.data.batch_size, epoch, cfg.train.seed)
        bar = tqdm(
            batches, desc=name, total=self.steps_per_epoch(), unit="step", leave=False, dynamic_ncols=True,
            disable=not dist.is_main_process(),
        )  # fmt: skip
        for batch in bar:
            if cfg.train.max_steps_per_epoch is not None and monitor.steps >= cfg.train.max_steps_per_epoch:
                break
            self.train_step(batch, pseudo, gen, monitor)
            if monitor.steps % cfg.train.check_every == 0:
                bar.set_postfix(loss=f"{monitor.check():.3f}")
        if monitor.steps == 0:
            raise RuntimeError(
                "the epoch had no full batch: lower data.batch_size (per rank) or use more training data"
            )
        monitor.check()
        record = {"epoch": epoch, "lr": sched.lr, "age": sched.age, "base": sched.base, "steps": monitor.steps,
                  "unreadable": len(self.unreadable)}  # fmt: skip
        record.update({f"loss_{k}": v for k, v in monitor.means().items()})
        end = time.perf_counter()  # monitor.check() read the device: the steps have finished
        record.update({
            "kmeans_inertia": clustering.inertia, "seconds": end - start, "seconds_features": features_done - start,
            "seconds_kmeans": kmeans_done - features_done, "seconds_steps": end - kmeans_done,
        })  # fmt: skip
        return record

    def steps_per_epoch(self) -> int:
        """Training steps of an epoch: full global batches of the readable samples, capped by
        `train.max_steps_per_epoch` (as `train_epoch` runs them; the unreadable ones are known after a feature pass)."""
        t = self.cfg.train
        steps = (self.source.n_train - len(self.unreadable)) // (self.cfg.data.batch_size * dist.get_world_size())
        return steps if t.max_steps_per_epoch is None else min(steps, t.max_steps_per_epoch)

    def train_step(self, batch: Batch, pseudo: Tensor, gen: torch.Generator, monitor: LossMonitor) -> None:
        """One two-view step; nothing in it waits for the device (the monitor reads the loss later)."""
        batch = batch.to(self.device, non_blocking=True)
        views = self.augment.train_views(batch.images, 2, gen, batch.sizes)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            out = self.net(views)
        total, parts = self.loss_fn(out, batch.targets, batch.labelled, pseudo[batch.uq])
        monitor.record(parts)
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        self.optimizer.step()

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
            "n_clusters": self.n_clusters,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        ckpt.restore_rng_state(state["torch_rng"])
        self.centers = state.get("centers")
        self.n_clusters = state.get("n_clusters")


def status_line(text: str) -> tqdm:
    """A one-line progress note on the terminal (rank 0) for a stage without steps to count: the feature pass,
    k-means; it shows the time spent so far and disappears when closed."""
    return tqdm(total=0, desc=text, bar_format="{desc} ({elapsed})", leave=False, dynamic_ncols=True,
                disable=not dist.is_main_process())  # fmt: skip


def print_table(metrics: dict[str, dict[str, float]], protocol: str) -> None:
    if not dist.is_main_process():
        return
    print(f"\n{'accuracy (' + protocol + ')':<16}{'All':>8}{'Old':>8}{'New':>8}")
    for name, m in metrics.items():
        print(f"{name:<16}{m['all']:>8.4f}{m['old']:>8.4f}{m['new']:>8.4f}")


def train(
    cfg: Config,
    run_dir: str | Path,
    *,
    resume: bool = False,
    source: GCDSource | None = None,
    backbone: Backbone | None = None,
    stop_after: Callable[[int], bool] | None = None,
    overrides: Sequence[str] = (),
) -> dict | None:
    """Train (or resume) a run in `run_dir`; returns metrics.json's content, or None if `stop_after` ended it early.

    `stop_after(epoch)` is asked after each epoch's checkpoint; True stops the run there (as a kill would).
    Resuming, `cfg` must equal the checkpoint's config except for the keys named by `overrides` (the `--set KEY=VALUE`
    strings already applied to `cfg`), which are recorded in RUN/resumes.jsonl and RUN/config.yaml; the backbone is
    built without `model.pretrained` (the checkpoint holds every weight). A folder with no checkpoint yet (a run killed
    before its first epoch ended) starts again from scratch, resumed or not.
    Launched by torchrun (env WORLD_SIZE > 1) it starts the process group itself unless one exists; with a group,
    every rank calls this with the same arguments (all ranks read the checkpoint to resume; rank 0 writes the folder).
    """
    with dist.process_group_from_env(wants_cuda(cfg.train.device)):
        return _train(cfg, Path(run_dir), resume, source, backbone, stop_after, list(overrides))


RESUMES = "resumes.jsonl"  # one line per resume: the epoch it continued at, the --set strings and what they changed
# what a run killed before its first checkpoint can leave; a folder holding only these is started again
_LEFTOVERS = {"config.yaml", "log.jsonl", RESUMES, "unreadable.json", "tensorboard"}


def _recorded_overrides(run_dir: Path, epoch: int) -> dict:
    """The changes that resumes at `epoch` recorded (config.yaml holds them, the checkpoint not yet)."""
    changed: dict = {}
    for record in ckpt.read_log(run_dir / RESUMES):
        if record.get("epoch") == epoch:
            changed.update({k: v[1] for k, v in record.get("changed", {}).items()})
    return changed


def _check_drift(cfg: Config, state: dict, run_dir: Path, overrides: list[str]) -> dict:
    """The differences between the checkpoint's config and `cfg` that `overrides` explain; any other is refused."""
    drift = config_drift(state["config"], cfg.to_dict())
    named = [o.partition("=")[0].strip() for o in overrides]
    recorded = _recorded_overrides(run_dir, state["epoch"])
    explained = {k: v for k, v in drift.items() if any(k == n or k.startswith(n + ".") for n in named)}
    fixed = [k for k in explained if k.startswith("model.") and k != "model.pretrained" or k == "optim.name"]
    if fixed:
        raise ConfigError(
            f"--set {', '.join(fixed)} on resume: the checkpoint's weights and optimizer state are built for the saved "
            "network and optimizer, so they cannot continue with these changed; start a new run with --config instead"
        )
    refused = {k: v for k, v in drift.items() if k not in explained and not (k in recorded and recorded[k] == v[1])}
    if refused:
        listed = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in refused.items())
        raise ConfigError(
            f"{run_dir / 'config.yaml'} differs from its checkpoint's config ({listed}). A resumed run keeps its "
            f"settings: restore config.yaml, or change a setting on purpose with `infosieve train --resume {run_dir} "
            f"--set KEY=VALUE` (recorded in {run_dir / RESUMES})"
        )
    return explained


def _restartable(run_dir: Path) -> bool:
    """True when `run_dir` holds nothing but what a run killed before its first checkpoint leaves."""
    names = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()
    return not any(n not in _LEFTOVERS and not (n.startswith(".") and n.endswith(".tmp")) for n in names)


def _clear_for_restart(run_dir: Path) -> None:
    ckpt.remove_temporary_files(run_dir)
    for name in ("log.jsonl", "unreadable.json"):
        (run_dir / name).unlink(missing_ok=True)


def _train(cfg, run_dir, resume, source, backbone, stop_after, overrides) -> dict | None:
    main = dist.is_main_process()
    started = time.perf_counter()
    log_path, metrics_path = run_dir / "log.jsonl", run_dir / "metrics.json"
    device = resolve_device(cfg.train.device)  # a device this machine lacks is refused before any work
    state = None
    if resume and (run_dir / ckpt.CHECKPOINT).is_file():
        state = ckpt.load_checkpoint(run_dir, map_location=device)
        changed = _check_drift(cfg, state, run_dir, overrides)
        start, before = state["epoch"], state["before"]
        if start >= cfg.schedule.epochs and metrics_path.is_file() and not changed:
            if main:
                print(f"{run_dir} already finished its {cfg.schedule.epochs} epochs; its result is in {metrics_path}")
                print_next_steps(run_dir)
            return json.loads(metrics_path.read_text())
        if main:
            ckpt.remove_temporary_files(run_dir)
            ckpt.rewrite_log(log_path, [r for r in ckpt.read_log(log_path) if r["epoch"] < start])
            if overrides:  # recorded first: a kill before the next checkpoint leaves config.yaml explained
                ckpt.append_log(run_dir / RESUMES, {"epoch": start, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                    "set": overrides, "changed": changed})  # fmt: skip
                save_config(cfg, run_dir / "config.yaml")
            if start < cfg.schedule.epochs:
                print(f"resuming {run_dir} at epoch {start + 1}/{cfg.schedule.epochs}")
            else:
                print(f"resuming {run_dir}: its {cfg.schedule.epochs} epochs are done; the final evaluation runs")
            for key, (a, b) in changed.items():
                print(f"  --set {key}: {a!r} -> {b!r} (recorded in {run_dir / RESUMES})")
    elif dist.all_reduce_any(not _restartable(run_dir), device):
        if (run_dir / ckpt.CHECKPOINT).is_file():
            raise FileExistsError(
                f"run folder {run_dir} holds a run: continue it with `infosieve train --resume {run_dir}`, or choose "
                "another --out"
            )
        raise FileExistsError(f"run folder {run_dir} is not empty (and not a run folder): choose another --out")
    elif run_dir.is_dir() and any(run_dir.iterdir()) and main:
        print(f"{run_dir} holds no checkpoint (the run was stopped before its first epoch ended): starting it again")
        _clear_for_restart(run_dir)
    trainer_cfg = cfg
    if state is not None and cfg.model.pretrained:  # every weight is in the checkpoint; the file may have moved
        trainer_cfg = copy.deepcopy(cfg)
        trainer_cfg.model.pretrained = None
    trainer = Trainer(trainer_cfg, source, backbone)
    trainer.cfg = cfg  # what the checkpoints record
    if state is not None:
        trainer.load_state_dict(state)
    else:
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "config.yaml")
        status = status_line("before training: test-view feature pass + SS-k-means")
        start, before = 0, trainer.evaluate()
        status.close()
        print_table({"before": before}, cfg.train.eval_protocol)
    board = tensorboard_writer(run_dir, start) if cfg.train.tensorboard and main else None
    for epoch in range(start, cfg.schedule.epochs):
        record = trainer.train_epoch(epoch)
        every = cfg.train.eval_every
        if every and (epoch + 1) % every == 0:
            record.update(trainer.evaluate_epoch())
        if board is not None:
            log_scalars(board, record)
        if main:
            write_unreadable(run_dir, trainer)
            # the log line first: a kill between the two leaves a line the checkpoint lacks, dropped on resume (the
            # other order would lose the epoch's line)
            ckpt.append_log(log_path, record)
            ckpt.save_checkpoint(run_dir, trainer.state_dict(epoch + 1, before))
            print(
                f"epoch {epoch + 1}/{cfg.schedule.epochs}  loss {record['loss_total']:.4f}  lr {record['lr']:.3g}  "
                f"age {record['age']:.2f}  base {record['base']:.3f}  {record['seconds']:.1f}s"
            )
        dist.barrier()  # the checkpoint is on disk before any rank moves on (or stops)
        if stop_after is not None and stop_after(epoch):
            return None
    status = status_line("after training: test-view feature pass + SS-k-means")
    final = trainer.evaluate_full()
    status.close()
    after = final.metrics
    metrics = {"before": before, "after": after, "protocol": cfg.train.eval_protocol}
    trainer.centers = final.clustering.centers.cpu()
    if main:
        ckpt.save_checkpoint(run_dir, trainer.state_dict(cfg.schedule.epochs, before))  # with the final centres
        write_clustering(run_dir, final, trainer.source.n_old)
        ckpt.write_json(metrics_path, metrics)
    print_table({"before": before, "after": after}, cfg.train.eval_protocol)
    if main:
        at = "for the final evaluation" if start >= cfg.schedule.epochs else f"at epoch {start + 1}"
        session = "" if state is None else f" (this session, resumed {at})"
        print(f"\nfinished in {format_duration(time.perf_counter() - started)}{session}; run folder: {run_dir}")
        print_next_steps(run_dir)
    dist.barrier()
    return metrics


def format_duration(seconds: float) -> str:
    seconds = round(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def print_next_steps(run_dir: Path) -> None:
    run = shlex.quote(str(run_dir))
    print("next:")
    print(f"  infosieve eval --run {run}     # All/Old/New from the checkpoint (--split test: the held-out split)")
    print(f"  infosieve tree --run {run}     # the category tree of the learned codes")
    print(f"  infosieve report --run {run}   # report.html: losses, schedules, accuracy, confusion, the tree")


def tensorboard_writer(run_dir: Path, start_epoch: int):
    """`train.tensorboard`: a SummaryWriter on RUN/tensorboard; a resumed run drops the events after its checkpoint."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_epoch + 1)


def log_scalars(board, record: dict) -> None:
    """Every number of an epoch's log record as a scalar at step epoch + 1 (eval dicts as eval/all, ...)."""
    step = record["epoch"] + 1
    for key, value in record.items():
        if isinstance(value, dict):
            for part, v in value.items():
                board.add_scalar(f"{key}/{part}", v, step)
        elif key != "epoch" and isinstance(value, int | float):
            board.add_scalar(key, value, step)
    board.flush()


def write_clustering(run_dir: Path, final: Evaluation, n_old: int) -> None:
    """`RUN/clustering.npz`: the final clustering of the unlabelled train samples (uq, target, cluster) that the
    reported metrics score, for `infosieve report`."""
    import numpy as np

    unl = final.unlabelled
    arrays = {"uq": torch.nonzero(unl).squeeze(1), "targets": final.targets[unl], "preds": final.clustering.labels[unl]}
    arrays = {k: v.cpu().numpy() for k, v in arrays.items()}
    ckpt.atomic_write(run_dir / "clustering.npz", lambda f: np.savez(f, n_old=n_old, **arrays))


def write_unreadable(run_dir: Path, trainer: Trainer) -> None:
    """`RUN/unreadable.json`: the train samples left out because they could not be read (only when there are some)."""
    if not trainer.unreadable:
        return
    describe = getattr(trainer.source, "describe", lambda uq: {"uq": uq})
    entries = [describe(uq) for uq in trainer.unreadable]
    ckpt.write_json(run_dir / "unreadable.json", {"count": len(entries), "samples": entries})


def trainer_from_run(run_dir: str | Path) -> Trainer:
    """A trainer holding a run folder's last checkpoint (its config and weights), for commands that read a run."""
    from .config import from_saved

    state = ckpt.load_checkpoint(run_dir)
    cfg = from_saved(state["config"])
    cfg.model.pretrained = None  # the checkpoint holds every weight; the backbone file may have moved since
    trainer = Trainer(cfg)
    trainer.model.load_state_dict(state["model"])
    trainer.centers = state.get("centers")
    trainer.n_clusters = state.get("n_clusters")
    return trainer


def code_tree(run_dir: str | Path, max_depth: int = 8) -> dict:
    """The implicit category tree of a run's checkpoint: codes of the train samples (test view), cut by the mask.
    The root also holds `measures`: `code_metrics.evaluate_codes` of the same codes (on the unlabelled samples)."""
    from .code_metrics import code_features, evaluate_codes

    trainer = trainer_from_run(run_dir)
    fs = code_features(trainer)
    length = trainer.cfg.model.code_length
    tree = build_tree(code_strings(fs.feats[:, :length], fs.feats[:, length:]), fs.targets.cpu(), max_depth)
    tree["measures"] = evaluate_codes(trainer, fs)
    tree["class_names"] = list(trainer.source.class_names)  # target order: what the report labels nodes with
    return tree
