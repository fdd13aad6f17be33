"""Feature passes, SS-k-means clustering and All/Old/New scoring of a model on a data source.

An `Evaluator` holds what these read, explicitly: the model, the data source, the augmentation, the device, the
k-means and evaluation settings, the token cache and the compile outcome (a compiled model sees one batch size), plus
two pieces of the run's state it keeps: the train samples found unreadable and K once resolved. The Trainer builds one
per run (`Trainer.evaluator`); its pseudo-label rounds and its evaluations run through it, and so do the code measures
(`code_metrics`) and the checkpoint criteria (`best_checkpoint`).

Under torchrun each rank passes over its share of the train set; the clustering runs on the shards (exact: the global
clustering) and the tables are all-gathered, so every rank holds the complete table and the same All/Old/New.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..common import distributed as dist
from ..common.distributed import rank_seed
from ..common.wording import counted
from ..config.settings import KMeansConfig
from ..data.reading.augment import DeviceAugment
from ..data.reading.base import GCDSource
from ..kmeans import semi_supervised_kmeans
from ..network.compiling import CompileOutcome
from ..network.model import InfoSieve, PrefixTokens
from ..network.token_cache import TokenCache
from .discovery import unscored_parts
from .metrics import evaluate_split


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

    def unlabelled_table(self, n_old: int) -> dict:
        """{"uq", "targets", "preds" (numpy, of the unlabelled samples), "n_old"}: what RUN/clustering.npz holds, and
        what the report, the gallery and the tree's novel-cluster places read."""
        unl = self.unlabelled
        arrays = {"uq": unl.nonzero().squeeze(1), "targets": self.targets[unl], "preds": self.clustering.labels[unl]}
        return {k: v.cpu().numpy() for k, v in arrays.items()} | {"n_old": n_old}


@dataclass
class ClusterCount:
    """K of every SS-k-means round of a run (kept in checkpoints): None until the first round resolves it."""

    value: int | None = None


