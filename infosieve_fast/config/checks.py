"""What each setting of the config may hold: the choices of the string settings (`CHOICES`), the range of every
numeric setting (`RANGES`), and the rules that tie settings together (`check_rules`). `config.from_dict` runs
`check_ranges` and `check_rules` on every config it builds.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..common.limits import MAX_CLASSES, MAX_IMAGE_PIXELS, MAX_SEED

if TYPE_CHECKING:
    from .settings import Config

CHOICES = {
    "method": ("infosieve", "gcd", "simgcd", "selex"),  # infosieve_fast/methods/'s METHODS
    "selex.batch_features": ("raw", "normalized"),
    "selex.level_order": ("published", "uq"),
    "loss.length_weights": ("stale", "current"),
    "loss.sup_code_input": ("code", "trunc_code"),
    "loss.code_constraint": ("reference", "paper"),
    "loss.categorizer_loss": ("bce", "ce"),
    "loss.code_distance": ("rowsum", "euclidean"),
    "loss.code_infonce_input": ("code_raw", "code"),
    "loss.labeller_grad_stop": ("none", "backbone", "projection"),
    "optim.name": ("sgd", "adamw"),
    "kmeans.balance": ("reference", "capacity"),
    "kmeans.backend": ("auto", "torch", "faiss"),
    "kmeans.distance_precision": ("fp32", "tf32", "bf16"),
    "kmeans.k_rule": ("neighbours", "score"),
    "data.source": ("shards", "digits"),
    "data.sampling": ("weighted", "shuffle"),
    "data.cache": ("auto", "gpu", "cpu", "off"),
    "data.decode": ("auto", "cpu", "gpu"),
    "train.amp": ("auto", "bf16", "off"),
    "train.eval_protocol": ("v1", "v2", "v2b"),
    "train.kernels": ("auto", "triton", "torch"),
    "checkpoint.best": ("none", "labelled_holdout", "kmeans_objective"),
    "train.compile": ("auto", "on", "off"),  # true/false in YAML read as on/off
    "train.cuda_graph": ("auto", "on", "off"),  # true/false in YAML read as on/off
    "train.token_cache": ("auto", "off"),
    "train.checkpoint_blocks": ("auto", "cheap", "on", "off"),  # true/false in YAML read as on/off
}


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: finite, from `low` (open: excluded) up to `high` (None: no bound).
    `null`: what null means, for a setting that may be null."""

    low: float
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    null: str | None = None

    def holds(self, value: float) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        below = self.high is None or (value < self.high if self.open_high else value <= self.high)
        return math.isfinite(value) and above and below

    def values(self) -> str:
        """'>= 1', '> 0' or 'in [0, 1]'."""
        low, high = _number(self.low), _number(self.high)
        if self.high is None:
            return f"{'>' if self.open_low else '>='} {low}"
        return f"in {'(' if self.open_low else '['}{low}, {high}{')' if self.open_high else ']'}"

    def error(self, key: str, value: float) -> str:
        verb = "be" if self.high is None else "lie"
        null = f" (or null: {self.null})" if self.null else ""
        return f"{key} must {verb} {self.values()}{null}, got {value!r}: set --set {key}=<a value {self.values()}>"


def _number(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)  # an int in full: a seed's bound is 4294967295


_POSITIVE = Range(0.0, open_low=True)
_SHARE = Range(0.0, 1.0)
_SIZE = Range(1)
_SEED = Range(0, MAX_SEED)  # what NumPy's and PyTorch's generators take
_SIDE = Range(1, math.isqrt(MAX_IMAGE_PIXELS))  # an image side: a square of it stays within the decoders' limit

