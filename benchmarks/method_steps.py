"""bench_train's method rows (`--methods`): the training step of GCD, SimGCD and SelEx in infosieve-fast against that
method's published step transcribed in `benchmarks/published/` (`gcd.py`, `simgcd.py`, `selex.py`), on bench_train's
shared batch and device augmentation.

The fast side is `Trainer.train_step` with `method=<name>` and the rest of `fast_default`'s config (SimGCD's
prototypes: one per `--n-classes`). The published side is that method's published model: the timm backbone with the
published freezing (`--grad-from-block`), the method's head (GCD and SelEx: DINOHead to `--proj-out-dim`; SimGCD: its
DINOHead, the 256-d projection beside the prototypes), the transcribed loss, SGD over every parameter, fp32 or bf16
autocast, and `loss.item()` after every step, as the published loops log it. Both sides start from the same weights
(the published model's copied from the fast one), make the same views, and (SelEx) read the same hierarchy: per level
of `selex_hierarchy.level_sizes`, random unit centres and random batch labels (the per-epoch clustering that builds
them is not part of a step). Their optimisers differ (the fast side's is its config's), so only their first steps
compute the same loss.
"""

from __future__ import annotations

import timm
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.harness import ItemLog
from benchmarks.published import gcd as published_gcd
from benchmarks.published import model as pm
from benchmarks.published import selex as published_selex
from benchmarks.published import simgcd as published_simgcd
from benchmarks.published.train import freeze_published
from infosieve_fast.data.reading.augment import AugmentConfig, DeviceAugment
from infosieve_fast.data.reading.base import Batch
from infosieve_fast.data.reading.memory import InMemoryGCD
from infosieve_fast.methods.selex_hierarchy import level_sizes
from infosieve_fast.methods.simgcd import HEAD
from infosieve_fast.training.engine import Trainer
from infosieve_fast.training.loss_monitor import LossMonitor

METHODS = ("gcd", "simgcd", "selex")
VARIANTS = ("fast_default", "published_fp32", "published_bf16")  # the value of published_*: bf16 autocast
PUBLISHED_AMP = {"published_fp32": False, "published_bf16": True}
# the published loops' SGD (GCD's contrastive_training.py; SimGCD's train.py and SelEx's copy of GCD's loop)
PUBLISHED_SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-5}
SIMGCD_WARMUP_EPOCHS, SIMGCD_EPOCHS = 30, 200  # SimGCD's scripts: the teacher temperature's warm-up, the schedule


class Hierarchy:
    """SelEx's levels for one batch of B samples: `centres[i]` [K_i, F] unit rows, `labels[i]` [B] in 0..K_i-1, and
    the published per-epoch radii of the centres."""

    def __init__(self, n_old: int, n_classes: int, feat_dim: int, batch: int, device: torch.device, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.n_old, self.n_new = n_old, n_classes - n_old
        sizes = [old + new for old, new in level_sizes(self.n_old, self.n_new)]
        self.centres = [F.normalize(torch.randn(k, feat_dim, generator=g), dim=1).to(device) for k in sizes]
        self.labels = [torch.randint(0, k, (batch,), generator=g).to(device) for k in sizes]
        self.radii = published_selex.initial_radii(self.centres)


class PublishedMethod(nn.Module):
    """A method's published model: `backbone` (timm, CLS after the final norm) and `head`."""

    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        self.backbone, self.head = backbone, head


def published_model(args, method: str) -> PublishedMethod:
    net = timm.create_model(args.backbone, pretrained=False, num_classes=0, **dict(args.backbone_kwargs))
    freeze_published(net, args.grad_from_block)
    if method == "simgcd":
        head = published_simgcd.SimGCDHead(net.num_features, args.n_classes)
    else:
        head = pm.DINOHead(net.num_features, args.proj_out_dim, nlayers=3)
    return PublishedMethod(net, head)


def published_loss(method: str, model: PublishedMethod, views: Tensor, batch: Batch, levels: Hierarchy) -> Tensor:
    """The published step's forward and loss of `method` on the two views (view-major rows)."""
    feats = model.backbone(views)
    if method == "gcd":
        return published_gcd.gcd_loss(model.head(feats), batch.targets, batch.labelled)[0]
    if method == "simgcd":
        proj, logits = model.head(feats)
        distill = published_simgcd.DistillLoss(SIMGCD_WARMUP_EPOCHS, SIMGCD_EPOCHS)
        return published_simgcd.simgcd_loss(proj, logits, batch.targets, batch.labelled, 0, distill)[0]
    return published_selex.selex_loss(
        feats, model.head(feats), batch.targets, batch.labelled, levels.labels, levels.centres, levels.radii,
        levels.n_old, levels.n_new,
    )[0]  # fmt: skip


def fast_head_state(fast_model: nn.Module, method: str) -> dict[str, Tensor]:
    """The published head's weights from the fast model: the projection head (GCD, SelEx: the whole DINOHead; SimGCD:
    its MLP) and SimGCD's prototypes, under the published names (the same `mlp.*` and `last_layer.*` keys)."""
    state = dict(fast_model.projection.state_dict())
    if method == "simgcd":
        state.update(fast_model.method_heads[HEAD].state_dict())
    return state


def fast_overrides(args, method: str) -> list[str]:
    """The fast side's config over `fast_default`'s: the method, and (SimGCD's prototypes) one class per
    `--n-classes`."""
    return [f"method={method}", f"kmeans.n_clusters={args.n_classes}"]


def step_functions(args, device: torch.device, method: str, variant: str, batch: Batch, n_old: int, config):
    """(step, finish, details) of `method`'s `variant`, as `bench_train.step_functions` gives them for InfoSieve's
    variants; `config`: the fast side's (`fast_overrides` on bench_train's config), also the donor of the published
    side's backbone weights."""
    torch.manual_seed(args.seed)
    trainer = Trainer(config, source=InMemoryGCD(batch.images, batch.targets, batch.labelled, n_old, None))
    levels = Hierarchy(n_old, args.n_classes, trainer.model.backbone.feat_dim, args.batch, device, args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    if variant == "fast_default":
        trainer.method.set_epoch(0)
        table = torch.zeros(args.batch, dtype=torch.long, device=device)
        if method == "selex":
            trainer.method.set_hierarchy(levels.centres)
            table = torch.stack(levels.labels)  # [levels, B] by uq: the batch's uq are 0..B-1
        monitor = LossMonitor(0)
        trainer.compile_once()
        details = lambda: {**trainer.compiled.fields(), **trainer.step_graph.fields()}  # noqa: E731
        return (lambda: trainer.train_step(batch, table, gen, monitor)), monitor.check, details
    model = published_model(args, method).to(device)
    model.backbone.load_state_dict(trainer.model.backbone.net.state_dict())  # the trainer is freed on return
    model.head.load_state_dict(fast_head_state(trainer.model, method))
    optimizer = torch.optim.SGD(model.parameters(), **PUBLISHED_SGD)
    augment = DeviceAugment(AugmentConfig(args.crop))
    amp = PUBLISHED_AMP[variant]
    losses = ItemLog(f"{method} {variant}")

    def step() -> None:
        views = augment.train_views(batch.images, 2, gen)  # view-major [2B, C, crop, crop]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = published_loss(method, model, views, batch, levels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.record(loss)  # the published loops log loss.item() after every step

    return step, losses.last, dict
