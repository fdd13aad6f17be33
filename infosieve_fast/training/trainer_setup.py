"""What a Trainer is built from: the device (resolved once where a run starts, `started_run`), the seeds of an
epoch's random streams, the optimizer and the model, and the checks that the data fits the settings."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..common import distributed as dist
from ..common.notices import notice
from ..config.checks import check_clusters_for_known
from ..config.settings import Config, ConfigError
from ..data.reading.base import GCDSource
from ..data.reading.stream import FOREIGN
from ..data.splits import EXPECTED_COUNTS
from ..methods import METHODS, Method
from ..network.model import Backbone, InfoSieve


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
    world = dist.get_world_size() if dist.is_distributed() else dist.env_world_size()  # before torchrun's group too
    if device.type == "cuda" and world > 1:
        if device.index is not None:
            raise ValueError(f"train.device={name!r}: under torchrun each rank uses cuda:LOCAL_RANK; set cuda or auto")
        device = torch.device("cuda", dist.local_rank())
    return device


@contextmanager
def started_run(device_name: str) -> Iterator[torch.device]:
    """Where a training run starts: `train.device` resolved (a device this machine lacks is refused before any work)
    and, launched by torchrun, the process group opened on it (ended on the way out if this block started it). The
    device is handed down from here; nothing below resolves it again."""
    device = resolve_device(device_name)
    with dist.process_group_from_env(device.type == "cuda"):
        yield device


def autocast_enabled(amp: str, device: torch.device) -> bool:
    return amp == "bf16" or (amp == "auto" and device.type == "cuda")


def epoch_seed(seed: int, epoch: int, stream: int) -> int:
    """Independent, reproducible seeds per (run seed, epoch, purpose)."""
    return (seed * 1_000_003 + epoch * 101 + stream) % (2**63)


def build_optimizer(model: torch.nn.Module, o, device: torch.device, decay_on_1d: bool = True) -> torch.optim.Optimizer:
    """SGD or AdamW over the trainable parameters; one fused kernel per step on CUDA (same update, fewer launches),
    the foreach implementation elsewhere. Each parameter group's `lr_scale` is its share of the scheduled lr.
    `decay_on_1d=False` (the method's `Method.decay_on_1d`): biases and 1-D parameters in groups of their own without
    weight decay."""
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    groups = parameter_groups(model, o.backbone_lr_scale)
    if not decay_on_1d:
        groups = [part for group in groups for part in without_decay_on_1d(model, group)]
    for group in groups:
        group["lr"] = o.lr * group["lr_scale"]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, **impl)
    return torch.optim.AdamW(groups, lr=o.lr, weight_decay=o.weight_decay, **impl)


def parameter_groups(model: torch.nn.Module, backbone_lr_scale: float) -> list[dict]:
    """One group of every trainable parameter at scale 1 (the reference, and the layout older checkpoints' optimizer
    states have); else the trained backbone blocks at `backbone_lr_scale` and the heads at 1."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if backbone_lr_scale == 1.0:
        return [{"params": trainable, "lr_scale": 1.0}]
    backbone = {id(p) for p in model.backbone.parameters()}
    groups = [
        {"params": [p for p in trainable if id(p) in backbone], "lr_scale": backbone_lr_scale},
        {"params": [p for p in trainable if id(p) not in backbone], "lr_scale": 1.0},
    ]
    return [g for g in groups if g["params"]]


def without_decay_on_1d(model: torch.nn.Module, group: dict) -> list[dict]:
    """`group` split as SimGCD's `get_params_groups`: the parameters named `*.bias` or of one dimension with
    weight_decay 0, the others as they were (an empty part dropped)."""
    exempt = {id(p) for name, p in model.named_parameters() if name.endswith(".bias") or p.dim() == 1}
    decayed = {**group, "params": [p for p in group["params"] if id(p) not in exempt]}
    free = {**group, "params": [p for p in group["params"] if id(p) in exempt], "weight_decay": 0.0}
    return [g for g in (decayed, free) if g["params"]]


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """A checkpoint's optimizer state into `optimizer`, whose groups' `lr_scale` (this config's) are kept: checkpoints
    written before `optim.backbone_lr_scale` existed have none."""
    scales = [group["lr_scale"] for group in optimizer.param_groups]
    if len(saved["param_groups"]) != len(scales):
        raise ConfigError(
            f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter group(s), this config "
            f"{len(scales)}: optim.backbone_lr_scale moved to or from 1.0 since the run started. Resume with the "
            "run's value, or start a new run"
        )
    optimizer.load_state_dict(saved)
    for group, scale in zip(optimizer.param_groups, scales, strict=True):
        group["lr_scale"] = scale


def build_method(cfg: Config, n_old: int) -> Method:
    """The loss of `cfg`'s `method:` (infosieve_fast/methods/)."""
    return METHODS[cfg.method].from_config(cfg, n_old)


def method_classes(cfg: Config, n_classes: int | None) -> int:
    """The number of classes a method's heads predict (SimGCD's prototypes): kmeans.n_clusters when a number, else
    the data's `n_classes`."""
    k = cfg.kmeans.n_clusters
    if isinstance(k, int):
        return k
    if n_classes is None or k == "auto":
        raise ConfigError(
            f"method={cfg.method} predicts with a head of one output per class, so it needs the number of classes "
            f"before training; kmeans.n_clusters={k} does not give it: set kmeans.n_clusters to a number"
        )
    return n_classes


def build_model(
    cfg: Config, n_old: int, backbone: Backbone | None, pretrained: bool, method: Method, n_classes: int | None
) -> InfoSieve:
    """The model of `cfg`: `model`, train.frozen_bf16 / checkpoint_blocks / kernels, loss.labeller_grad_stop, and
    what `method` adds to it (its heads, a predicting head of `method_classes` outputs; the labeller or not; the
    projection's last layer or not). `pretrained=False` builds the backbone without `model.pretrained`, for a model a
    checkpoint fills (it holds every weight, and the file may have moved since)."""
    t = cfg.train
    model_cfg = cfg.model if pretrained else dataclasses.replace(cfg.model, pretrained=None)
    grad_stop = cfg.loss.labeller_grad_stop
    model = InfoSieve(
        model_cfg,
        n_old,
        backbone,
        t.frozen_bf16,
        t.checkpoint_blocks,
        t.kernels,
        grad_stop,
        labeller=method.labeller,
        projection_last_layer=method.projection_last_layer,
    )
    classes = method_classes(cfg, n_classes) if method.predicts == "head" else n_classes
    model.method_heads = method.build_heads(model.backbone.feat_dim, classes)
    return model


def check_source_fits(cfg: Config, source: GCDSource) -> None:
    """An epoch needs one full global batch, balanced k-means needs clusters that hold every train sample, and the
    stored images must suit the crop (`check_stored_size`)."""
    per_step = cfg.data.batch_size * dist.get_world_size()
    if per_step > source.n_train:
        raise ValueError(
            f"data.batch_size={cfg.data.batch_size} (x {dist.get_world_size()} ranks) is more than the "
            f"{source.n_train} train samples, so an epoch has no full batch: lower data.batch_size"
        )
    km = cfg.kmeans
    if km.n_clusters is None and source.n_classes is None:
        raise ConfigError(
            "kmeans.n_clusters is null (K = the dataset's number of classes), but this data has an unlabelled pool, so "
            "nobody knows that number: set kmeans.n_clusters=auto to estimate K, or to the number you expect"
        )
    check_clusters_for_known(km.n_clusters, source.n_old)
    if km.cluster_size is not None and km.n_clusters != "auto":
        k = km.n_clusters or source.n_classes
        if km.cluster_size * k < source.n_train:
            raise ConfigError(
                f"kmeans.cluster_size={km.cluster_size} x {k} clusters holds fewer than the {source.n_train} "
                f"train samples: set it >= {-(-source.n_train // k)}, or null for ceil(N / K)"
            )
    check_config_fits_shards(cfg.name, getattr(source, "dataset", None), cfg.data.shards)
    foreign = getattr(source, "dataset", None) == FOREIGN
    served_by = "data.resize" if cfg.data.resize else "foreign" if foreign else "make-shards"
    check_stored_size(getattr(source, "size", None), cfg.data.crop_size, cfg.data.shards, served_by)


PAPER_DATASETS = (*EXPECTED_COUNTS, "imagenet1k")


def check_config_fits_shards(config_name: str, dataset: str | None, shards) -> None:
    """configs/<dataset>.yaml, dinov2-<dataset>.yaml and <dataset>-<method>.yaml hold that dataset's paper settings
    (its label smoothing, its trained blocks): on another paper dataset's shards such a config is most likely the wrong
    one, so a warning names both and the config to use."""
    meant = config_name.removeprefix("dinov2-")
    method = next((f"-{m}" for m in METHODS if meant.endswith(f"-{m}")), "")
    meant = meant.removesuffix(method)
    if meant in PAPER_DATASETS and dataset in PAPER_DATASETS and dataset != meant:
        notice(
            f"WARNING: the config {config_name!r} holds the paper's settings for {meant} (label smoothing, trained "
            f"blocks), but the shards {shards} hold {dataset}: train with configs/{dataset}{method}.yaml, or --set "
            f"name={dataset}{method} to keep these settings on purpose"
        )


STORED_SIZE_SLACK = 1.5  # stored shorter side / the test view's: more than this decodes over twice the pixels used


def check_stored_size(served: int | None, crop: int, shards, served_by: str = "make-shards") -> None:
    """Shards whose images are served (shorter side `served`) smaller than the crop are refused; much larger than the
    test view `int(crop / 0.875)` that the crop is made for, they are decoded at pixels nothing uses: a warning naming
    both sizes and the fix (configs/cub100-*.yaml crop 112 from shards made with --resize 128). `served_by` says what
    set the size, so the fix is one that changes it: "make-shards" (the size stored), "data.resize", or "foreign"
    (foreign shards, served at 256 px when data.resize is unset)."""
    if served is None:
        return
    view = int(crop / 0.875)
    size = {
        "make-shards": f"the shards {shards} store images at {served} px (shorter side)",
        "data.resize": f"data.resize={served} serves the images of {shards} at {served} px (shorter side)",
        "foreign": f"the foreign shards {shards} are served at {served} px (shorter side; data.resize is unset)",
    }[served_by]
    remake = served_by == "make-shards"
    if served < crop:
        fix = f"make the shards again with make-shards --resize {view}, or" if remake else f"set data.resize={view}, or"
        raise ConfigError(f"{size}, smaller than data.crop_size {crop}: {fix} set data.crop_size <= {served}")
    if served > STORED_SIZE_SLACK * view:
        fix = f"make the shards with make-shards --resize {view}, or set" if remake else "set"
        notice(
            f"WARNING: {size} but data.crop_size {crop} is made for {view} px (its test view): every image is decoded "
            f"at {(served / view) ** 2:.1f}x the pixels it needs; {fix} data.resize={view}"
        )
