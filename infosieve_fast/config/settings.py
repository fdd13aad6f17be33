"""One config object: dataclasses loaded from YAML, overridden from the CLI (`--set optim.lr=0.05`).

Defaults are the reference implementation's (docs/reference.md §1, §3.8, §4); every departure from it is a named switch.
Unknown keys are rejected with their full dotted name, and every value is checked when the config loads, before any
data is read: its type, its choices (`CHOICES`), its range (`RANGES`) and the few rules that tie settings together
(config_checks.py).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .checks import CHOICES, ConfigError, check_ranges, check_rules
from .yaml_text import load_yaml


@dataclass
class ModelConfig:
    backbone: str = "vit_base_patch16_224"  # a timm model name, created without pretrained weights
    pretrained: str | None = None  # local checkpoint file (timm or original DINO layout); nothing is downloaded
    backbone_kwargs: dict = field(default_factory=dict)  # extra timm.create_model arguments (e.g. in_chans)
    grad_from_block: int | None = 10  # blocks >= this train (docs/reference.md §2.1); null: all of the backbone trains
    proj_hidden_dim: int = 2048
    proj_bottleneck_dim: int = 256
    proj_out_dim: int = 65536
    proj_layers: int = 3
    code_length: int = 40
    labeller_hidden_dim: int = 128
    labeller_layers: int = 2  # the reference's nlayers=2 gives two hidden 128->128 layers


@dataclass
class LossConfig:
    alpha: float = 1.0  # L_C_in
    beta: float = 1.0  # L_C_code
    delta: float = 0.1  # L_length
    zeta: float = 0.01  # L_code_cond
    mu: float = 0.01  # L_mask_cond
    eta: float = 0.01  # L_cat
    sup_con_weight: float = 0.35  # lambda_in
    sup_code_weight: float = 0.35  # lambda_code
    temperature: float = 1.0  # InfoNCE T
    supcon_temperature: float = 0.07  # SupCon tau (= base temperature)
    label_smoothing: float = 1.0  # --unsupervised_smoothing
    # Reference-parity switches (docs/reference.md §11); the first value is the reference's behaviour.
    length_weights: str = "stale"  # "stale": always base 2 (the reference bug) | "current": this epoch's base
    sup_code_input: str = "code"  # "code": untruncated weighted code (reference) | "trunc_code": as the paper says
    code_constraint: str = "reference"  # "reference": mean(1-z^2) + bit balance | "paper": mean(z01^2 (1-z01)^2)
    categorizer_loss: str = "bce"  # "bce": BCEWithLogits on one-hot (reference) | "ce": softmax cross-entropy
    # Code-learning switches (docs/tree.md); the defaults are the reference's behaviour. The reference divides each
    # code distance by its row sum, so every code logit is O(1/2B) and both code terms sit at chance.
    code_distance: str = "rowsum"  # "rowsum": -d_ij / sum_k d_jk (reference) | "euclidean": -d_ij, as the features
    code_temperature: float | None = None  # the code InfoNCE's T (null: `temperature`)
    code_supcon_temperature: float | None = None  # the code SupCon's tau (null: `supcon_temperature`)
    code_label_smoothing: float | None = None  # the code InfoNCE's smoothing (null: `label_smoothing`)
    # the code InfoNCE's input: "code_raw" (reference): every digit alike | "code": positionally weighted, as the code
    # SupCon's, so the first digits (the tree's top levels) carry more of the instance discrimination
    code_infonce_input: str = "code_raw"
    # Where the gradients of the labeller's terms (code, categorizer, length, constraints) stop. "none" (reference):
    # they reach the backbone. "backbone": they train the labeller and the projection head, and the backbone learns
    # from the input terms alone (the projection head runs twice, once on detached features). "projection": the
    # labeller only.
    labeller_grad_stop: str = "none"


@dataclass
class GCDConfig:
    """`method: gcd` (docs/reference.md §12.1): InfoNCE and ground-truth SupCon on the cosine projection."""

    sup_con_weight: float = 0.35  # lambda: (1 - lambda) InfoNCE + lambda SupCon
    temperature: float = 1.0  # InfoNCE T
    supcon_temperature: float = 0.07  # SupCon tau (= base temperature)


@dataclass
class SimGCDConfig:
    """`method: simgcd` (docs/reference.md §12.2); defaults are the published train.py's. Its scripts set
    memax_weight 2 for CUB, 4 for CIFAR-100 and 1 elsewhere."""

    memax_weight: float = 2.0  # the mean-entropy regulariser's weight
    sup_weight: float = 0.35  # lambda of the supervised terms (cross-entropy, SupCon)
    student_temperature: float = 0.1
    warmup_teacher_temperature: float = 0.07  # the teacher's temperature at epoch 0 ...
    teacher_temperature: float = 0.04  # ... falling linearly to this over the warm-up epochs
    warmup_teacher_epochs: int = 30
    temperature: float = 1.0  # InfoNCE T
    supcon_temperature: float = 0.07  # SupCon tau


@dataclass
class SelExConfig:
    """`method: selex` (docs/reference.md §12.3). Its scripts set smoothing 1.0 for CUB and Cars, 0.5 for Aircraft and
    Pets, 0.1 for generic data."""

    smoothing: float = 1.0  # the soft targets' share of the InfoNCE target
    sup_con_weight: float = 0.35
    temperature: float = 1.0
    supcon_temperature: float = 0.07
    cluster_momentum: float = 1.0  # per-step update of the cluster radii (1: kept as computed each epoch, published)
    # the batch's backbone features the radii are compared with: "raw" (published) | "normalized" (as the centres')
    batch_features: str = "raw"
    # how a level >= 1's labels reach the samples: "published" (read in the wrong order, docs/reference.md §12.3
    # surprise 4) | "uq" (each sample its own)
    level_order: str = "published"


METHOD_SECTIONS = ("gcd", "simgcd", "selex")  # each method's own settings section, named as its `method:` value


@dataclass
class OptimConfig:
    name: str = "sgd"  # "sgd" | "adamw"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    min_lr_ratio: float = 1e-3  # cosine to lr * this (CosineAnnealingLR eta_min = lr * 1e-3)
    # The trained backbone blocks' lr as a share of lr (1.0: one lr for every parameter, the reference). Below 1 the
    # pretrained features drift less while the freshly initialised heads learn at full speed.
    backbone_lr_scale: float = 1.0


@dataclass
class ScheduleConfig:
    epochs: int = 200
    age_max: float = 20.0  # age = age_max * (epoch + 1) / epochs; equals the reference's (epoch+1)/10 at 200 epochs
    base_start: float = 2.0  # positional base = base_start - epoch / epochs


@dataclass
class KMeansConfig:
    n_init: int = 10
    max_iter: int = 10
    tol: float = 1e-4
    balanced: bool = True  # the reference balances per-epoch pseudo-labels unless --unbalanced (Herbarium19)
    # "reference": the published two phases (docs/reference.md §5.2), Phase A with frozen labelled centres (+ capacity
    # passes when balanced), then Phase B; with balanced: false it is the published --unbalanced run. "capacity": a hard
    # capacity when balanced; with balanced: false it is GCD's one-phase SS-k-means (docs/reference.md §5.1).
    balance: str = "reference"
    backend: str = "auto"  # "auto": FAISS only with GPU FAISS and CUDA features, else torch | "torch" | "faiss"
    eval_balanced: bool = True  # the final evaluation's SS-k-means (k_means.py) is balanced unless --unbalanced
    # nearest-centre GEMM: "fp32" exact (published) | "tf32" / "bf16": faster on GPUs; rows within the GEMM's error
    # bound of a tie are re-searched exactly, so every nearest centre is fp32's (docs/kmeans.md)
    distance_precision: str = "fp32"
    # clusters: null = the dataset's number of classes (the published runs) | an integer | "auto": estimated from
    # the backbone features before training (`infosieve estimate-k`, by `k_rule`), then kept for the whole run
    n_clusters: int | str | None = None
    # n_clusters=auto's rule: "neighbours" counts the unlabelled images without labelled neighbours | "score": GCD's
    # labelled-accuracy search (docs/kmeans.md compares them)
    k_rule: str = "neighbours"
    # balanced rounds' capacity: null = ceil(N / K), as published (docs/reference.md §5.2); an integer >= 1 sets it
    cluster_size: int | None = None
    # labelled clusters keep their class mean as centre in every iteration (the published code frees them in Phase B)
    freeze_labelled_centers: bool = False


@dataclass
class DigitsConfig:
    """The embedded demo set's GCD split and size (`data.source: digits`)."""

    known_classes: int = 5  # digits 0..known_classes-1 are known
    labelled_prop: float = 0.5  # share of the known digits' images that are labelled
    split_seed: int = 0  # RandomState seed of that choice
    image_size: int = 32  # the 8x8 images are upscaled to this size before cropping