@dataclass
class Evaluator:
    """Feature passes, clustering and scoring of `model` on `source`. `unreadable` and `k` are the run's: a pass that
    finds other unreadable samples updates the list in place (and excludes them from the source), the first clustering
    sets K."""

    model: InfoSieve  # the plain module (not the DDP wrapper)
    source: GCDSource
    augment: DeviceAugment
    device: torch.device
    kmeans: KMeansConfig
    protocol: str  # train.eval_protocol
    seed: int  # train.seed: the checkpoint criteria's k-means seed
    feature_batch_size: int
    token_cache: TokenCache
    autocast: Callable[[], torch.autocast]  # bf16 autocast as the run's forwards use it
    compiled: CompileOutcome | None  # None before compiling (the passes then run eagerly)
    unreadable: list[int]  # uq of the train samples no rank could read (found by the feature passes)
    k: ClusterCount

    # -------------------------------------------------------------------------------------------- feature pass
    @torch.no_grad()
    def features(self, view: str, seed: int = 0, embed: Callable[[Tensor], Tensor] | None = None) -> FeatureSet:
        """Backbone features of this rank's share of the train samples: `view="train"` (augmented view 0, as the
        reference's pseudo-labelling pass) or `"test"` (centre crop, as its evaluation). Checks that the shares
        together hold every train sample exactly once. `embed` replaces the backbone features (e.g. by codes)."""
        embed = embed or self.model.features
        dist.broadcast_buffers(self.model)  # e.g. BatchNorm statistics: each rank's last DDP forward left its own
        self.model.eval()
        if view == "test":
            parts = list(self.test_view_features("train", embed))
        else:
            parts = []
            gen = torch.Generator(device=self.device).manual_seed(rank_seed(seed))
            for batch in self.source.feature_batches(self.feature_batch_size):
                batch = batch.to(self.device, non_blocking=True)
                x = self.augment.train_views(batch.images, 1, gen, batch.sizes)
                with self.autocast():
                    parts.append((self.full_batch(embed, x), batch.targets, batch.labelled, batch.uq))
        self.model.train()
        if parts:
            feats, targets, labelled, uq = (torch.cat(t) for t in zip(*parts, strict=True))
        else:  # a rank with an empty share (fewer samples than ranks)
            feats = torch.empty(0, self.model.backbone.feat_dim, device=self.device)
            targets, labelled = torch.empty(0, dtype=torch.long, device=self.device), torch.empty(0, device=self.device)
            uq = torch.empty(0, dtype=torch.long, device=self.device)
        uq, order = uq.long().sort()
        all_uq = dist.all_gather_cat(uq)[0]
        self._check_every_sample_once(all_uq)
        return FeatureSet(feats[order], targets[order].long(), labelled[order].bool(), uq, all_uq)

    def _check_every_sample_once(self, all_uq: Tensor) -> None:
        """Raise unless the ranks' shares and the unreadable samples together hold every train sample once; record
        the unreadable ones (never drawn for training)."""
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
            self.unreadable[:] = unreadable.tolist()
            self.source.exclude(self.unreadable)

    def test_view_features(self, split: str, embed: Callable) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """(features, targets, labelled, uq) of this rank's test-view batches of `split` ("train" or "test"), in the
        fixed feature-pass order: replayed from the token cache when it holds the split, else computed (and recorded
        when the frozen prefix may be cached)."""
        autocast = self.autocast()
        replay = self.token_cache.replay(split)
        if replay is not None:
            for entry in replay:
                with autocast:
                    f = self.full_batch(embed, PrefixTokens(entry.tokens.to(self.device, non_blocking=True)))
                yield f, *(t.to(self.device, non_blocking=True) for t in (entry.targets, entry.labelled, entry.uq))
            return
        size = self.feature_batch_size
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
                    tokens = self.full_batch(backbone.frozen_tokens, x)
                    recorder.add(tokens, batch)
                    x = PrefixTokens(tokens)
                f = self.full_batch(embed, x)
            yield f, batch.targets, batch.labelled, batch.uq
        if recorder is not None:
            recorder.finish()

    def full_batch(self, fn: Callable, x: Tensor | PrefixTokens) -> Tensor:
        """`fn(x)` for a feature-pass batch. Compiled modules see one batch size in every pass: a smaller batch (the
        last of a split) is padded to `feature_batch_size` rows with copies of its first row and the output cut
        back, so no pass compiles a graph for its remainder (in evaluation mode each row is computed alone)."""
        rows = x.tokens if isinstance(x, PrefixTokens) else x
        size, n = self.feature_batch_size, len(rows)
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

    # -------------------------------------------------------------------------------------------- clustering
    def clusters(self, fs: FeatureSet) -> int:
        """K of every SS-k-means round: `kmeans.n_clusters`, the dataset's classes when null; "auto" is estimated once,
        from the first features clustered (the test-view features before training), on every rank alike."""
        if self.k.value is None:
            k = self.kmeans.n_clusters
            if k is None:
                self.k.value = self.source.n_classes
            elif k == "auto":
                self.k.value = self._estimate_k(fs)
            else:
                self.k.value = int(k)
        return self.k.value

    def _estimate_k(self, fs: FeatureSet) -> int:
        """`kmeans.n_clusters=auto`: K estimated from `fs` (all ranks' shares) by `kmeans.k_rule`, said on the
        terminal."""
        from .estimate_k import describe_choice, estimate_k, k_warning
        from .feature_view import describe_feature_view

        feats, targets, labelled = (dist.all_gather_cat(t)[0].cpu() for t in (fs.feats, fs.targets, fs.labelled))
        main = dist.is_main_process()
        say = (lambda line: print(f"kmeans.n_clusters=auto: {line}")) if main else None
        found = estimate_k(
            feats.numpy(), targets.numpy(), labelled.numpy(), self.source.n_old, rule=self.kmeans.k_rule, progress=say
        )
        if main:
            n = self.source.n_classes
            known = counted(n, "class") if n is not None else f"{counted(self.source.n_old, 'known class')} and a pool"
            said = describe_choice(found)
            print(f"kmeans.n_clusters=auto: estimated K = {found['k']} (the dataset has {known}); {said}")
            view = describe_feature_view(self.augment.cfg.crop_size, getattr(self.source, "size", None))
            print(f"kmeans.n_clusters=auto: {view}")
            warning = k_warning(found)
            if warning:
                print(f"kmeans.n_clusters=auto: WARNING: {warning}")
        return found["k"]

    def cluster(self, fs: FeatureSet, seed: int, balanced: bool, n_clusters: int | None = None) -> Clustering:
        """SS-k-means cluster id of every train sample, indexed by uq (complete on every rank), the inertia and the
        centres. `n_clusters`: K of this round instead of the run's (`clusters`; then a balanced round's capacity is
        ceil(N / K), not `kmeans.cluster_size`)."""
        k = self.kmeans
        lab = fs.labelled
        result = semi_supervised_kmeans(
            fs.feats[~lab],
            fs.feats[lab],
            fs.targets[lab],
            self.clusters(fs) if n_clusters is None else n_clusters,
            n_init=k.n_init,
            max_iter=k.max_iter,
            tol=k.tol,
            balanced=balanced,
            balance=k.balance,
            cluster_size=k.cluster_size if balanced and n_clusters is None else None,
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

    def assign(self, fs: FeatureSet, centers: Tensor) -> Clustering:
        """Every train sample of `fs` to the row of `centers` [K, D] (unit rows) with the largest dot product with its
        feature, its nearest (a head's prediction: `Method.prediction_centres`), as a `Clustering` with those centres;
        the inertia is the sum of the squared distances to them."""
        centers = centers.to(self.device).float()
        labels = (fs.feats @ centers.T).argmax(1)
        inertia = float(dist.all_reduce_sum((fs.feats - centers[labels]).pow(2).sum()))
        return Clustering(self.gather_table(fs, labels), inertia, centers)

    # -------------------------------------------------------------------------------------------- scoring
    def evaluate(self, fs: FeatureSet) -> Evaluation:
        """All/Old/New of SS-k-means on `fs` (the run's K, `kmeans.eval_balanced`, seed 0), on the unlabelled train
        samples (all ranks' shares: every rank returns the same numbers)."""
        return self.score_clustering(fs, self.cluster(fs, seed=0, balanced=self.kmeans.eval_balanced))

    def score_clustering(self, fs: FeatureSet, clustering: Clustering) -> Evaluation:
        """`clustering` (of `fs`) scored on the unlabelled train samples."""
        targets = self.gather_table(fs, fs.targets)
        unl = self.gather_table(fs, (~fs.labelled).long(), fill=0).bool()  # unlabelled and readable
        return Evaluation(self.score(targets[unl], clustering.labels[unl]), clustering, targets, unl)

    def score(self, targets: Tensor, preds: Tensor) -> dict[str, float | None]:
        """All/Old/New of `preds` against `targets` with the run's protocol; None for a part no label can score (an
        unlabelled pool's New), never a 0."""
        metrics = evaluate_split(targets, preds, targets < self.source.n_old, self.protocol)
        for part in unscored_parts(targets.cpu().numpy(), self.source.n_old):
            metrics[part] = None
        return metrics

    def has_test_split(self) -> bool:
        """Whether the source has test images to score (shards without a test split record 0 of them)."""
        n_test = getattr(self.source, "manifest", {}).get("counts", {}).get("test", 1)
        return hasattr(self.source, "test_batches") and bool(n_test)

    @torch.no_grad()
    def evaluate_test(self, centers: Tensor, shards: str | None = None) -> dict[str, float]:
        """Inductive All/Old/New on the held-out test split (the published "Test ACC"): each test image goes to the
        nearest of `centers` (a clustering of the train samples), scored with the run's protocol. `shards`:
        `data.shards`, named when they hold no test split."""
        if not hasattr(self.source, "test_batches"):
            raise ValueError(
                f"the data source ({type(self.source).__name__}) has no test split: the digits demo has none; train "
                "from shards (make-shards writes the test split) to evaluate on it"
            )
        if not self.has_test_split():
            raise ValueError(
                f"the run's shards ({shards}) hold no test split (your own images and WebDataset shards "
                "from other tools have none): drop --split test; `infosieve eval --run RUN` scores the unlabelled "
                "train samples (make-shards --holdout gives an own-images run labelled images to score)"
            )
        self.model.eval()
        centers = centers.to(self.device).float()
        preds, targets = [], []
        for f, y, _, _ in self.test_view_features("test", self.model.features):
            preds.append(torch.cdist(f.float(), centers).argmin(1))
            targets.append(y)
        self.model.train()
        y = dist.all_gather_cat(torch.cat(targets))[0]
        return self.score(y, dist.all_gather_cat(torch.cat(preds))[0])


def epoch_log(ev: Evaluator, full: Evaluation) -> dict:
    """`train.eval_every`'s log entries: `full` (`Evaluator.evaluate` of the test-view features)'s All/Old/New on the
    unlabelled train samples and, where the source has one, on the test split (nearest of `full`'s centres);
    `eval_codes`: what the codes hold (`code_metrics.evaluate_codes`: one more pass of the model over the train set,
    one k-means round on codes)."""
    from .code_metrics import evaluate_codes

    out = {"eval": full.metrics}
    if ev.has_test_split():
        out["eval_test"] = ev.evaluate_test(full.clustering.centers)
    if ev.model.labeller is not None:  # a method with codes
        out["eval_codes"] = evaluate_codes(ev)
    return out
