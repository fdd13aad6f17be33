"""The InfoSieve model: backbone -> projection head (DINOHead) -> labeller (coder, masker, categorizer).

Shapes, init and state-dict keys follow docs/reference.md §2. Departures: `age`, `code_weight` and `length_weight` are
buffers (the reference keeps them as plain attributes, so its checkpoints lose them), and the backbone's frozen
blocks run under `torch.no_grad()` so they keep no activations.
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import infosieve_kernels as kernels
from infosieve_kernels.layers import mlp, trunc_normal_init

from ..common.files import read_pretrained
from ..config.settings import ModelConfig
from . import recompute

_BLOCK_INDEX = re.compile(r"blocks?\.(\d+)\.")


# ----------------------------------------------------------------------------------------------------------- backbone
@dataclass(frozen=True)
class PrefixTokens:
    """The frozen prefix's output for a batch, passed where images go (`Backbone.forward`, `InfoSieve.features`, the
    model's forward) so that only the trained part runs."""

    tokens: Tensor


class Backbone(nn.Module):
    """A timm model (or any module mapping images to [B, feat_dim]) with the reference's freezing rule.

    `grad_from_block=g`: every parameter is frozen, then those of blocks >= g train; patch_embed, cls_token,
    pos_embed and the final norm stay frozen (docs/reference.md §2.1). `None` trains everything. For timm ViTs the
    frozen prefix (embedding and blocks < g) runs under `inference_mode`, so it keeps no activations.

    `frozen_bf16=True` stores the frozen prefix in bf16 and runs it in plain bf16 (residual stream and LayerNorm
    included) instead of under fp32-autocast: autocast keeps LayerNorm and the residual adds in fp32 and casts every
    activation back to bf16, which costs more than the frozen blocks' matmuls on a GPU. Off by default. A backbone
    that is not a split ViT takes it if it offers `store_frozen_prefix_in_bf16()` (efficientnet_lite0 does).

    `checkpoint_trained` (`train.checkpoint_blocks`, `recompute.py`): what the trained blocks keep for the backward
    pass. "cheap" keeps the matrix products' and attention's outputs and recomputes the cheap ops between them; "auto"
    is "cheap" on the GPU for a block not compiled, else "off"; "on" recomputes the whole blocks (the least memory,
    one more forward of them); "off" keeps everything. A backbone that is not a split ViT has no trained blocks to
    treat: "auto" leaves it as it is, "cheap" and "on" are refused.
    """

    def __init__(
        self,
        net: nn.Module,
        feat_dim: int,
        grad_from_block: int | None,
        frozen_bf16: bool = False,
        checkpoint_trained: str = "off",
    ):
        super().__init__()
        self.net, self.feat_dim, self.grad_from_block = net, feat_dim, grad_from_block
        for name, param in net.named_parameters():
            param.requires_grad = grad_from_block is None or _block_index(name) >= grad_from_block
        self._split_vit = grad_from_block is not None and hasattr(net, "blocks") and hasattr(net, "patch_embed")
        if checkpoint_trained not in recompute.MODES:
            raise ValueError(f"train.checkpoint_blocks must be one of {recompute.MODES}, got {checkpoint_trained!r}")
        if checkpoint_trained in recompute.ALWAYS_RECOMPUTING and not self._split_vit:
            raise ValueError(
                "train.checkpoint_blocks needs a timm ViT backbone with model.grad_from_block set (trained blocks)"
            )
        self.frozen_bf16, self.checkpoint_trained = frozen_bf16, checkpoint_trained
        if frozen_bf16 and not self._split_vit:
            if not hasattr(net, "store_frozen_prefix_in_bf16") or grad_from_block is None:
                raise ValueError(
                    "train.frozen_bf16 needs a frozen block prefix: a timm ViT or efficientnet_lite0 backbone with "
                    "model.grad_from_block set"
                )
            net.store_frozen_prefix_in_bf16()
        elif frozen_bf16:
            for module in self._frozen_modules():
                module.to(torch.bfloat16)
            for param in net.parameters(recurse=False):  # cls_token, pos_embed, ...
                param.data = param.data.to(torch.bfloat16)

    def _frozen_modules(self) -> list[nn.Module]:
        net = self.net
        return [net.patch_embed, net.norm_pre, *net.blocks[: self.grad_from_block]]

    def _frozen_prefix(self, x: Tensor) -> Tensor:
        net = self.net
        if self.frozen_bf16:
            x = x.to(torch.bfloat16)
        with torch.autocast(x.device.type, enabled=False) if self.frozen_bf16 else contextlib.nullcontext():
            x = net.norm_pre(net.patch_drop(net._pos_embed(net.patch_embed(x))))
            for block in net.blocks[: self.grad_from_block]:
                x = block(x)
        return x

    @property
    def prefix_is_pure(self) -> bool:
        """Whether the frozen prefix's output is a function of the image alone, so it may be cached across passes: a
        split ViT whose frozen modules keep no running statistics (a BatchNorm there is updated by every training
        forward, frozen or not), or a backbone that says so itself (`net.prefix_is_pure`, with `frozen_tokens` and
        `from_frozen_tokens`: efficientnet_lite0)."""
        if not self._split_vit:
            return self.grad_from_block is not None and bool(getattr(self.net, "prefix_is_pure", False))
        modules = (m for frozen in self._frozen_modules() for m in frozen.modules())
        return not any(getattr(m, "track_running_stats", False) for m in modules)

    def frozen_tokens(self, x: Tensor) -> Tensor:
        """The frozen prefix's output for images `x` (no autograd), as `forward` computes it."""
        with torch.inference_mode():
            return self._frozen_prefix(x) if self._split_vit else self.net.frozen_tokens(x)

    def forward(self, x: Tensor | PrefixTokens) -> Tensor:
        """Features of images `x`, or of `PrefixTokens` (the frozen prefix's output computed earlier: only the trained
        blocks and the head run)."""
        if isinstance(x, PrefixTokens):
            if not self._split_vit:
                if not self.prefix_is_pure:
                    raise TypeError("PrefixTokens need a backbone split into a frozen prefix and trained blocks")
                return self.net.from_frozen_tokens(x.tokens)
            x = x.tokens
        elif not self._split_vit:
            return self.net(x)
        elif torch.is_grad_enabled():
            x = self.frozen_tokens(x)
        else:
            x = self._frozen_prefix(x)
        net, g = self.net, self.grad_from_block
        if torch.is_grad_enabled():  # an inference tensor cannot enter autograd: copy it (one activation per step)
            x = x.float() if self.frozen_bf16 else x.clone()
        else:
            x = x.float() if self.frozen_bf16 else x
        for block in net.blocks[g:]:
            x = recompute.run_trained_block(block, x, self.checkpoint_trained)
        return net.forward_head(net.norm(x), pre_logits=True)