@dataclass
class IntakeConfig:
    """WebDataset shards written by other tools (no manifest.json; data/reading/intake.py). The image is the first of
    `image_keys` present, the label a class id or name under `label_key`, or the field `label_field` of that (json)
    member; `class_list`: class names, one per line. The split is make-shards': `known_classes` (ids or names; null:
    the first half), `labelled_prop` of their images labelled, chosen by `split_seed`."""

    image_keys: str = "jpg;jpeg;png;webp"
    label_key: str = "cls"
    label_field: str | None = None
    class_list: str | None = None
    known_classes: list | None = None
    labelled_prop: float = 0.5
    split_seed: int = 0
    index_cache: str = "~/.cache/infosieve/index"  # the saved shard index, when the shards' folder is read-only
    download_cache: str = "~/.cache/infosieve/shards"  # where pipe: and http(s):// shards are fetched to, once
    sha256: dict | None = None  # remote shard URL -> its SHA-256 (hex): a fetched file that differs is refused, removed


@dataclass
class DataConfig:
    source: str = "shards"  # "shards" (data/reading/stream.py) | "digits" (the embedded demo set)
    # A folder written by `infosieve make-shards`, or WebDataset shards from anywhere: a folder of tars, a brace
    # pattern (train-{000000..000009}.tar), a glob, or a list of these (data/reading/intake.py).
    shards: str | list | None = None
    batch_size: int = 128
    feature_batch_size: int = 256
    labelled_share: float | None = None  # null = the reference's sampler weights ((U+L)/(2U+L))
    crop_size: int = 224
    hflip: bool = True
    mean: list = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list = field(default_factory=lambda: [0.229, 0.224, 0.225])
    color_jitter: float = 0.0  # the reference's ColorJitter() is the identity: 0 keeps parity
    num_workers: int = 4
    memory_threshold_mb: float = 4096  # shards: keep the decoded split in RAM below this decoded size
    # Shards (data/reading/stream.py). Sampling "weighted": N draws per epoch with the reference's WeightedRandomSampler
    # weights | "shuffle": a permutation (every sample once per epoch, no re-weighting).
    sampling: str = "weighted"
    cache: str = "auto"  # decoded split kept on "gpu" | "cpu" | "off" (stream); "auto": GPU if it fits, else RAM
    gpu_cache_share: float = 0.5  # cache="auto": on the GPU when the decoded split fits this share of free memory
    decode: str = "auto"  # "auto": nvJPEG on the GPU when training on CUDA, else the CPU workers | "cpu" | "gpu"
    max_aspect: float | None = None  # cap the stored images' longer side at this x the shorter (null: the reference)
    # Stored images whose shorter side differs from this are resized on load (null: the make-shards manifest's
    # resize; 256 for foreign shards).
    resize: int | None = None
    intake: IntakeConfig = field(default_factory=IntakeConfig)  # foreign shards and the saved index
    digits: DigitsConfig = field(default_factory=DigitsConfig)  # source: digits only (shards carry their split)


