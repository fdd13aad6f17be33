"""Batched augmentation on the device: random crop, horizontal flip, optional colour jitter, normalise.

The CPU only decodes; the views are made here from uint8 batches. The reference's `ColorJitter()` has no arguments
and is the identity, so colour jitter is off by default (REFERENCE.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class AugmentConfig:
    crop_size: int = 224
    hflip: bool = True
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    color_jitter: float = 0.0  # strength s: brightness/contrast/saturation factors drawn from [1-s, 1+s]


class DeviceAugment:
    """Two-view training augmentation and the centre-crop test view, on whatever device the images are."""

    def __init__(self, cfg: AugmentConfig):
        self.cfg = cfg

    def _check(self, images: Tensor) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be a uint8 [B, C, H, W] batch, got {images.dtype} {tuple(images.shape)}")
        h, w = images.shape[-2:]
        if min(h, w) < self.cfg.crop_size:
            raise ValueError(
                f"images of {h}x{w} are smaller than crop_size={self.cfg.crop_size}: lower the crop size or store "
                "larger images"
            )
        if len(self.cfg.mean) != images.shape[1] or len(self.cfg.std) != images.shape[1]:
            raise ValueError(
                f"mean/std have {len(self.cfg.mean)} entries but the images have {images.shape[1]} channels"
            )

    def _normalise(self, x: Tensor) -> Tensor:
        mean = torch.tensor(self.cfg.mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        std = torch.tensor(self.cfg.std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        return (x - mean) / std

    def test_view(self, images: Tensor) -> Tensor:
        """Centre crop and normalise: float32 [B, C, crop, crop]."""
        self._check(images)
        c = self.cfg.crop_size
        top, left = (images.shape[-2] - c) // 2, (images.shape[-1] - c) // 2
        return self._normalise(images[..., top : top + c, left : left + c].float() / 255.0)

    def train_views(self, images: Tensor, n_views: int, generator: torch.Generator) -> Tensor:
        """`n_views` independent augmentations, view-major: float32 [n_views * B, C, crop, crop].

        `generator` must live on the images' device; random draws come only from it, so runs are reproducible. On the
        CPU the views are cut with a per-view loop (much faster there than one batched gather); both paths make the
        same random draws and give the same views.
        """
        self._check(images)
        b, _, h, w = images.shape
        c = self.cfg.crop_size
        dev = images.device
        n = n_views * b
        top = torch.randint(0, h - c + 1, (n,), generator=generator, device=dev)
        left = torch.randint(0, w - c + 1, (n,), generator=generator, device=dev)
        flip = torch.rand(n, generator=generator, device=dev) < 0.5 if self.cfg.hflip else None
        if dev.type == "cpu" and not self._gather_on_cpu:
            if self.cfg.color_jitter > 0:
                x = self._views_loop(images, n_views, top, left, flip, normalise=False)
                return self._normalise(self._jitter(x, generator))
            return self._views_loop(images, n_views, top, left, flip, normalise=True)
        src = images.repeat(n_views, 1, 1, 1)
        rows = (top[:, None] + torch.arange(c, device=dev)[None, :])[:, None, :, None]
        cols = (left[:, None] + torch.arange(c, device=dev)[None, :])[:, None, None, :]
        if flip is not None:
            cols = torch.where(flip[:, None, None, None], cols.flip(-1), cols)
        idx = torch.arange(n, device=dev)[:, None, None, None]
        chan = torch.arange(images.shape[1], device=dev)[None, :, None, None]
        x = src[idx, chan, rows, cols].float() / 255.0
        if self.cfg.color_jitter > 0:
            x = self._jitter(x, generator)
        return self._normalise(x)

    _gather_on_cpu = False  # tests switch this on to compare the two paths

    def _views_loop(
        self, images: Tensor, n_views: int, top: Tensor, left: Tensor, flip: Tensor | None, normalise: bool
    ) -> Tensor:
        """CPU path: slice each crop, convert (and normalise) it while it is in cache; float32 in [0, 1] otherwise."""
        b, ch = images.shape[:2]
        c = self.cfg.crop_size
        n = n_views * b
        out = torch.empty(n, ch, c, c, dtype=torch.float32)
        if not normalise:
            scale, shift = torch.full((ch, 1, 1), 1 / 255.0), torch.zeros(ch, 1, 1)
        else:
            std = torch.tensor(self.cfg.std, dtype=torch.float32).view(-1, 1, 1)
            mean = torch.tensor(self.cfg.mean, dtype=torch.float32).view(-1, 1, 1)
            scale, shift = 1.0 / (255.0 * std), mean / std
        tops, lefts = top.tolist(), left.tolist()
        flips = flip.tolist() if flip is not None else [False] * n
        for i in range(n):
            t, l = tops[i], lefts[i]
            view = images[i % b, :, t : t + c, l : l + c]
            o = out[i]
            o.copy_(view.flip(-1) if flips[i] else view)
            o.mul_(scale).sub_(shift)
        return out

    def _jitter(self, x: Tensor, generator: torch.Generator) -> Tensor:
        s = self.cfg.color_jitter

        def factor() -> Tensor:
            return 1.0 + (torch.rand(x.shape[0], 1, 1, 1, generator=generator, device=x.device) * 2 - 1) * s

        x = (x * factor()).clamp(0, 1)  # brightness
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        x = ((x - mean) * factor() + mean).clamp(0, 1)  # contrast
        if x.shape[1] == 3:
            grey = (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]).expand_as(x)
            x = ((x - grey) * factor() + grey).clamp(0, 1)  # saturation
        return x