def _block_index(name: str) -> int:
    """Index of the block a parameter belongs to; -1 for parameters outside any block (always frozen)."""
    match = _BLOCK_INDEX.search(name)
    return int(match.group(1)) if match else -1


def build_backbone(
    cfg: ModelConfig,
    net: nn.Module | None = None,
    feat_dim: int | None = None,
    frozen_bf16: bool = False,
    checkpoint_trained: str = "off",
) -> Backbone:
    """The backbone from `net` (any module, with `feat_dim`), or `cfg.backbone` (a name in `backbones.BACKBONES`, or a
    timm model) + a local checkpoint."""
    from . import backbones

    with _naming_backbone_kwargs(cfg):
        registered = backbones.build(cfg.backbone, cfg.pretrained, cfg.backbone_kwargs) if net is None else None
    if registered is not None:  # a backbone named in backbones.py (it loads its own weights)
        net, feat_dim = registered, registered.num_features
    elif net is None:
        try:
            with _naming_backbone_kwargs(cfg):
                net = timm.create_model(cfg.backbone, pretrained=False, num_classes=0, **cfg.backbone_kwargs)
        except RuntimeError as err:  # timm raises RuntimeError for unknown model names
            raise ValueError(f"model.backbone={cfg.backbone!r} is not a timm model: {err}") from err
        feat_dim = net.num_features
        if cfg.pretrained:
            load_backbone_weights(net, cfg.pretrained)
    elif feat_dim is None:
        raise ValueError("a custom backbone module needs its feat_dim")
    return Backbone(net, feat_dim, cfg.grad_from_block, frozen_bf16, checkpoint_trained)