@dataclass
class TrainConfig:
    seed: int = 1
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    amp: str = "auto"  # "auto": bf16 on CUDA, off on CPU | "bf16" | "off"
    eval_protocol: str = "v2"
    kernels: str = "auto"  # kernel backend: "auto" | "triton" | "torch"
    max_steps_per_epoch: int | None = None  # cap for smoke runs; null = a full epoch
    train_subset: int | None = None  # use only the first N train samples (smoke runs)
    # Speed switches (docs/training.md). The step never waits for the GPU: the finiteness check and the progress-bar
    # loss are read from the device every `check_every` steps (and at the end of the epoch).
    check_every: int = 50
    frozen_bf16: bool = False  # the frozen prefix (a split ViT's, efficientnet_lite0's) stored and run in plain bf16
    # torch.compile of the backbone blocks and the projection head: "auto" compiles on CUDA and falls back to eager if
    # compiling fails (the log says which ran), "on" raises instead, "off" never compiles
    # (infosieve_fast/network/compiling.py)
    compile: str = "auto"
    # the training step captured in a CUDA graph and replayed: "off" (the default until a GPU run has measured it) |
    # "auto" captures on CUDA with one process, else eager (the log says which ran) | "on" raises where it cannot
    # (infosieve_fast/training/step_graph.py)
    cuda_graph: str = "off"
    # the frozen prefix's tokens of the test-view passes kept and replayed: "auto" (on the GPU if they fit, else in RAM
    # below data.memory_threshold_mb, else recomputed) | "off" (infosieve_fast/network/token_cache.py)
    token_cache: str = "auto"
    # what the trained ViT blocks keep for the backward pass: "cheap" the matrix products' and attention's outputs (the
    # cheap ops between them are recomputed) | "auto" cheap on the GPU for an eager block, else off | "on" only their
    # inputs (the whole blocks recomputed) | "off" everything (the reference); the gradients are the same bit for bit
    # (infosieve_fast/network/recompute.py)
    checkpoint_blocks: str = "auto"
    # each epoch's checkpoint serialised and fsynced in a writer thread while the next epoch runs (its state copied to
    # host memory first); the next checkpoint and the end of the run wait for it, and a failed write is raised there
    background_checkpoint: bool = True
    # Logging. eval_every N > 0: All/Old/New of the unlabelled train samples (and of the test split, for shards) in
    # log.jsonl every N epochs, as the published loop prints every epoch (0: only before and after training; each
    # evaluation costs a test-view feature pass and a k-means round). tensorboard: the log's numbers as TensorBoard
    # scalars in RUN/tensorboard (pip install tensorboard).
    eval_every: int = 0
    tensorboard: bool = False


