"""The published InfoSieve training step and epoch, composed as the published loop does (REFERENCE.md §2-§4).

Written from REFERENCE.md's description of `CT.py` (not copied from the public code). It is the timing baseline of
the training benchmark and the oracle the tests compare one infosieve-fast step against. It keeps the published
structure on purpose:

* fp32, no autocast; the WHOLE backbone runs under autograd (the frozen blocks keep their activations; only
  `requires_grad` differs), as the published freezing rule leaves it (§2.1);
* the loss is built from the transcribed modules of `benchmarks.published.model` (`info_nce_logits` +
  `CrossEntropyLoss(label_smoothing)`, `SupConLoss`, `HLoss`, `NormPLoss`), with `torch.cdist` distances (§3);
* `NormPLoss` keeps the initial base-2 weights while `set_epoch` rebinds the labeller's `code_weight` (the
  stale-weight bug, §3.5);
* plain `torch.optim.SGD` over the labeller, projection-head and backbone parameters (§4);
* per epoch: backbone CLS features of augmented view 0 of every train image, then the published balanced
  SS-k-means (`benchmarks.published.kmeans.ReferenceSSKMeans`, run on the CPU as the published distance matrix is),
  then `N // batch_size` batches from the published `WeightedRandomSampler` (§4).

Augmentation: `published_epoch` takes the views from an `augment(uint8 batch, n_views, generator)` callable. The
benchmark passes infosieve-fast's `DeviceAugment.train_views`, so both systems get identical augmentation on the device
and the comparison is about the training step; the published CPU loader (PIL transforms in DataLoader workers) is
compared separately in `benchmarks/bench_loader.py`.

Nothing here calls `.item()` or synchronises explicitly inside a step. The published code's own boolean-mask
indexing (`features[mask_lab]`, the positive/negative selection in `info_nce_logits`) does synchronise on CUDA; that
is part of what it costs.

Everything runs on the CPU or CUDA: tensors go where the model's parameters are.
"""

from __future__ import annotations

import math
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import timm
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import BatchSampler, WeightedRandomSampler

from . import model as pm
from .kmeans import ReferenceSSKMeans

Augment = Callable[[Tensor, int, torch.Generator], "Tensor | list[Tensor]"]


# -------------------------------------------------------------------------------------------------------------- model
class PublishedModel(nn.Module):
    """The published trio: `backbone` (timm ViT, CLS after the final norm), `projection_head` (DINOHead) and
    `labeller` (DINOLABELLING). `initial_code_weight` is the 2^-k tensor the labeller was built with, the one the
    published `NormPLoss` keeps for the whole run."""

    def __init__(self, backbone: nn.Module, projection_head: nn.Module, labeller: nn.Module, initial_code_weight):
        super().__init__()
        self.backbone, self.projection_head, self.labeller = backbone, projection_head, labeller
        self.initial_code_weight = initial_code_weight

    def param_device(self) -> torch.device:
        return next(self.labeller.parameters()).device

    def _apply(self, fn, recurse=True):
        # `.to(device)` moves the plain-attribute weights along (the published code creates them on its device).
        super()._apply(fn, recurse)
        dev = self.param_device()
        self.labeller.code_weight = self.labeller.code_weight.to(dev)
        self.initial_code_weight = self.initial_code_weight.to(dev)
        return self


def initial_code_weight(code_length: int) -> Tensor:
    """The labeller's construction-time weights 2^-k, k = 0..L-1 (float32, as `torch.pow(2., arange(0, -L, -1))`)."""
    return torch.pow(2.0, torch.arange(0, -code_length, -1))


def freeze_published(backbone: nn.Module, grad_from_block: int) -> None:
    """Every parameter frozen, then those named `blocks.<i>.*` with i >= grad_from_block trainable (§2.1)."""
    for param in backbone.parameters():
        param.requires_grad = False
    for name, param in backbone.named_parameters():
        if "block" in name and int(name.split(".")[1]) >= grad_from_block:
            param.requires_grad = True