# The range of every numeric setting. Every other setting is a bool, one of `CHOICES`, or checked by name in
# `check_rules`; tests/test_config_ranges.py holds a bad value for each key of model, loss, optim, schedule, kmeans.
RANGES = {
    "model.grad_from_block": Range(0, null="every backbone parameter trains"),
    "model.proj_hidden_dim": _SIZE,
    "model.proj_bottleneck_dim": _SIZE,
    "model.proj_out_dim": _SIZE,
    "model.proj_layers": Range(2),  # the head's MLP has proj_layers - 2 hidden layers (DINOHead's nlayers)
    "model.code_length": _SIZE,
    "model.labeller_hidden_dim": _SIZE,
    "model.labeller_layers": Range(0),  # hidden layers of the coder, masker and categorizer
    **{f"loss.{name}": Range(0.0) for name in ("alpha", "beta", "delta", "zeta", "mu", "eta")},
    "loss.sup_con_weight": _SHARE,
    "loss.sup_code_weight": _SHARE,
    "loss.temperature": _POSITIVE,
    "loss.supcon_temperature": _POSITIVE,
    "loss.label_smoothing": _SHARE,
    "loss.code_temperature": Range(0.0, open_low=True, null="loss.temperature"),
    "loss.code_supcon_temperature": Range(0.0, open_low=True, null="loss.supcon_temperature"),
    "loss.code_label_smoothing": Range(0.0, 1.0, null="loss.label_smoothing"),
    "optim.lr": _POSITIVE,
    "optim.momentum": Range(0.0, 1.0, open_high=True),
    "optim.weight_decay": Range(0.0),
    "optim.min_lr_ratio": _SHARE,
    "optim.backbone_lr_scale": _SHARE,
    "schedule.epochs": _SIZE,
    "schedule.age_max": _POSITIVE,
    # the positional base falls from base_start by up to 1 over the run, and base^-k needs a positive base
    "schedule.base_start": Range(1.0, open_low=True),
    "kmeans.n_init": Range(1, 1000),
    "kmeans.max_iter": Range(1, 10_000),  # the reference runs 10 iterations per round (sklearn's default: 300)
    "kmeans.tol": Range(0.0),
    "kmeans.cluster_size": Range(1, null="ceil(N / K)"),
    "data.batch_size": Range(2),
    "data.feature_batch_size": _SIZE,
    "data.labelled_share": Range(0.0, 1.0, null="the reference's sampler weights"),
    "data.gpu_cache_share": Range(0.0, 1.0, open_low=True),
    "data.max_aspect": Range(1.0, null="no cap"),
    "data.resize": Range(1, _SIDE.high, null="the manifest's resize, 256 for foreign shards"),
    "data.crop_size": _SIDE,
    "data.color_jitter": Range(0.0),
    "data.num_workers": Range(0, 256),
    "data.memory_threshold_mb": Range(0.0),
    "data.intake.labelled_prop": Range(0.0, 1.0, open_low=True),
    "data.intake.split_seed": _SEED,
    "data.digits.split_seed": _SEED,
    "data.digits.image_size": _SIDE,
    "train.seed": _SEED,
    "train.max_steps_per_epoch": Range(1, null="a full epoch"),
    "train.train_subset": Range(1, null="every train sample"),
    "train.check_every": _SIZE,
    "train.eval_every": Range(0),
    "checkpoint.holdout_fraction": Range(0.0, 1.0, open_low=True, open_high=True),
    "checkpoint.holdout_seed": _SEED,
    "checkpoint.keep_last": Range(1, null="only the last checkpoint (and the best one)"),
    "gcd.sup_con_weight": _SHARE,
    "gcd.temperature": _POSITIVE,
    "gcd.supcon_temperature": _POSITIVE,
    "simgcd.memax_weight": Range(0.0),
    "simgcd.sup_weight": _SHARE,
    "simgcd.student_temperature": _POSITIVE,
    "simgcd.warmup_teacher_temperature": _POSITIVE,
    "simgcd.teacher_temperature": _POSITIVE,
    "simgcd.warmup_teacher_epochs": _SIZE,
    "simgcd.temperature": _POSITIVE,
    "simgcd.supcon_temperature": _POSITIVE,
    "selex.smoothing": _SHARE,
    "selex.sup_con_weight": _SHARE,
    "selex.temperature": _POSITIVE,
    "selex.supcon_temperature": _POSITIVE,
    "selex.cluster_momentum": _SHARE,
}


def check_ranges(cfg: Config) -> None:
    """Every numeric setting of `RANGES` that is not null lies in its range."""
    for key, allowed in RANGES.items():
        value = operator.attrgetter(key)(cfg)
        if value is not None and not allowed.holds(value):
            raise ConfigError(allowed.error(key, value))