@dataclass
class CheckpointConfig:
    """Which checkpoints a run keeps (docs/training.md). RUN/checkpoint.pt is always the last. `best`: "none" (the
    published behaviour) | "labelled_holdout": also keep the epoch whose k-means clusters best match held-out labelled
    images of the known classes (GCD's criterion for K); `holdout_fraction` of the labelled images, chosen with
    `holdout_seed`, then never take part in the supervised losses | "kmeans_objective": the epoch with the lowest
    k-means inertia of the features. Neither reads a label of an unlabelled image. `keep_last`: null (the default)
    keeps no other; N also keeps RUN/checkpoint-epoch-E.pt of the last N epochs (E: epochs trained)."""

    best: str = "none"
    holdout_fraction: float = 0.1
    holdout_seed: int = 0
    keep_last: int | None = None


@dataclass
class Config:
    name: str = "infosieve"
    # the GCD method trained (infosieve_fast/methods/): "infosieve" | "gcd" | "simgcd" | "selex"; each of the last three
    # reads its own section below (and a section of another method left at its defaults)
    method: str = "infosieve"
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    kmeans: KMeansConfig = field(default_factory=KMeansConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    gcd: GCDConfig = field(default_factory=GCDConfig)
    simgcd: SimGCDConfig = field(default_factory=SimGCDConfig)
    selex: SelExConfig = field(default_factory=SelExConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Keys that moved (old dotted key -> new): run folders written before a move are read upgraded (`upgrade_saved`); a
# config file that still uses an old key is told the new one.
MOVED = {f"data.{k}": f"data.digits.{k}" for k in ("known_classes", "labelled_prop", "split_seed", "image_size")}


def upgrade_saved(values: dict) -> dict:
    """A saved config (a run folder's config.yaml, a checkpoint's) with every `MOVED` key under its new name."""
    values = copy.deepcopy(values)
    for old, new in MOVED.items():
        section, name = old.rsplit(".", 1)
        node = _lookup(values, section)
        if isinstance(node, dict) and name in node:
            section, name_now = new.rsplit(".", 1)
            target = values
            for part in section.split("."):
                target = target.setdefault(part, {})
            target[name_now] = node.pop(name)
    return values


def from_saved(values: dict) -> Config:
    """The config a run folder or checkpoint saved (`Config.to_dict()` of any earlier version)."""
    return from_dict(upgrade_saved(values))


def _lookup(values: dict, dotted: str):
    for part in dotted.split("."):
        values = values.get(part) if isinstance(values, dict) else None
    return values


def _build(cls, values: dict, prefix: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {values!r}")
    not_names = [k for k in values if not isinstance(k, str)]  # YAML keys may be null, numbers, ...
    if not_names:
        raise ConfigError(f"{prefix or 'config'} keys must be names, got {not_names[:3]!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    moved = [f"{prefix}{k} is now {MOVED[prefix + k]}" for k in unknown if prefix + k in MOVED]
    if moved:
        raise ConfigError(f"renamed config key(s): {'; '.join(moved)}")
    if unknown:
        names = ", ".join(f"{prefix}{k}" if k.isprintable() else repr(prefix + k) for k in unknown)  # a key may hold \n
        raise ConfigError(f"unknown config key(s): {names}; valid keys here: {', '.join(sorted(known))}")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(value: Any, hint, key: str):
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key} may not be null")
    kinds = [a for a in args if a is not type(None)]
    if len(kinds) > 1:  # a union such as int | str: the value keeps its own type, which must be one of them
        if any(isinstance(value, k) and not (k is int and isinstance(value, bool)) for k in kinds):
            return value
        raise ConfigError(f"{key} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if base is float and isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if base is str and isinstance(value, bool) and key in CHOICES:  # YAML 1.1 reads off/on as booleans
        word = "on" if value else "off"
        if word in CHOICES[key]:
            value = word
    expected = typing.get_origin(base) or base
    if expected in (int, float, str, bool, list, dict) and not isinstance(value, expected):
        raise ConfigError(f"{key} must be {expected.__name__}, got {value!r}")
    if expected is int and isinstance(value, bool):
        raise ConfigError(f"{key} must be int, got {value!r}")
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"{key} must be one of {CHOICES[key]}, got {value!r}")
    return value


def from_dict(values: dict) -> Config:
    cfg = _build(Config, values, "")
    check_ranges(cfg)
    check_rules(cfg)
    return cfg


def apply_overrides(values: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` strings (value parsed as YAML) to a nested dict."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        node = values
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        try:
            node[parts[-1]] = load_yaml(raw)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r} is not valid YAML: {' '.join(str(err).split())}") from None
    return values


# File and folder settings. A relative path in a config file is resolved against that file's folder (a config and
# the files it names move together); one given on the command line (--set, --data.shards), against the working
# directory. Both are stored absolute, so a run folder's config.yaml means the same from any working directory.
PATH_KEYS = ("model.pretrained", "data.shards", "data.intake.class_list")


def _absolute(value: str, base: Path) -> str:
    if value.startswith(("pipe:", "http://", "https://")):  # not a path
        return value
    return os.path.abspath(base / Path(value).expanduser())


def _absolute_paths(values: dict, base: Path) -> None:
    for key in PATH_KEYS:
        section, name = key.rsplit(".", 1)
        node = _lookup(values, section)
        if isinstance(node, dict) and isinstance(node.get(name), str) and node[name]:
            node[name] = _absolute(node[name], base)
        elif isinstance(node, dict) and isinstance(node.get(name), list):  # data.shards: a list of shard specs
            node[name] = [_absolute(v, base) if isinstance(v, str) and v else v for v in node[name]]


def load_config(path: str | Path | None, overrides: list[str] = (), saved: bool = False) -> Config:
    """Config from a YAML file (or the defaults when `path` is None) with CLI overrides applied; relative paths
    resolved (`PATH_KEYS`: from the file against its folder, from an override against the working directory).
    `saved`: the file is a run folder's config.yaml, read with moved keys upgraded."""
    values: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found: pass an existing YAML file (see configs/)")
        try:
            values = load_yaml(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as err:
            raise ConfigError(f"config file {path} is not UTF-8 text ({err}): save it as UTF-8") from None
        except yaml.YAMLError as err:  # PyYAML's text spans lines: one line here
            raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(err).split())}") from None
        _absolute_paths(values, path.parent)
        if saved:
            values = upgrade_saved(values)
    values = apply_overrides(values, list(overrides))
    _absolute_paths(values, Path.cwd())  # only the overrides' paths are still relative
    return from_dict(values)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write `cfg` as YAML, atomically (a kill mid-write leaves the old file or none, never half of one)."""
    from ..common.files import atomic_write

    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    atomic_write(Path(path), lambda f: f.write(text.encode()))


def _flatten(values: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and f"{prefix}{key}" not in _DICT_VALUED:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


_DICT_VALUED = {"model.backbone_kwargs"}  # settings whose value is a mapping (compared whole)


def config_drift(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """The dotted keys whose values differ between two configs (as `Config.to_dict()`; a saved config from before a
    key existed counts as holding its default), each with (saved value, current value)."""

    def normal(values: dict) -> dict:
        try:
            return from_saved(values).to_dict()
        except ValueError:  # ConfigError, or a section's own check
            return values

    a, b = _flatten(normal(saved)), _flatten(normal(current))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