def build_published_model(
    n_old: int,
    backbone: str = "vit_base_patch16_224",
    grad_from_block: int = 10,
    code_length: int = 40,
    proj_out_dim: int = 65536,
    backbone_kwargs: dict | None = None,
    proj_hidden_dim: int = 2048,
    proj_bottleneck_dim: int = 256,
    labeller_hidden_dim: int = 128,
) -> PublishedModel:
    """The published model (random weights): timm `backbone` without classifier, DINOHead(feat_dim -> proj_out_dim,
    nlayers=3), DINOLABELLING(proj_out_dim, nlayers=2, bottleneck_dim=code_length, code_weight=2^-k, nclasses=n_old),
    with the published freezing rule. `age` starts at the constructor default (20) until `set_epoch`."""
    net = timm.create_model(backbone, pretrained=False, num_classes=0, **(backbone_kwargs or {}))
    freeze_published(net, grad_from_block)
    head = pm.DINOHead(
        net.num_features, proj_out_dim, nlayers=3, hidden_dim=proj_hidden_dim, bottleneck_dim=proj_bottleneck_dim
    )
    w0 = initial_code_weight(code_length)
    labeller = pm.DINOLABELLING(
        proj_out_dim, nlayers=2, hidden_dim=labeller_hidden_dim, bottleneck_dim=code_length, code_weight=w0,
        nclasses=n_old,
    )  # fmt: skip
    return PublishedModel(net, head, labeller, w0)


def set_epoch(model: PublishedModel, epoch: int, epochs: int) -> None:
    """`age = (epoch+1)/10`, `code_weight = pow(2 - epoch/epochs, arange(0, -L, -1))` REBOUND (§2.3, `CT.py:308-309`).

    The age is the published literal, independent of `epochs` (infosieve-fast's `age_max*(epoch+1)/epochs` equals it
    at 200 epochs only). The new weights are a new tensor on the model's device; the `NormPLoss` of `PublishedLosses`
    keeps the initial 2^-k tensor (the stale-weight bug, §3.5).
    """
    lab = model.labeller
    lab.age = (epoch + 1) / 10
    lab.code_weight = torch.pow(2 - epoch / epochs, torch.arange(0, -lab.code_weight.numel(), -1)).to(
        model.param_device()
    )


def published_optimizer(
    model: PublishedModel, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 1e-4
) -> torch.optim.SGD:
    """`SGD(labeller + projection head + backbone parameters)`, one group, as published (§4). The frozen parameters are
    passed too, as published; they never get a gradient, so SGD skips them."""
    params = [*model.labeller.parameters(), *model.projection_head.parameters(), *model.backbone.parameters()]
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


# --------------------------------------------------------------------------------------------------------------- loss
@dataclass
class PublishedLosses:
    """The loss objects and `args` of the published loop (`CT.py:228-234, 271-279`), built once before the epochs."""

    args: types.SimpleNamespace
    sup_con: pm.SupConLoss
    code_cond: pm.HLoss
    mask_cond: pm.HLoss
    length: pm.NormPLoss
    category: nn.BCEWithLogitsLoss
    unsupervised: nn.CrossEntropyLoss

    @classmethod
    def build(
        cls,
        model: PublishedModel,
        n_old: int,
        smoothing: float = 1.0,
        alpha: float = 1.0,
        beta: float = 1.0,
        delta: float = 0.1,
        zeta: float = 0.01,
        mu: float = 0.01,
        eta: float = 0.01,
        sup_con_weight: float = 0.35,
        sup_code_weight: float = 0.35,
        temperature: float = 1.0,
    ) -> PublishedLosses:
        args = types.SimpleNamespace(
            n_views=2, temperature=temperature, unsupervised_smoothing=smoothing, sup_con_weight=sup_con_weight,
            sup_code_weight=sup_code_weight, alpha=alpha, beta=beta, delta=delta, zeta=zeta, mu=mu, eta=eta,
            n_old=n_old,
        )  # fmt: skip
        # The length loss keeps the construction-time 2^-k tensor (on the model's device, where the published code
        # created it); set_epoch rebinds the labeller's attribute, not this one.
        w0 = model.initial_code_weight.to(model.param_device())
        return cls(
            args=args,
            sup_con=pm.SupConLoss(),
            code_cond=pm.HLoss(is_mask=False),
            mask_cond=pm.HLoss(is_mask=True),
            length=pm.NormPLoss(pnorm=1, code_weight=w0),
            category=nn.BCEWithLogitsLoss(),
            unsupervised=nn.CrossEntropyLoss(label_smoothing=smoothing),
        )


