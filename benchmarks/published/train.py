"""The published InfoSieve training step and epoch, composed as the published loop does (docs/reference.md §2-§4).

Written from docs/reference.md's description of `CT.py` (not copied from the public code; the per-step records of the
loop's logging were read there for facts). It is the timing baseline of the training benchmark and the oracle the
tests compare one infosieve-fast step against. It keeps the published structure on purpose:

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

`published_epoch` runs that minimal composition, or, with `released=ReleasedWork(...)`, the epoch as the published
loop really runs it (§4, `CT.py:217-537`), adding:

* in the pseudo-label pass (`test_sskmeans`), the projection head and the labeller on the UNnormalised backbone
  features (code_raw, §9.15), every batch's features, codes and their normalised concatenation copied to host
  arrays, and a per-sample `.item()` over the batch's targets (on the device) for the known-class mask; the SS-k-means
  is then scored (v1 and v2, §6);
* a second SS-k-means on the codes (code_raw, 1 init, unbalanced, §4 step 1), scored;
* per step, the loop's records (`StepLog`): ten `.item()` reads inside the step (the InfoNCE accuracy, eight loss
  terms and the total; two of the terms, Norm0Loss of the code and of the mask, are computed for the log only);
* the evaluation on the disjoint test split (`test_kmeans`, §4 step 4): a test-transform pass with the heads, host
  copies and a per-sample `.item()`, then `kmeans_pytorch` (§5.3: random init, no iteration cap) three times on the
  backbone features (the bug of §4 step 4), each scored;
* the three unconditional `torch.save`s of the backbone, projection-head and labeller `state_dict`s (§4 step 6). The
  `*_best.pt` saves (only on epochs whose test Old accuracy improves) and the TensorBoard scalars are left out.

Augmentation: `published_epoch` takes the views from an `augment(uint8 batch, n_views, generator)` callable. The
benchmark passes infosieve-fast's `DeviceAugment.train_views`, so both systems get identical augmentation on the device
and the comparison is about the training step; the published CPU loader (PIL transforms in DataLoader workers) is
compared separately in `benchmarks/bench_loader.py`.

Nothing here calls `.item()` or synchronises explicitly inside a step unless a `StepLog` is passed. The published
code's own boolean-mask indexing (`features[mask_lab]`, the positive/negative selection in `info_nce_logits`) does
synchronise on CUDA; that is part of what it costs.

Benchmark hooks (off by default): `StandIns` hands the k-means runs features with class structure in place of a
random network's (the passes still run and are timed); `max_images` cuts the per-image loops (the passes and the
steps) short, and `EpochResult.scale` says by how much, so a benchmark can project them.

Everything runs on the CPU or CUDA: tensors go where the model's parameters are.
"""

from __future__ import annotations

import itertools
import math
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import timm
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
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


