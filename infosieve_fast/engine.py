"""The training loop: per epoch a feature pass, semi-supervised k-means pseudo-labels, then two-view training steps.

Every random draw of an epoch comes from generators seeded by (train.seed, epoch), so a run resumed from its
checkpoint repeats the uninterrupted run's schedule, sampling, augmentation and clustering exactly.

Under torchrun (one process per GPU, `torch.distributed` initialised) the model is wrapped in DistributedDataParallel;
each rank runs the feature pass on its share of the train set, the semi-supervised k-means runs on the shards (exact:
the global clustering) and the pseudo-label and evaluation tables are all-gathered, so every rank holds the complete
table and the same All/Old/New. `data.batch_size` is per rank. `run_folder.py` runs the Trainer in a run folder.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm import tqdm

from . import checkpoint as ckpt
from . import distributed as dist
from .compiling import CompileOutcome, check_compile_setting, compile_with_fallback, compiled_modules, probe_stage
from .config import Config
from .data import InMemoryGCD, build_source
from .data.augment import AugmentConfig, DeviceAugment
from .data.base import Batch, GCDSource
from .data.decode import DecodeWindow
from .discovery import unscored_parts
from .kmeans import semi_supervised_kmeans
from .loss import InfoSieveLoss, check_labelled_targets
from .loss_monitor import LossMonitor
from .metrics import evaluate_split
from .model import Backbone, PrefixTokens
from .preemption import MidEpoch, StoppedMidEpoch, StopSignals, gather_rank_states
from .schedule import epoch_schedule
from .step_graph import GraphedStep, StepInputs, StepOutputs
from .token_cache import TokenCache
from .trainer_setup import (
    autocast_enabled,
    build_model,
    build_optimizer,
    check_source_fits,
    epoch_seed,
    load_optimizer_state,
    rank_seed,
    resolve_device,
)


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


class Trainer:
    """Training of `cfg` on `source` (built from `cfg.data` when None). `pretrained=False` for a trainer a checkpoint
    fills (`load_state_dict`, `load_model_state`): its backbone is built without `model.pretrained`."""

    def __init__(
        self, cfg: Config, source: GCDSource | None = None, backbone: Backbone | None = None, *, pretrained: bool = True
    ):
        self.cfg = cfg
        self.device = resolve_device(cfg.train.device)
        self.source = source if source is not None else build_source(cfg.data, cfg.train, self.device)
        check_source_fits(cfg, self.source)
        if self.device.type == "cuda" and isinstance(self.source, InMemoryGCD):
            self.source = self.source.to(self.device)  # small by definition; batches then never cross the bus
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg, self.source.n_old, backbone, pretrained).to(self.device)
        self.loss_fn = InfoSieveLoss(cfg.loss, self.source.n_old, backend=cfg.train.kernels)
        d = cfg.data
        self.augment = DeviceAugment(AugmentConfig(d.crop_size, d.hflip, tuple(d.mean), tuple(d.std), d.color_jitter))
        self.amp = autocast_enabled(cfg.train.amp, self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        check_compile_setting(cfg.train.compile, self.device)
        self.compiled: CompileOutcome | None = None  # set by the first `train_epoch` (evaluation alone stays eager)
        self.step_graph = GraphedStep.for_setting(
            cfg.train.cuda_graph, self.device, dist.get_world_size(), self.optimizer
        )
        # a capture must not keep autocast's weight casts; every forward runs with the same setting, so a compiled
        # module (whose guards read it) is compiled once
        self._autocast_cache = not self.step_graph.active
        self.token_cache = TokenCache(cfg.train.token_cache, self.device, cfg.data.memory_threshold_mb)
        self.decoding = DecodeWindow(self.source)  # each epoch record: the images decoded since the last, by where
        # `self.model` stays the plain module (checkpoints, feature passes); `self.net` runs the training forward.
        # Every trainable parameter takes part in every loss (the categorizer too: an empty labelled batch gives it a
        # zero gradient, not none), and the frozen backbone prefix has requires_grad=False, so DDP needs no
        # find_unused_parameters.
        self.net: torch.nn.Module = self.model
        self.unreadable: list[int] = []  # uq of the train samples no rank could read (found by the feature passes)
        # the latest SS-k-means centres [K, D] (CPU): the epoch's pseudo-label round, then the final evaluation's
        self.centers: Tensor | None = None
        self.n_clusters: int | None = None  # K, resolved by `clusters` on the first round (kept in checkpoints)
        self.stop: StopSignals | None = None  # asked before every step (run_folder.train sets it)
        self.mid_epoch: MidEpoch | None = None  # a preempted epoch to finish (`load_state_dict`)
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
        if view == "test":
            parts = list(self._test_view_features("train", embed))
        else:
            parts = []
            gen = self._generator(rank_seed(seed))
            for batch in self.source.feature_batches(self.cfg.data.feature_batch_size):
                batch = batch.to(self.device, non_blocking=True)
                x = self.augment.train_views(batch.images, 1, gen, batch.sizes)
                with self.autocast():
                    parts.append((self._full_batch(embed, x), batch.targets, batch.labelled, batch.uq))
        self.model.train()
        if parts:
            feats, targets, labelled, uq = (torch.cat(t) for t in zip(*parts, strict=True))
        else:  # a rank with an empty share (fewer samples than ranks)
            feats = torch.empty(0, self.model.backbone.feat_dim, device=self.device)
            targets, labelled = torch.empty(0, dtype=torch.long, device=self.device), torch.empty(0, device=self.device)
            uq = torch.empty(0, dtype=torch.long, device=self.device)
        uq, order = uq.long().sort()
        all_uq = dist.all_gather_cat(uq)[0]
        mine_unreadable = torch.as_tensor(self.source.unreadable(), dtype=torch.long, device=self.device)
        unreadable = dist.all_gather_cat(mine_unreadable)[0].unique()
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

    def _test_view_features(self, split: str, embed: Callable) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """(features, targets, labelled, uq) of this rank's test-view batches of `split` ("train" or "test"), in the
        fixed feature-pass order: replayed from the token cache when it holds the split, else computed (and recorded
        when the frozen prefix may be cached)."""
        autocast = self.autocast()
        replay = self.token_cache.replay(split)
        if replay is not None:
            for entry in replay:
                with autocast:
                    f = self._full_batch(embed, PrefixTokens(entry.tokens.to(self.device, non_blocking=True)))
                yield f, *(t.to(self.device, non_blocking=True) for t in (entry.targets, entry.labelled, entry.uq))
            return
        size = self.cfg.data.feature_batch_size
        if split == "train":
            batches, n = self.source.feature_batches(size), self.source.n_train
        else:
            counts = getattr(self.source, "manifest", {}).get("counts", {})
            batches, n = self.source.test_batches(size), counts.get("test") or self.source.n_train
        backbone = self.model.backbone
        recorder = self.token_cache.recorder(split, -(-n // dist.get_world_size())) if backbone.prefix_is_pure else None
        for batch in batches:
            batch = batch.to(self.device, non_blocking=True)
            x = self.augment.test_view(batch.images, batch.sizes)
            with autocast:
                if recorder is not None:
                    tokens = self._full_batch(backbone.frozen_tokens, x)
                    recorder.add(tokens, batch)
                    x = PrefixTokens(tokens)
                f = self._full_batch(embed, x)
            yield f, batch.targets, batch.labelled, batch.uq
        if recorder is not None:
            recorder.finish()

    def _full_batch(self, fn: Callable, x: Tensor | PrefixTokens) -> Tensor:
        """`fn(x)` for a feature-pass batch. Compiled modules see one batch size in every pass: a smaller batch (the
        last of a split) is padded to `data.feature_batch_size` rows with copies of its first row and the output cut
        back, so no pass compiles a graph for its remainder (in evaluation mode each row is computed alone)."""
        rows = x.tokens if isinstance(x, PrefixTokens) else x
        size, n = self.cfg.data.feature_batch_size, len(rows)
        if n == size or self.compiled is None or not self.compiled.compiled:
            return fn(x)
        padded = torch.cat([rows, rows[:1].expand(size - n, *rows.shape[1:])])
        return fn(PrefixTokens(padded) if isinstance(x, PrefixTokens) else padded)[:n]

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
                main = dist.is_main_process()
                say = (lambda line: print(f"kmeans.n_clusters=auto: {line}")) if main else None
                found = estimate_k(feats.numpy(), targets.numpy(), labelled.numpy(), self.source.n_old, progress=say)
                self.n_clusters = found["k"]
                if main:
                    n = self.source.n_classes
                    known = f"{n} classes" if n is not None else f"{self.source.n_old} known classes and a pool"
                    low, high = found["k_range"]
                    print(
                        f"kmeans.n_clusters=auto: estimated K = {self.n_clusters} (the dataset has {known}); "
                        f"plausible K {low}-{high}, within one standard error of the best score (K = "
                        f"{found['k_by_argmax']}); the smallest is chosen"
                    )
            else:
                self.n_clusters = int(k)
        return self.n_clusters

    def cluster(self, fs: FeatureSet, seed: int, balanced: bool) -> Clustering:
        """SS-k-means cluster id of every train sample, indexed by uq (complete on every rank), the inertia and the
        centres."""
        k = self.cfg.kmeans
        lab = fs.labelled
        result = semi_supervised_kmeans(
            fs.feats[~lab],
            fs.feats[lab],
            fs.targets[lab],
            self.clusters(fs),
            n_init=k.n_init,
            max_iter=k.max_iter,
            tol=k.tol,
            balanced=balanced,
            balance=k.balance,
            cluster_size=k.cluster_size if balanced else None,
            freeze_labelled_centers=k.freeze_labelled_centers,
            seed=seed,
            backend=k.backend,
            distance_precision=k.distance_precision,
        )
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
        return Evaluation(self.score(y, clustering.labels[unl]), clustering, targets, unl)

    def score(self, targets: Tensor, preds: Tensor) -> dict[str, float | None]:
        """All/Old/New of `preds` against `targets` with the run's protocol; None for a part no label can score (an
        unlabelled pool's New), never a 0."""
        metrics = evaluate_split(targets, preds, targets < self.source.n_old, self.cfg.train.eval_protocol)
        for part in unscored_parts(targets.cpu().numpy(), self.source.n_old):
            metrics[part] = None
        return metrics

    def has_test_split(self) -> bool:
        """Whether the source has test images to score (shards without a test split record 0 of them)."""
        n_test = getattr(self.source, "manifest", {}).get("counts", {}).get("test", 1)
        return hasattr(self.source, "test_batches") and bool(n_test)

    @torch.no_grad()
    def evaluate_test(self, centers: Tensor) -> dict[str, float]:
        """Inductive All/Old/New on the held-out test split (the published "Test ACC"): each test image goes to the
        nearest of `centers` (a clustering of the train samples), scored with the run's protocol."""
        if not hasattr(self.source, "test_batches"):
            raise ValueError(
                f"the data source ({type(self.source).__name__}) has no test split: the digits demo has none; train "
                "from shards (make-shards writes the test split) to evaluate on it"
            )
        if not self.has_test_split():
            raise ValueError(
                f"the run's shards ({self.cfg.data.shards}) hold no test split (your own images and WebDataset shards "
                "from other tools have none): drop --split test; `infosieve eval --run RUN` scores the unlabelled "
                "train samples (make-shards --holdout gives an own-images run labelled images to score)"
            )
        self.model.eval()
        centers = centers.to(self.device).float()
        preds, targets = [], []
        for f, y, _, _ in self._test_view_features("test", self.model.features):
            preds.append(torch.cdist(f.float(), centers).argmin(1))
            targets.append(y)
        self.model.train()
        y = dist.all_gather_cat(torch.cat(targets))[0]
        return self.score(y, dist.all_gather_cat(torch.cat(preds))[0])

    def evaluate_epoch(self) -> dict:
        """`train.eval_every`'s log entries: All/Old/New on the unlabelled train samples and, where the source has
        one, on the test split (nearest centre of the train clustering); `eval_codes`: what the codes hold
        (`code_metrics.evaluate_codes`: one more pass of the model over the train set, one k-means round on codes)."""
        from .code_metrics import evaluate_codes

        ev = self.evaluate_full()
        out = {"eval": ev.metrics}
        if self.has_test_split():
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
            self.unreadable = list(resumed.unreadable)
            self.source.exclude(self.unreadable)
            pseudo, inertia = resumed.pseudo.to(self.device), resumed.inertia
            features_done = kmeans_done = time.perf_counter()

        monitor = self._run_steps(name, epoch, pseudo, resumed)
        if monitor.stopped is not None:
            raise StoppedMidEpoch(MidEpoch(epoch, monitor.steps, pseudo, inertia, self.unreadable, monitor.stopped))
        record = {
            "epoch": epoch,
            "lr": sched.lr,
            "age": sched.age,
            "base": sched.base,
            "steps": monitor.steps,
            "unreadable": len(self.unreadable),
        }
        record.update({f"loss_{k}": v for k, v in monitor.means().items()})
        end = time.perf_counter()  # monitor.check() read the device: the steps have finished
        record.update(
            {
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
        )
        return record

    def _pseudo_labels(self, name: str, epoch: int) -> tuple[Tensor, float, float, float]:
        """The epoch's feature pass and SS-k-means round: the pseudo-label table, the inertia, and the times each
        finished; the round's centres become `self.centers`."""
        cfg = self.cfg
        status = status_line(f"{name}: feature pass ({self.source.n_train} samples)")
        fs = self.extract_features("train", seed=epoch_seed(cfg.train.seed, epoch, 1))
        check_labelled_targets(fs.targets, fs.labelled, self.source.n_old)  # once here, not in every step
        features_done = time.perf_counter()  # the checks above read the device: the feature pass has finished
        status.set_description_str(f"{name}: SS-k-means pseudo-labels")
        clustering = self.cluster(fs, seed=epoch_seed(cfg.train.seed, epoch, 2), balanced=cfg.kmeans.balanced)
        self.centers = clustering.centers.cpu()
        kmeans_done = time.perf_counter()  # so has the clustering (its inertia is a host float)
        status.close()
        return clustering.labels, clustering.inertia, features_done, kmeans_done

    def _run_steps(self, name: str, epoch: int, pseudo: Tensor, resumed: MidEpoch | None) -> LossMonitor:
        """The epoch's training steps on its pseudo-labels (after `resumed`'s, when it finishes a preempted epoch),
        under a progress bar; returns their checked losses. When the ranks agree to stop (`self.stop`) before a step,
        it returns at once with every rank's generators and loss sums in the monitor's `stopped`."""
        cfg = self.cfg
        gen = self._generator(rank_seed(epoch_seed(cfg.train.seed, epoch, 3)))
        monitor = LossMonitor(epoch)
        if resumed is not None:
            mine = resumed.rank_state()
            gen.set_state(mine["augment"])
            monitor.resume(resumed.step, mine, self.device)
            ckpt.restore_rng_state(mine["torch_rng"])
        batches = self.source.train_batches(cfg.data.batch_size, epoch, cfg.train.seed, skip=monitor.steps)
        bar = tqdm(
            batches,
            desc=name,
            initial=monitor.steps,
            total=self.steps_per_epoch(),
            unit="step",
            leave=False,
            dynamic_ncols=True,
            disable=not dist.is_main_process(),
        )
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
            status = status_line(f"train.compile={self.cfg.train.compile}: compiling")
            self.compiled = compile_with_fallback(
                compiled_modules(self.model), self.cfg.train.compile, self.device, self._trace_graphs
            )
            status.close()
            paid = self.compiled.seconds
        return {"compile": self.compiled.path, "compile_graphs": self.compiled.graphs, "seconds_compile": paid}

    def _trace_graphs(self) -> None:
        """Run every graph a run uses once, at its shapes: the step's forward and backward (both views of a batch)
        and the feature pass's forward, each a named `probe_stage`. Parameters, buffers, gradients, the RNG and the
        training mode are left as they were, also when a stage fails (compiling goes on without the failing class)."""
        d, model = self.cfg.data, self.model
        buffers, training = [b.clone() for b in model.buffers()], model.training
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                shape = (len(d.mean), d.crop_size, d.crop_size)  # the images' channels, as the augmentation checks
                with self.autocast(), probe_stage("the step's forward"):
                    out = model(torch.zeros(2 * d.batch_size, *shape, device=self.device))
                with probe_stage("the step's backward"):
                    (out.projection.sum() + out.backbone.float().sum()).backward()
                model.eval()
                with torch.no_grad(), self.autocast():
                    self._trace_feature_passes(torch.zeros(d.feature_batch_size, *shape, device=self.device))
        finally:
            model.train(training)
            self.optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for buffer, saved in zip(model.buffers(), buffers, strict=True):
                    buffer.copy_(saved)

    def _trace_feature_passes(self, x: Tensor) -> None:
        """The forwards of the feature passes at their one batch size (`_full_batch`): backbone features and the
        codes' pass (the whole model), on images and, where the token cache may hold the frozen prefix's output, on
        that output as the cache records and replays it."""
        model = self.model
        with probe_stage("the feature passes on images"):
            model.features(x)
            model(x)
        if model.backbone.prefix_is_pure:
            with probe_stage("the feature passes on the token cache's frozen-prefix output"):
                tokens = PrefixTokens(model.backbone.frozen_tokens(x))
                model.features(tokens)
                model(tokens)

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
        inputs = StepInputs(views, batch.targets, batch.labelled, pseudo[batch.uq])
        monitor.record(self.step_graph(self._step, inputs, self._baked_host_values()))

    def _step(self, inputs: StepInputs) -> StepOutputs:
        """Forward, loss, backward and update on `inputs`; the loss terms (what a CUDA graph records)."""
        with self.autocast():
            out = self.net(inputs.views)
        total, parts = self.loss_fn(out, inputs.targets, inputs.labelled, inputs.pseudo)
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        self.optimizer.step()
        return parts

    def _baked_host_values(self) -> tuple:
        """The host numbers a captured step holds as kernel arguments: the groups' lr and the code head's age."""
        return (*(group["lr"] for group in self.optimizer.param_groups), self.model.labeller._age)

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
        """Continue training from a checkpoint: `load_model_state`, then the optimizer state and the RNG (and, from a
        preempted epoch's checkpoint, where that epoch stopped: `train_epoch` finishes it)."""
        self.load_model_state(state)
        load_optimizer_state(self.optimizer, state["optimizer"])
        ckpt.restore_rng_state(state["torch_rng"])
        if state.get("mid_epoch") is not None:
            self.mid_epoch = MidEpoch.from_state(state["mid_epoch"])

    def load_model_state(self, state: dict) -> None:
        """A checkpoint's weights, k-means centres and K: what evaluating or reading a finished run needs."""
        self.model.load_state_dict(state["model"])
        self.token_cache.clear()  # the frozen prefix's weights may have changed
        self.centers = state.get("centers")
        self.n_clusters = state.get("n_clusters")


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