@contextmanager
def _module_device(dev: torch.device) -> Iterator[None]:
    """`info_nce_logits` reads the module-global `device` (as published); point it at the features' device."""
    saved = pm.device
    pm.device = dev
    try:
        yield
    finally:
        pm.device = saved


def published_loss(
    model: PublishedModel,
    images: Tensor,
    class_labels: Tensor,
    mask_lab: Tensor,
    pseudo_labels: Tensor,
    smoothing: float = 1.0,
    losses: PublishedLosses | None = None,
    n_old: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The published loss of one batch (`CT.py:321-411`, REFERENCE §3.10): (total, detached parts).

    `images`: the [2B, ...] view-major concatenation (`torch.cat(views)`); `class_labels` [B] ground truth (read where
    `mask_lab`), `mask_lab` [B] bool, `pseudo_labels` [B] this epoch's cluster ids (overwritten by the ground truth on
    labelled samples). `losses` is the loop's `PublishedLosses`; `smoothing` and `n_old` are read only when it is None,
    to build one here (the same stale weights: it takes the model's `initial_code_weight`).
    """
    if losses is None:
        if n_old is None:
            raise ValueError("published_loss needs `losses` or `n_old`")
        losses = PublishedLosses.build(model, n_old, smoothing)
    a = losses.args
    mask_lab = mask_lab.bool()
    class_labels = class_labels.long()

    features = model.projection_head(model.backbone(images))
    features = F.normalize(features, dim=-1)

    # ---- L_C_in (CT.py:333-360)
    with _module_device(features.device):
        logits, targets = pm.info_nce_logits(features, a)
    in_infonce = losses.unsupervised(logits, targets)
    f1, f2 = (f[mask_lab] for f in features.chunk(2))
    sup_con_labels = class_labels[mask_lab]
    in_supcon_gt = losses.sup_con(torch.cat([f1.unsqueeze(1), f2.unsqueeze(1)], dim=1), labels=sup_con_labels)
    pseudolabels = pseudo_labels.long().clone()
    pseudolabels[mask_lab] = class_labels[mask_lab]
    f1, f2 = features.chunk(2)
    in_supcon_pseudo = losses.sup_con(torch.cat([f1.unsqueeze(1), f2.unsqueeze(1)], dim=1), labels=pseudolabels)
    loss_in = (1 - a.sup_con_weight) * in_infonce + a.sup_con_weight * (in_supcon_gt + in_supcon_pseudo) / 2

    # ---- labeller terms (CT.py:372-385)
    _code_feat, mask, bin_raw, code, trunc_code = model.labeller(features)
    code_cond = losses.code_cond(bin_raw)
    mask_cond = losses.mask_cond(mask)
    length = losses.length(mask)
    t1, t2 = (t[mask_lab] for t in trunc_code.chunk(2))
    cat_logits = model.labeller.categorizer(torch.cat([t1, t2], dim=0))
    onehot = F.one_hot(sup_con_labels, num_classes=a.n_old).repeat(2, 1).to(cat_logits.dtype)
    category = losses.category(cat_logits, onehot)

    # ---- L_C_code (CT.py:387-400): InfoNCE on bin_raw, SupCon on the untruncated weighted code
    with _module_device(features.device):
        logits, targets = pm.info_nce_logits(bin_raw, a, is_code=True)
    code_infonce = losses.unsupervised(logits, targets)
    c1, c2 = (c[mask_lab] for c in code.chunk(2))
    code_supcon_gt = losses.sup_con(
        torch.cat([c1.unsqueeze(1), c2.unsqueeze(1)], dim=1), labels=sup_con_labels, is_code=True
    )
    c1, c2 = code.chunk(2)
    code_supcon_pseudo = losses.sup_con(
        torch.cat([c1.unsqueeze(1), c2.unsqueeze(1)], dim=1), labels=pseudolabels, is_code=True
    )
    loss_code = (1 - a.sup_code_weight) * code_infonce + a.sup_code_weight * (code_supcon_gt + code_supcon_pseudo) / 2

    total = (
        a.alpha * loss_in
        + a.beta * loss_code
        + a.zeta * code_cond
        + a.eta * category
        + a.delta * length
        + a.mu * mask_cond
    )
    parts = {
        "total": total,
        "in": loss_in,
        "in_infonce": in_infonce,
        "in_supcon_gt": in_supcon_gt,
        "in_supcon_pseudo": in_supcon_pseudo,
        "code": loss_code,
        "code_infonce": code_infonce,
        "code_supcon_gt": code_supcon_gt,
        "code_supcon_pseudo": code_supcon_pseudo,
        "code_cond": code_cond,
        "mask_cond": mask_cond,
        "length": length,
        "category": category,
    }
    return total, {k: v.detach() for k, v in parts.items()}


def published_step(
    model: PublishedModel,
    optimizer: torch.optim.Optimizer,
    losses: PublishedLosses,
    images: Tensor,
    class_labels: Tensor,
    mask_lab: Tensor,
    pseudo_labels: Tensor,
) -> Tensor:
    """One published step: zero_grad, forward + loss, backward, SGD step; returns the detached loss tensor, unsynced."""
    optimizer.zero_grad()
    loss, _ = published_loss(model, images, class_labels, mask_lab, pseudo_labels, losses=losses)
    loss.backward()
    optimizer.step()
    return loss.detach()


# ------------------------------------------------------------------------------------------------------------ epoch
@dataclass
class PublishedLoop:
    """Model, optimiser, loss objects and (optionally) the per-epoch cosine schedule of one published run."""

    model: PublishedModel
    optimizer: torch.optim.Optimizer
    losses: PublishedLosses
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    @classmethod
    def build(
        cls,
        model: PublishedModel,
        n_old: int,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        smoothing: float = 1.0,
        epochs: int | None = None,
    ) -> PublishedLoop:
        """Build right after the model is on its device and before any `set_epoch`, as published (`CT.py:217-234`).
        With `epochs`, `CosineAnnealingLR(T_max=epochs, eta_min=lr*1e-3)` is stepped at the end of each epoch."""
        optimizer = published_optimizer(model, lr, momentum, weight_decay)
        scheduler = None
        if epochs is not None:
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs, eta_min=lr * 1e-3)
        return cls(model, optimizer, PublishedLosses.build(model, n_old, smoothing), scheduler)


@torch.no_grad()
def published_features(
    model: PublishedModel,
    images_uint8: Tensor,
    batch_size: int,
    augment: Augment,
    generator: torch.Generator | None = None,
) -> Tensor:
    """L2-normalised backbone CLS features [N, D] of augmented view 0 of every image, in order, under `model.eval()`
    and `no_grad` (`test_sskmeans`, `CT.py:615-650`); the model is put back in train mode."""
    model.eval()
    dev = model.param_device()
    feats = []
    for lo in range(0, images_uint8.shape[0], batch_size):
        batch = images_uint8[lo : lo + batch_size].to(dev, non_blocking=True)
        x = _views(augment(batch, 1, generator))
        feats.append(F.normalize(model.backbone(x), dim=-1))
    model.train()
    return torch.cat(feats)


def published_pseudo_labels(
    feats: Tensor,
    labelled_mask: Tensor,
    targets: Tensor,
    n_classes: int,
    n_init: int = 10,
    max_iter: int = 10,
    tol: float = 1e-4,
    balanced: bool = True,
    random_state=None,
    sqdist_mode: str = "gemm",
) -> Tensor:
    """Per-sample cluster ids [N] (on `feats`' device) from the published balanced SS-k-means (REFERENCE §4, §5.2).

    K = n_classes, tolerance 1e-4, 10 iterations (+10 in Phase B), 10 inits, k-means++ with the published row
    deletion, `cluster_size = ceil(N / K)` (None with `balanced=False`, i.e. `--unbalanced`). `random_state=None` is
    numpy's global RandomState, as published. The clustering runs where the features are, as published: on a GPU the
    distance chunks are computed there and copied into the published CPU distance matrix. Labelled samples keep their
    class's cluster: `searchsorted(sorted unique labelled targets, target)`, i.e. their class id when every known
    class has a labelled sample.
    """
    lab = labelled_mask.bool().to(feats.device)
    feats = feats.detach()
    km = ReferenceSSKMeans(
        n_classes, n_init=n_init, max_iter=max_iter, tol=tol, random_state=random_state,
        cluster_size=math.ceil(feats.shape[0] / n_classes) if balanced else None, variant="infosieve",
        kpp_deletion="bug", empty="nan", sqdist_mode=sqdist_mode,
    )  # fmt: skip
    # l_targets arrive as float64 in the published code (np.append); the cluster ids are the same.
    km.fit_mix(feats[~lab], feats[lab], targets.detach().to(feats.device)[lab].double())
    labels = km.labels_.long().to(feats.device)
    n_lab = int(lab.sum())
    out = torch.empty(feats.shape[0], dtype=torch.long, device=feats.device)
    out[lab] = labels[:n_lab]
    out[~lab] = labels[n_lab:]
    return out


def published_sampler_weights(labelled_mask: Tensor) -> Tensor:
    """Labelled weight 1, unlabelled L/(U+L) (`CT.py:926-930`): an expected labelled share of (U+L)/(2U+L)."""
    lab = labelled_mask.bool().cpu()
    n_lab = int(lab.sum())
    n_unl = lab.numel() - n_lab
    return torch.where(lab, 1.0, n_lab / (n_unl + n_lab)).double()


@dataclass
class EpochResult:
    losses: list[Tensor]  # one detached loss tensor per step (unsynced)
    pseudo_labels: Tensor  # [N] cluster ids of every train sample, the table the steps read
    batches: list[Tensor]  # [batch_size] sample indices of each step (CPU)
    features: Tensor  # [N, D] the features the pseudo-labels came from
    seconds: dict[str, float]  # wall time of each phase (features, kmeans, steps), the device synchronised between


def published_epoch(
    loop: PublishedLoop,
    images_uint8: Tensor,
    targets: Tensor,
    labelled_mask: Tensor,
    n_classes: int,
    batch_size: int = 128,
    epoch: int = 0,
    epochs: int = 200,
    augment: Augment | None = None,
    generator: torch.Generator | None = None,
    sampler_generator: torch.Generator | None = None,
    feature_batch_size: int | None = None,
    kmeans_kwargs: dict | None = None,
) -> EpochResult:
    """One published epoch on images already on the device (REFERENCE §4): pseudo-labels, schedule, steps.

    `images_uint8` [N, C, H, W], `targets` [N] (ground truth, read only where labelled), `labelled_mask` [N].
    `augment(uint8 batch, n_views, generator)` makes float views (view-major tensor or a list of views; the benchmark
    passes `DeviceAugment.train_views`, see the module docstring); `generator` is its generator (on the device).
    The sampler is the published `WeightedRandomSampler(weights, N)` + `drop_last` batches, so N // batch_size steps;
    `sampler_generator` (CPU) seeds it (None: torch's global RNG, as published). The scheduler, if the loop has one, is
    stepped at the end. `kmeans_kwargs` go to `published_pseudo_labels` (e.g. a `random_state`).
    """
    if augment is None:
        raise ValueError("published_epoch needs an `augment(uint8 batch, n_views, generator)` callable")
    model = loop.model
    dev = model.param_device()
    n = images_uint8.shape[0]
    targets = targets.to(dev)
    labelled = labelled_mask.bool().to(dev)

    # 1. pseudo-labels from the backbone features (CT.py:287-295), then 2. the epoch schedule (CT.py:308-309)
    clock = _PhaseClock(dev)
    feats = published_features(model, images_uint8, feature_batch_size or batch_size, augment, generator)
    clock.lap("features")
    pseudo = published_pseudo_labels(feats, labelled, targets, n_classes, **(kmeans_kwargs or {}))
    clock.lap("kmeans")
    set_epoch(model, epoch, epochs)
    model.train()

    # 3. the steps (CT.py:315-418)
    sampler = WeightedRandomSampler(published_sampler_weights(labelled), num_samples=n, generator=sampler_generator)
    losses, batches = [], []
    for idx in BatchSampler(sampler, batch_size, drop_last=True):
        idx = torch.as_tensor(idx, dtype=torch.long)
        idx_dev = idx.to(dev, non_blocking=True)
        batch = images_uint8[idx.to(images_uint8.device, non_blocking=True)].to(dev, non_blocking=True)
        images = _views(augment(batch, 2, generator))
        loss = published_step(
            model, loop.optimizer, loop.losses, images, targets[idx_dev], labelled[idx_dev], pseudo[idx_dev]
        )
        losses.append(loss)
        batches.append(idx)
    if loop.scheduler is not None:
        loop.scheduler.step()
    clock.lap("steps")
    return EpochResult(losses, pseudo, batches, feats, clock.seconds)


class _PhaseClock:
    """Wall time per phase; synchronises the device at each boundary (the published loop's per-step `.item()`
    synchronises far more often)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self._t = device, {}, time.perf_counter()

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[name], self._t = now - self._t, now


def _views(views: Tensor | list[Tensor] | tuple[Tensor, ...]) -> Tensor:
    """The published `torch.cat(images, dim=0)`: view-major rows [view 0 of the batch; view 1; ...]."""
    if isinstance(views, (list, tuple)):
        return torch.cat(list(views), dim=0)
    return views


# ------------------------------------------------------------------------------------------------- weights from fast
def fast_to_published_name(name: str) -> str | None:
    """The published model's name of an infosieve-fast `InfoSieve` parameter or buffer (None: no counterpart)."""
    if name.startswith("backbone.net."):
        return "backbone." + name.removeprefix("backbone.net.")
    if name.startswith("projection."):
        return "projection_head." + name.removeprefix("projection.")
    if name.startswith("labeller.") and name.split(".")[1] in ("coder", "masker", "categorizer"):
        return name
    return None  # the labeller's age / code_weight / length_weight buffers: plain attributes in the published model


def copy_weights_from_fast(published_model: PublishedModel, fast_model: nn.Module) -> None:
    """Load an infosieve-fast `InfoSieve`'s weights into the published model (backbone.net.* -> backbone.*,
    projection.* -> projection_head.*, labeller.{coder,masker,categorizer}.*; weight_g / weight_v keep their names).
    Every published tensor must be covered, with equal shapes."""
    target = published_model.state_dict()
    state = {}
    for name, value in fast_model.state_dict().items():
        mapped = fast_to_published_name(name)
        if mapped is None:
            continue
        if mapped not in target:
            raise KeyError(f"{name} -> {mapped}: no such tensor in the published model")
        if target[mapped].shape != value.shape:
            raise ValueError(f"{name} -> {mapped}: shape {tuple(value.shape)} vs {tuple(target[mapped].shape)}")
        state[mapped] = value
    missing = sorted(set(target) - set(state))
    if missing:
        raise KeyError(f"the fast model has no weights for {missing[:8]}")
    published_model.load_state_dict(state)