@contextlib.contextmanager
def _naming_backbone_kwargs(cfg: ModelConfig):
    """A backbone's constructor refusing model.backbone_kwargs (a TypeError deep in timm) as one line naming the key
    and the backbone."""
    try:
        yield
    except TypeError as err:
        if not cfg.backbone_kwargs:
            raise
        unknown = re.search(r"unexpected keyword argument '([^']+)'", str(err))
        if unknown:
            raise ValueError(
                f"model.backbone_kwargs.{unknown.group(1)} is not an argument of the backbone {cfg.backbone!r}: drop "
                "it, or check its name against the backbone's constructor"
            ) from err
        raise ValueError(
            f"model.backbone_kwargs {cfg.backbone_kwargs} do not fit the backbone {cfg.backbone!r} ({err}): check "
            "their values against the backbone's constructor"
        ) from err


def load_backbone_weights(net: nn.Module, path: str | Path) -> None:
    """Load a local checkpoint into a timm model, at the model's image size.

    Layouts: timm's own; the official DINOv2 one (facebookresearch/dinov2's `dinov2_vit{s,b,l}14[_reg]`: `mask_token`,
    `register_tokens`, a 518 px position embedding); the original DINO one (`teacher`/`student`, `backbone.`,
    `module.`). The checkpoint goes through timm's checkpoint filter of the model's family, as timm's own pretrained
    weights do: DINOv2 keys are mapped (registers to `reg_token`, `mask_token` dropped) and the position embedding is
    resampled to the model's patch grid. Classifier/projection `head.*` keys the model lacks are dropped; any other key
    that is missing, unexpected or of another shape is an error naming it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"model.pretrained={str(path)!r} does not exist: download the DINO ViT-B/16 backbone weights "
            "(dino_vitbase16_pretrain.pth), the DINOv2 ones (dinov2_vitb14_pretrain.pth) or a timm checkpoint to that "
            "path, or point model.pretrained at it (a relative path in a config file is resolved against the file's "
            "folder, on the command line against the working directory); nothing is downloaded at run time"
        )
    state = _unwrapped(read_pretrained(path))
    _check_layout(net, state, path)
    state = _timm_filtered(net, state, path)
    own = net.state_dict()
    # a classifier or DINO's projection head: `head.*` keys the feature extractor has no place for
    state = {key: value for key, value in state.items() if key in own or not key.startswith("head.")}
    _load_exactly(net, state, path)


def _unwrapped(checkpoint: dict) -> dict:
    """The model's tensors of a checkpoint: out of its wrapper (`teacher`, `student`, `state_dict`, `model`), without
    the `module.` / `backbone.` prefixes."""
    for wrapper in ("teacher", "student", "state_dict", "model"):
        if isinstance(checkpoint, dict) and wrapper in checkpoint and isinstance(checkpoint[wrapper], dict):
            checkpoint = checkpoint[wrapper]
            break
    state = {}
    for key, value in checkpoint.items():
        for prefix in ("module.", "backbone."):
            key = key.removeprefix(prefix)
        state[key] = value
    return state


def _check_layout(net: nn.Module, state: dict, path: Path) -> None:
    """Patch size and register tokens must agree before timm's filter runs: it would resample a 16-pixel patch
    embedding to 14 pixels without a word, and fails on a position embedding with the other number of tokens."""
    patch = state.get("patch_embed.proj.weight")
    own = getattr(getattr(getattr(net, "patch_embed", None), "proj", None), "weight", None)
    if patch is not None and own is not None and patch.ndim == own.ndim == 4 and patch.shape[-2:] != own.shape[-2:]:
        raise ValueError(
            f"checkpoint {path} has {patch.shape[-1]}-pixel patches, the backbone {own.shape[-1]}-pixel ones: pick a "
            f"model.backbone with patch{patch.shape[-1]} in its name (e.g. vit_base_patch16_224 for DINO, "
            "vit_base_patch14_dinov2 for DINOv2)"
        )
    has_registers = "register_tokens" in state or "reg_token" in state
    wants_registers = getattr(net, "reg_token", None) is not None
    if has_registers and not wants_registers:
        raise ValueError(
            f"checkpoint {path} has register tokens (a DINOv2 _reg model) and the backbone none: use a timm model with "
            "4 registers, e.g. vit_base_patch14_reg4_dinov2"
        )
    if wants_registers and not has_registers:
        raise ValueError(
            f"the backbone has register tokens and checkpoint {path} none: use the timm model without _reg4 (e.g. "
            "vit_base_patch14_dinov2)"
        )


def _timm_filtered(net: nn.Module, state: dict, path: Path) -> dict:
    """`state` converted by the checkpoint filter of `net`'s timm model family (`checkpoint_filter_fn` of its module,
    what timm applies to its own pretrained weights); unchanged for a family without one."""
    convert = getattr(sys.modules.get(type(net).__module__), "checkpoint_filter_fn", None)
    if convert is None:
        return state
    try:
        return convert(state, net)
    except RuntimeError as err:  # a tensor of the wrong size for the model (reshape, interpolate)
        raise ValueError(
            f"timm's checkpoint filter cannot convert {path} for this backbone ({err}); check model.backbone matches "
            "the checkpoint"
        ) from err


def _load_exactly(net: nn.Module, state: dict, path: Path) -> None:
    """Load `state` into `net` when it holds exactly the model's keys, each of the model's shape."""
    own = net.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    reshaped = [
        f"{key} {list(value.shape)} (model {list(own[key].shape)})"
        for key, value in state.items()
        if key in own and value.shape != own[key].shape
    ]
    found = [
        f"{what} {names[:8]}{f' and {len(names) - 8} more' if len(names) > 8 else ''}"
        for what, names in (("missing", missing), ("unexpected", unexpected), ("other shape", reshaped))
        if names
    ]
    if found:
        raise ValueError(
            f"checkpoint {path} does not match the backbone (after timm's checkpoint filter): {', '.join(found)}; "
            "check model.backbone matches the checkpoint"
        )
    net.load_state_dict(state)


# ---------------------------------------------------------------------------------------------------- projection head
class WeightNormLinear(nn.Module):
    """Bias-free weight-normed Linear with the gain frozen at 1 (keys `weight_g` [out, 1], `weight_v` [out, in])."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.weight_v = nn.Parameter(nn.Linear(in_dim, out_dim, bias=False).weight.detach().clone())
        self.weight_g = nn.Parameter(torch.ones(out_dim, 1), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        # torch's fused weight-norm op (what nn.utils.weight_norm calls): one pass over the 65536 x 256 matrix forward
        # and one backward, where the same formula in plain autograd ops takes several.
        return F.linear(x, torch._weight_norm(self.weight_v, self.weight_g, 0))


class ProjectionHead(nn.Module):
    """GCD's DINOHead: MLP to the bottleneck, L2-normalise, weight-normed last layer (docs/reference.md §2.2).
    `out_dim=None`: no last layer, the output is the MLP's (SimGCD's projection)."""

    def __init__(self, in_dim: int, hidden_dim: int, bottleneck_dim: int, out_dim: int | None, n_layers: int = 3):
        super().__init__()
        self.mlp = mlp(in_dim, hidden_dim, bottleneck_dim, n_layers - 2)
        self.mlp.apply(trunc_normal_init)
        self.last_layer = WeightNormLinear(bottleneck_dim, out_dim) if out_dim is not None else None

    def forward(self, x: Tensor) -> Tensor:
        if self.last_layer is None:
            return self.mlp(x)
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


# ----------------------------------------------------------------------------------------------------------- labeller
class Labeller(nn.Module):
    """DINOLABELLING: coder and masker MLPs to L bits, the fused code head, the categorizer (docs/reference.md §2.3)."""

    def __init__(self, in_dim: int, code_length: int, n_classes: int, hidden_dim: int = 128, n_layers: int = 2):
        super().__init__()
        self.coder = mlp(in_dim, hidden_dim, code_length, n_layers)
        self.masker = mlp(in_dim, hidden_dim, code_length, n_layers)
        self.categorizer = mlp(code_length, hidden_dim, n_classes, n_layers)
        self.apply(trunc_normal_init)
        self.register_buffer("age", torch.tensor(20.0, dtype=torch.float64))
        self.register_buffer("code_weight", kernels.positional_weights(code_length, 2.0))
        self.register_buffer("length_weight", kernels.positional_weights(code_length, 2.0))
        # A host copy of `age`, so the forward never syncs with the device to read the buffer.
        self._age = float(self.age)
        self.register_load_state_dict_post_hook(lambda module, _: setattr(module, "_age", float(module.age)))

    def set_schedule(self, age: float, base: float, length_base: float) -> None:
        n = self.code_weight.numel()
        self.age.fill_(age)
        self._age = float(age)
        self.code_weight.copy_(kernels.positional_weights(n, base))
        self.length_weight.copy_(kernels.positional_weights(n, length_base))

    def forward(self, x: Tensor, backend: str = "auto") -> tuple[Tensor, kernels.CodeHead]:
        # The [N, L] code block runs in fp32 even under autocast: tanh(age * x) for age up to 20 and the 2^k length
        # weights need it, and it costs nothing next to the 65536-wide first layers.
        code_feat = self.coder(x).float()
        head = kernels.code_head(
            code_feat, self.masker(x).float(), self._age, self.code_weight, self.length_weight, backend=backend
        )
        return code_feat, head


# -------------------------------------------------------------------------------------------------------------- model
@dataclass
class ModelOutput:
    backbone: Tensor  # [N, feat_dim] CLS features (what k-means clusters after L2 normalisation)
    projection: Tensor  # [N, proj_out_dim] L2-normalised projection (the input contrastive loss's features)
    # the labeller's outputs (None for a model built without it: a method other than InfoSieve)
    code_feat: Tensor | None  # [N, L] coder pre-activation
    head: kernels.CodeHead | None  # code_raw, mask, code, trunc_code and the code/mask/length terms
    category_logits: Tensor | None  # [N, n_old] categorizer(trunc_code)
    heads: dict[str, Tensor] = field(default_factory=dict)  # the method's own heads' outputs on `backbone`, by name


class InfoSieve(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        n_old: int,
        backbone: Backbone | None = None,
        frozen_bf16: bool = False,
        checkpoint_trained: str = "off",
        kernel_backend: str = "auto",
        labeller_grad_stop: str = "none",
        *,
        labeller: bool = True,
        projection_last_layer: bool = True,
    ):
        """`labeller` and `projection_last_layer` say what the run's method builds (`methods.Method`): without the
        labeller the forward returns no codes. `method_heads`, the method's own heads on the backbone features
        (`ModelOutput.heads`), are set by `training.trainer_setup.build_model`."""
        super().__init__()
        if backbone is None:
            backbone = build_backbone(cfg, frozen_bf16=frozen_bf16, checkpoint_trained=checkpoint_trained)
        elif frozen_bf16 or checkpoint_trained in recompute.ALWAYS_RECOMPUTING:  # "auto" keeps a custom backbone's own
            raise ValueError(
                "train.frozen_bf16 / train.checkpoint_blocks apply to the backbone built from the config; for a custom "
                "backbone pass them to Backbone(...) yourself"
            )
        self.backbone = backbone
        out_dim = cfg.proj_out_dim if projection_last_layer else None
        self.projection = ProjectionHead(
            self.backbone.feat_dim, cfg.proj_hidden_dim, cfg.proj_bottleneck_dim, out_dim, cfg.proj_layers
        )
        self.labeller = (
            Labeller(cfg.proj_out_dim, cfg.code_length, n_old, cfg.labeller_hidden_dim, cfg.labeller_layers)
            if labeller
            else None
        )
        self.method_heads = nn.ModuleDict()
        self.kernel_backend = kernel_backend  # train.kernels
        self.labeller_grad_stop = labeller_grad_stop  # loss.labeller_grad_stop

    def features(self, images: Tensor) -> Tensor:
        """L2-normalised backbone features, the input of SS-k-means."""
        return F.normalize(self.backbone(images).float(), dim=-1)

    def forward(self, images: Tensor) -> ModelOutput:
        feats = self.backbone(images)
        projection = F.normalize(self.projection(feats).float(), dim=-1)
        heads = {name: head(feats) for name, head in self.method_heads.items()}
        if self.labeller is None:
            return ModelOutput(feats, projection, None, None, None, heads)
        code_feat, head = self.labeller(self._labeller_input(feats, projection), self.kernel_backend)
        return ModelOutput(feats, projection, code_feat, head, self.labeller.categorizer(head.trunc_code), heads)

    def _labeller_input(self, feats: Tensor, projection: Tensor) -> Tensor:
        """The projection, cut from the graph where `labeller_grad_stop` says (same values in every case)."""
        if self.labeller_grad_stop == "backbone":
            return F.normalize(self.projection(feats.detach()).float(), dim=-1)
        return projection.detach() if self.labeller_grad_stop == "projection" else projection