def check_rules(cfg: Config) -> None:
    """The settings that are not numbers in a range, and the rules that tie settings together."""
    m = cfg.model
    if not m.backbone.strip():
        raise ConfigError("model.backbone must name a timm model or one of infosieve_fast/network/backbones.py, got ''")
    if m.pretrained is not None and not m.pretrained.strip():
        raise ConfigError("model.pretrained must be a checkpoint file or null (no pretrained weights), got ''")
    _check_backbone_kwargs(m.backbone_kwargs, cfg.data.crop_size)
    k = cfg.kmeans.n_clusters
    if k is not None and k != "auto" and not (isinstance(k, int) and 2 <= k <= MAX_CLASSES):
        raise ConfigError(f"kmeans.n_clusters must be null, an integer in [2, {MAX_CLASSES:,}] or auto, got {k!r}")
    _check_normalisation(cfg.data.mean, cfg.data.std)
    if cfg.data.source == "digits":
        check_clusters_for_known(k, cfg.data.digits.known_classes)
    km = cfg.kmeans
    if km.cluster_size is not None and not (km.balanced or km.eval_balanced):
        raise ConfigError(
            "kmeans.cluster_size is the balanced rounds' capacity, but kmeans.balanced and "
            "kmeans.eval_balanced are both false: drop it or set one of them true"
        )
    if cfg.data.source == "digits":
        d = cfg.data.digits
        if not 1 <= d.known_classes <= 9:
            raise ConfigError(f"data.digits.known_classes must lie in 1..9, got {d.known_classes}")
        if not 0.0 < d.labelled_prop <= 1.0:
            raise ConfigError(f"data.digits.labelled_prop must lie in (0, 1], got {d.labelled_prop}")
        if d.image_size < cfg.data.crop_size:
            size, crop = d.image_size, cfg.data.crop_size
            raise ConfigError(f"data.digits.image_size ({size}) must be >= data.crop_size ({crop}): raise it")
    _check_pins(cfg.data.intake.sha256)
    _check_method_sections(cfg)
    if cfg.data.resize is not None and cfg.data.resize < cfg.data.crop_size:
        size, crop = cfg.data.resize, cfg.data.crop_size
        raise ConfigError(f"data.resize ({size}) must be >= data.crop_size ({crop}): the crops lie inside the image")
    if cfg.train.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("train.tensorboard=true needs the tensorboard package: pip install tensorboard") from None


def check_clusters_for_known(n_clusters: int | str | None, n_old: int) -> None:
    """kmeans.n_clusters against the data's `n_old` known classes, before any work: every known class needs its own
    cluster, and "auto" needs two known classes (with one, K = 1 clusters all the labelled points together and
    always scores best, so the estimate would always be 1)."""
    if n_clusters == "auto" and n_old < 2:
        raise ConfigError(
            f"kmeans.n_clusters=auto needs at least 2 known classes to estimate K, and this data has {n_old}: set "
            "kmeans.n_clusters to the number of categories you expect (--set kmeans.n_clusters=N)"
        )
    if isinstance(n_clusters, int) and n_clusters < n_old:
        raise ConfigError(
            f"kmeans.n_clusters={n_clusters} is fewer than the data's {n_old} known classes, each of which needs its "
            f"own cluster: set kmeans.n_clusters >= {n_old} (above it to leave clusters for new categories), or auto"
        )


def _check_method_sections(cfg: Config) -> None:
    """A method's own section (gcd, simgcd, selex) changed while another method trains would be silently unused."""
    from .settings import METHOD_SECTIONS

    for section in METHOD_SECTIONS:
        value = getattr(cfg, section)
        changed = [f.name for f in dataclasses.fields(value) if getattr(value, f.name) != f.default]
        if section != cfg.method and changed:
            raise ConfigError(
                f"{section}.{changed[0]} is a setting of method {section}, but this config trains method "
                f"{cfg.method}: set method={section}, or drop the {section}.* settings"
            )


def _check_normalisation(mean: list, std: list) -> None:
    """data.mean and data.std: one finite number per channel, the std's above 0 (it divides)."""
    for key, values, low in (("data.mean", mean, None), ("data.std", std, 0.0)):
        numbers = isinstance(values, list) and values and all(isinstance(v, (int, float)) for v in values)
        if not numbers or not all(map(math.isfinite, values)) or (low is not None and min(values) <= low):
            what = "> 0" if low is not None else "finite"
            raise ConfigError(f"{key} must be a list of numbers {what}, one per channel, got {values!r}")


def _check_pins(pins: dict | None) -> None:
    """data.intake.sha256: remote shard URLs mapped to 64 hex digits."""
    for url, digest in (pins or {}).items():
        if not (isinstance(url, str) and url.startswith(("pipe:", "http://", "https://"))):
            raise ConfigError(f"data.intake.sha256 maps remote shard URLs (http(s)://, pipe:) to hashes, not {url!r}")
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-fA-F]{64}", digest)):
            raise ConfigError(
                f"data.intake.sha256[{url!r}] must be the shard's SHA-256 as 64 hex digits (`sha256sum FILE`), "
                f"got {digest!r}"
            )


def _check_backbone_kwargs(kwargs: dict, crop: int) -> None:
    """timm.create_model's extra arguments: named by strings, and a ViT's `img_size` is the training crop (timm's
    ViTs take inputs of exactly that size unless `dynamic_img_size` is set)."""
    names = [name for name in kwargs if not isinstance(name, str)]
    if names:
        raise ConfigError(f"model.backbone_kwargs must map argument names of timm.create_model, got keys {names}")
    size = kwargs.get("img_size")
    if size is not None and not kwargs.get("dynamic_img_size") and size not in (crop, [crop, crop]):
        raise ConfigError(
            f"model.backbone_kwargs.img_size ({size}) must equal data.crop_size ({crop}), the size of the images the "
            f"backbone takes: set --set model.backbone_kwargs.img_size={crop} (or dynamic_img_size: true)"
        )