class StepLog:
    """The published loop's per-step records (its `AverageMeter`s, `CT.py:315-418`). Each value is read with `.item()`
    where the loop reads it: the InfoNCE accuracy and L_C_in before the labeller runs, the labeller terms after
    L_C_code, the total before `backward`, so a logged step synchronises the device three times over."""

    TERMS = ("train_acc", "in", "code", "code_on", "mask_on", "length", "category", "code_cond", "mask_cond", "total")

    def __init__(self):
        self._sums = dict.fromkeys(self.TERMS, 0.0)
        self._counts = dict.fromkeys(self.TERMS, 0)

    def update(self, name: str, value: Tensor, n: int) -> None:
        """`meter.update(value.item(), n)`."""
        self._sums[name] += value.item() * n
        self._counts[name] += n

    def averages(self) -> dict[str, float]:
        """Each record's average over the epoch (the values the loop prints at its end)."""
        return {k: self._sums[k] / self._counts[k] for k in self.TERMS if self._counts[k]}


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
    log: StepLog | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The published loss of one batch (`CT.py:321-411`, docs/reference.md §3.10): (total, detached parts).

    `images`: the [2B, ...] view-major concatenation (`torch.cat(views)`); `class_labels` [B] ground truth (read where
    `mask_lab`), `mask_lab` [B] bool, `pseudo_labels` [B] this epoch's cluster ids (overwritten by the ground truth on
    labelled samples). `losses` is the loop's `PublishedLosses`; `smoothing` and `n_old` are read only when it is None,
    to build one here (the same stale weights: it takes the model's `initial_code_weight`). With `log`, the loop's
    records are read inside the loss as the loop reads them (see `StepLog`).
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
    if log is not None:  # the train accuracy of the input InfoNCE logits (column 0 is the positive) and L_C_in
        log.update("train_acc", (logits.max(1).indices == targets).float().mean(), logits.shape[0])
        log.update("in", loss_in, mask_lab.shape[0])

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
    if log is not None:  # code_on / mask_on: Norm0Loss of the code and the mask, logged only (§3.7)
        logged = {
            "code": loss_code, "code_on": pm.Norm0Loss()(bin_raw), "mask_on": pm.Norm0Loss()(mask), "length": length,
            "category": category, "code_cond": code_cond, "mask_cond": mask_cond,
        }  # fmt: skip
        for name, value in logged.items():
            log.update(name, value, mask_lab.shape[0])

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
    log: StepLog | None = None,
) -> Tensor:
    """One published step: forward + loss, the loop's records (with `log`), zero_grad, backward, SGD step; returns
    the detached loss tensor (unsynced without `log`)."""
    loss, _ = published_loss(model, images, class_labels, mask_lab, pseudo_labels, losses=losses, log=log)
    if log is not None:
        log.update("total", loss, mask_lab.shape[0])
    optimizer.zero_grad()
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
    """Per-sample cluster ids [N] (on `feats`' device) from the published balanced SS-k-means
    (docs/reference.md §4, §5.2).

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


# --------------------------------------------------------------------------------------------- the as-released extras
@dataclass
class ReleasedWork:
    """What the published loop does each epoch beyond the minimal composition (see the module docstring)."""

    test_images: Tensor  # uint8 [M, C, H, W]: the disjoint test split, the test transform's input
    test_targets: Tensor  # [M], on the CPU, as the test loader delivers them (the mask loop reads them there)
    test_view: Callable[[Tensor], Tensor]  # the test transform: uint8 batch -> float [B, C, crop, crop]
    save_dir: str | Path  # the folder of the published `args.model_path`: the per-epoch saves go there


@dataclass
class StandIns:
    """Features the k-means runs cluster in place of those the passes computed (a benchmark's features with class
    structure, of the same size: a random network's have none); the passes still run."""

    train: Tensor  # [N, D]: the pseudo-label SS-k-means
    codes: Tensor | None = None  # [N, L]: the code SS-k-means (as-released epoch)
    test: Tensor | None = None  # [M, D]: the test-split kmeans_pytorch runs (as-released epoch)


@dataclass
class TrainPass:
    """The host arrays the as-released pseudo-label pass (`test_sskmeans`) collects, in the loader's order."""

    feats: np.ndarray  # [n, D] L2-normalised backbone CLS
    codes: np.ndarray  # [n, L] code_raw of the unnormalised projection
    comb: np.ndarray  # [n, D + L] normalised concatenation of the two (collected, never clustered: §9.8)
    targets: np.ndarray  # [n] float64, as `np.append` makes them
    labelled: np.ndarray  # [n] bool
    known_class: np.ndarray  # [n] bool: the target is a known class


def _known(label: Tensor, n_old: int) -> np.ndarray:
    """The published known-class mask: one `.item()` per sample (a device read each where `label` is on the GPU)."""
    return np.array([x.item() in range(n_old) for x in label])


def _heads_on(model: PublishedModel, feats: Tensor) -> tuple[Tensor, Tensor]:
    """(code_raw, normalised cat(backbone, code_raw)) of unnormalised backbone features, as both published passes
    compute them."""
    code_raw = model.labeller(model.projection_head(feats))[2]
    return code_raw, F.normalize(torch.cat([feats, code_raw], dim=1), dim=-1)


@torch.no_grad()
def released_train_pass(
    model: PublishedModel,
    images_uint8: Tensor,
    targets: Tensor,
    labelled: Tensor,
    batch_size: int,
    augment: Augment,
    generator: torch.Generator | None,
    n_old: int,
) -> TrainPass:
    """The published pseudo-label pass (`test_sskmeans`, `CT.py:615-650`) over augmented view 0 of every image,
    under `model.eval()` (left so: the loop's `model.train()` follows)."""
    model.eval()
    dev = model.param_device()
    feats, codes, comb = [], [], []
    t_all, lab_all, known_all = np.array([]), np.array([]), np.array([])
    for lo in range(0, images_uint8.shape[0], batch_size):
        x = _views(augment(images_uint8[lo : lo + batch_size].to(dev, non_blocking=True), 1, generator))
        label, mask_lab = targets[lo : lo + batch_size].to(dev), labelled[lo : lo + batch_size].to(dev).bool()
        f = model.backbone(x)
        feats.append(F.normalize(f, dim=-1).cpu().numpy())
        code_raw, f_comb = _heads_on(model, f)
        comb.append(f_comb.cpu().numpy())
        codes.append(code_raw.cpu().numpy())
        t_all = np.append(t_all, label.cpu().numpy())
        lab_all = np.append(lab_all, mask_lab.cpu().bool().numpy())
        known_all = np.append(known_all, _known(label, n_old))
    return TrainPass(
        np.concatenate(feats), np.concatenate(codes), np.concatenate(comb), t_all, lab_all.astype(bool),
        known_all.astype(bool),
    )  # fmt: skip


@torch.no_grad()
def released_test_pass(
    model: PublishedModel, images_uint8: Tensor, targets: Tensor, batch_size: int, test_view, n_old: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The feature loop of the published test evaluation (`test_kmeans` with both heads, `CT.py:699-735`) over the
    test-transform view of every image: (L2-normalised backbone features, float64 targets, known-class mask) as host
    arrays. The codes and their concatenation are computed and copied as published, then left unused (§4 step 4)."""
    model.eval()
    dev = model.param_device()
    feats, codes, comb = [], [], []
    t_all, known_all = np.array([]), np.array([])
    for lo in range(0, images_uint8.shape[0], batch_size):
        label = targets[lo : lo + batch_size]
        f = model.backbone(test_view(images_uint8[lo : lo + batch_size].to(dev, non_blocking=True)))
        feats.append(F.normalize(f, dim=-1).cpu().numpy())
        code_raw, f_comb = _heads_on(model, f)
        comb.append(f_comb.cpu().numpy())
        codes.append(code_raw.cpu().numpy())
        t_all = np.append(t_all, label.cpu().numpy())
        known_all = np.append(known_all, _known(label, n_old))
    return np.concatenate(feats), t_all, known_all.astype(bool)


def _random_state(random_state) -> np.random.RandomState:
    """None: numpy's global RandomState (as published); an int seeds a new one; a RandomState is used as is."""
    if random_state is None:
        return np.random.mtrand._rand
    return random_state if isinstance(random_state, np.random.RandomState) else np.random.RandomState(random_state)


def kmeans_pytorch(X: Tensor, num_clusters: int, tol: float = 1e-4, random_state=None) -> tuple[Tensor, Tensor]:
    """`kmeans_pytorch.kmeans(X, num_clusters, distance='euclidean', device=X.device)` (docs/reference.md §5.3):
    initial centres `choice(N, K, replace=False)` (numpy's global RandomState unless `random_state`), Lloyd steps on
    the full [N, K, D] broadcast of squared differences, the means in a Python loop over the clusters (an empty one
    takes a random point, torch's global generator), until (sum of the centre shifts)^2 < tol, with no iteration cap.
    Returns the last assignment and the centres, on the CPU."""
    X = X.float()
    state = X[_random_state(random_state).choice(len(X), num_clusters, replace=False)]
    while True:
        dis = ((X.unsqueeze(dim=1) - state.unsqueeze(dim=0)) ** 2.0).sum(dim=-1).squeeze()
        choice = torch.argmin(dis, dim=1)
        before = state.clone()
        for index in range(num_clusters):
            selected = torch.index_select(X, 0, torch.nonzero(choice == index).squeeze().to(X.device))
            if selected.shape[0] == 0:
                selected = X[torch.randint(len(X), (1,))]
            state[index] = selected.mean(dim=0)
        shift = torch.sum(torch.sqrt(torch.sum((state - before) ** 2, dim=1)))
        if shift**2 < tol:
            return choice.cpu(), state.cpu()


def _cluster_acc_parts(y_true: np.ndarray, y_pred: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GCD's confusion w[pred, true] (a Python loop over the samples) and its Hungarian matching [(pred, true)]."""
    d = max(y_pred.max(), y_true.max()) + 1
    w = np.zeros((d, d), dtype=int)
    for i in range(y_pred.size):
        w[y_pred[i], y_true[i]] += 1
    return w, np.vstack(linear_sum_assignment(w.max() - w)).T


def _cluster_acc(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    w, ind = _cluster_acc_parts(y_true, y_pred)
    return sum(w[i, j] for i, j in ind) / y_pred.size


def split_acc_v1(y_true: np.ndarray, y_pred: np.ndarray, mask: np.ndarray) -> tuple[float, float, float]:
    """One Hungarian per subset (docs/reference.md §6)."""
    old, new = _cluster_acc(y_true[mask], y_pred[mask]), _cluster_acc(y_true[~mask], y_pred[~mask])
    share = mask.mean()
    return share * old + (1 - share) * new, old, new


def split_acc_v2(y_true: np.ndarray, y_pred: np.ndarray, mask: np.ndarray) -> tuple[float, float, float]:
    """One Hungarian over all samples, then Old / New over the true classes of each subset (docs/reference.md §6)."""
    w, ind = _cluster_acc_parts(y_true, y_pred)
    pred_of = {j: i for i, j in ind}
    total = sum(w[i, j] for i, j in ind) / y_pred.size

    def subset(classes: set) -> float:
        return sum(w[pred_of[c], c] for c in classes) / sum(w[:, c].sum() for c in classes)

    return total, subset(set(y_true[mask])), subset(set(y_true[~mask]))


def published_log_accs(y_true, y_pred, mask) -> tuple[float, float, float]:
    """`log_accs_from_preds` with the default `eval_funcs=['v1', 'v2']`: both are computed (the loop prints them),
    the v1 (All, Old, New) is returned (§6)."""
    y_true, y_pred, mask = np.asarray(y_true).astype(int), np.asarray(y_pred).astype(int), np.asarray(mask, bool)
    v1 = split_acc_v1(y_true, y_pred, mask)
    split_acc_v2(y_true, y_pred, mask)
    return tuple(float(v) for v in v1)


def released_test_kmeans(feats: np.ndarray, n_classes: int, device, random_state=None) -> list[np.ndarray]:
    """The published test evaluation's clusterings: `kmeans_pytorch` three times, every run on the backbone features
    (the bug of §4 step 4: the combined and the code runs get `all_feats` too), each from a fresh host-to-device copy;
    one RandomState serves the three inits in turn, as numpy's global one does. Each run's cluster ids."""
    rs = _random_state(random_state)
    return [kmeans_pytorch(torch.from_numpy(feats).to(device), n_classes, random_state=rs)[0].numpy() for _ in range(3)]


def save_epoch_state(model: PublishedModel, folder: str | Path) -> None:
    """The unconditional saves at the end of every published epoch: the backbone, projection-head and labeller
    `state_dict`s, one file each (`model.pt`, `model_proj_head.pt`, `model_label_head.pt`)."""
    folder = Path(folder)
    torch.save(model.backbone.state_dict(), folder / "model.pt")
    torch.save(model.projection_head.state_dict(), folder / "model_proj_head.pt")
    torch.save(model.labeller.state_dict(), folder / "model_label_head.pt")


# ------------------------------------------------------------------------------------------------------ one epoch
@dataclass
class EpochResult:
    losses: list[Tensor]  # one detached loss tensor per step (unsynced)
    pseudo_labels: Tensor  # [N] cluster ids of every train sample, the table the steps read
    batches: list[Tensor]  # [batch_size] sample indices of each step (CPU)
    features: Tensor  # [N, D] the features the pseudo-labels came from (the stand-ins where given)
    seconds: dict[str, float]  # wall time of each phase, the device synchronised between (see `published_epoch`)
    scale: dict[str, float] = field(default_factory=dict)  # full size / size run, for each phase cut short
    step_log: dict[str, float] | None = None  # the as-released epoch's `StepLog.averages()`
    accuracies: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # as-released: scored clusterings


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
    released: ReleasedWork | None = None,
    stand_ins: StandIns | None = None,
    max_images: int | None = None,
) -> EpochResult:
    """One published epoch on images already on the device (docs/reference.md §4): pseudo-labels, schedule, steps; with
    `released`, as the published loop runs it (the module docstring lists what that adds).

    `images_uint8` [N, C, H, W], `targets` [N] (ground truth, read only where labelled), `labelled_mask` [N].
    `augment(uint8 batch, n_views, generator)` makes float views (view-major tensor or a list of views; the benchmark
    passes `DeviceAugment.train_views`, see the module docstring); `generator` is its generator (on the device).
    The sampler is the published `WeightedRandomSampler(weights, N)` + `drop_last` batches, so N // batch_size steps;
    `sampler_generator` (CPU) seeds it (None: torch's global RNG, as published). The scheduler, if the loop has one, is
    stepped at the end. `kmeans_kwargs` go to `published_pseudo_labels` (e.g. a `random_state`; the code k-means of
    the as-released epoch takes them too, with 1 init, unbalanced, and its test k-means their `random_state`).
    `stand_ins`: see `StandIns`. `max_images`: the feature passes run over the first `max_images` images and the steps
    stop after max(1, max_images // batch_size) batches (needs `stand_ins` for every k-means that follows).

    Phases of `EpochResult.seconds`: features, kmeans, steps; as released also code_kmeans (after kmeans),
    test_features, test_kmeans and saves (after steps), and scoring: the five clusterings' `published_log_accs`.
    """
    if augment is None:
        raise ValueError("published_epoch needs an `augment(uint8 batch, n_views, generator)` callable")
    model = loop.model
    dev = model.param_device()
    n = images_uint8.shape[0]
    targets = targets.to(dev)
    labelled = labelled_mask.bool().to(dev)
    n_feat = n if max_images is None else min(n, max_images)
    _check_stand_ins(stand_ins, released, n, max_images)
    kmeans_kwargs = kmeans_kwargs or {}
    n_old = loop.losses.args.n_old
    scale, accuracies = {"features": n / n_feat}, {}

    # 1. pseudo-labels from the backbone features (CT.py:287-295), then 2. the epoch schedule (CT.py:308-309)
    clock = _PhaseClock(dev)
    fb = feature_batch_size or batch_size
    if released is None:
        feats = published_features(model, images_uint8[:n_feat], fb, augment, generator)
    else:
        train_pass = released_train_pass(
            model, images_uint8[:n_feat], targets[:n_feat], labelled[:n_feat], fb, augment, generator, n_old
        )
        feats = torch.from_numpy(train_pass.feats).to(dev)
    clock.lap("features")
    if stand_ins is not None:
        feats = stand_ins.train
    pseudo = published_pseudo_labels(feats, labelled, targets, n_classes, **kmeans_kwargs)
    clock.lap("kmeans")
    if released is not None:
        accuracies["train"] = _score_unlabelled(pseudo, targets, labelled, n_old)
        clock.lap("scoring")
        codes = torch.from_numpy(train_pass.codes).to(dev) if stand_ins is None else stand_ins.codes
        code_kwargs = {**kmeans_kwargs, "n_init": 1, "balanced": False}
        code_labels = published_pseudo_labels(codes, labelled, targets, n_classes, **code_kwargs)
        clock.lap("code_kmeans")
        accuracies["codes"] = _score_unlabelled(code_labels, targets, labelled, n_old)
        clock.lap("scoring")
    set_epoch(model, epoch, epochs)
    model.train()

    # 3. the steps (CT.py:315-418)
    log = StepLog() if released is not None else None
    n_steps = n // batch_size if max_images is None else min(n // batch_size, max(1, max_images // batch_size))
    scale["steps"] = (n // batch_size) / n_steps
    sampler = WeightedRandomSampler(published_sampler_weights(labelled), num_samples=n, generator=sampler_generator)
    losses, batches = [], []
    for idx in itertools.islice(BatchSampler(sampler, batch_size, drop_last=True), n_steps):
        idx = torch.as_tensor(idx, dtype=torch.long)
        idx_dev = idx.to(dev, non_blocking=True)
        batch = images_uint8[idx.to(images_uint8.device, non_blocking=True)].to(dev, non_blocking=True)
        images = _views(augment(batch, 2, generator))
        loss = published_step(
            model, loop.optimizer, loop.losses, images, targets[idx_dev], labelled[idx_dev], pseudo[idx_dev], log
        )
        losses.append(loss)
        batches.append(idx)
    clock.lap("steps")

    # 4. the test-split evaluation (CT.py:435-469), 5. the schedule, 6. the saves (CT.py:495-537)
    if released is not None:
        test_stand_in = stand_ins.test if stand_ins is not None else None
        m = released.test_images.shape[0]
        m_feat = m if max_images is None else min(m, max_images)
        scale["test_features"] = m / m_feat
        accuracies.update(_released_evaluation(
            model, released, m_feat, test_stand_in, n_classes, n_old, batch_size, kmeans_kwargs.get("random_state"),
            clock,
        ))  # fmt: skip
    if loop.scheduler is not None:
        loop.scheduler.step()
    if released is not None:
        save_epoch_state(model, released.save_dir)
        clock.lap("saves")
    step_log = log.averages() if log is not None else None
    return EpochResult(losses, pseudo, batches, feats, clock.seconds, scale, step_log, accuracies)


def _check_stand_ins(stand_ins: StandIns | None, released: ReleasedWork | None, n: int, max_images: int | None):
    """Stand-ins have their pass's row count; a pass that `max_images` cuts short has a stand-in for its k-means."""
    rows = {"train": n}
    if released is not None:
        rows.update(codes=n, test=released.test_images.shape[0])
    for name, count in rows.items():
        value = getattr(stand_ins, name, None)
        if value is None and max_images is not None and max_images < count:
            raise ValueError(
                f"max_images={max_images} cuts a feature pass of {count} images short: pass StandIns({name}=...) with "
                f"{count} rows for the k-means that follows, or max_images=None"
            )
        if value is not None and value.shape[0] != rows[name]:
            raise ValueError(f"stand_ins.{name} has {value.shape[0]} rows; its pass has {count}")


def _score_unlabelled(preds: Tensor, targets: Tensor, labelled: Tensor, n_old: int) -> tuple[float, float, float]:
    """`log_accs_from_preds` on the unlabelled samples, Old = a known-class target (as `test_sskmeans` scores)."""
    y = targets[~labelled].cpu().numpy()
    return published_log_accs(y, preds[~labelled].cpu().numpy(), y < n_old)


def _released_evaluation(
    model: PublishedModel,
    released: ReleasedWork,
    m_feat: int,
    stand_in: Tensor | None,
    n_classes: int,
    n_old: int,
    batch_size: int,
    random_state,
    clock: _PhaseClock,
) -> dict[str, tuple[float, float, float]]:
    """The test pass over the first `m_feat` test images (phase test_features), then the three clusterings (phase
    test_kmeans), of `stand_in` where given, and their scores (phase scoring)."""
    feats, y, known = released_test_pass(
        model, released.test_images[:m_feat], released.test_targets[:m_feat], batch_size, released.test_view, n_old
    )
    clock.lap("test_features")
    if stand_in is not None:
        feats, y = stand_in.cpu().numpy(), released.test_targets.cpu().numpy()
        known = y < n_old
    runs = released_test_kmeans(feats, n_classes, model.param_device(), random_state)
    clock.lap("test_kmeans")
    accs = {f"test_{i}": published_log_accs(y, preds, known) for i, preds in enumerate(runs)}
    clock.lap("scoring")
    return accs


class _PhaseClock:
    """Wall time per phase; synchronises the device at each boundary (the published loop's per-step `.item()`
    synchronises far more often)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self._t = device, {}, time.perf_counter()

    def lap(self, name: str) -> None:
        """The time since the last lap, added to phase `name`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[name], self._t = self.seconds.get(name, 0.0) + now - self._t, now


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
