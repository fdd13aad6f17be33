"""Batched augmentation on the device: random crop, horizontal flip, optional colour jitter, normalise.

The CPU only decodes; the views are made here from uint8 batches. The reference's `ColorJitter()` has no arguments
and is the identity, so colour jitter is off by default (docs/reference.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .pools import BufferPool, cpu_threads

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
    """Two-view training augmentation and the centre-crop test view, on whatever device the images are.

    Normalisation is folded into one multiply-add per channel: (x / 255 - mean) / std = x * a + b with
    a = 1 / (255 std), b = -mean / std.
    """

    _gather_on_cpu = False  # tests switch this on to compare the two paths

    def __init__(self, cfg: AugmentConfig):
        self.cfg = cfg
        self._pool = BufferPool(2)  # CPU outputs (views, test views)
        self._affine: dict[tuple, tuple[Tensor, Tensor]] = {}

    def _check(self, images: Tensor, sizes: Tensor | None) -> Tensor | None:
        """Validates the batch; returns `sizes` (on the images' device), or None when every image fills the batch.

        `sizes` should come on the host (`Batch.sizes`): their minimum is read there, before they are copied to the
        device, so the host never waits for the device (reading it from a device copy would, at every batch)."""
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be a uint8 [B, C, H, W] batch, got {images.dtype} {tuple(images.shape)}")
        h, w = images.shape[-2:]
        if sizes is not None:
            host = sizes.cpu()
            h, w = (int(v) for v in host.min(0).values) if len(host) else (h, w)
            if images.is_cuda and not host.is_pinned():
                host = host.pin_memory()  # so the copy below is asynchronous (from pageable memory it may not be)
            sizes = host.to(images.device, non_blocking=True)
        if min(h, w) < self.cfg.crop_size:
            raise ValueError(
                f"an image of {h}x{w} is smaller than crop_size={self.cfg.crop_size}: lower the crop size or store "
                "larger images"
            )
        if len(self.cfg.mean) != images.shape[1] or len(self.cfg.std) != images.shape[1]:
            raise ValueError(
                f"mean/std have {len(self.cfg.mean)} entries but the images have {images.shape[1]} channels"
            )
        return sizes

    def _scale_bias(self, device: torch.device, normalise: bool) -> tuple[Tensor, Tensor]:
        """Per-channel (a, b), shape [C, 1, 1], with x_uint8 * a + b = the normalised value (or x / 255)."""
        key = (str(device), normalise)
        if key not in self._affine:
            ch = len(self.cfg.mean)
            a, b = torch.full((ch, 1, 1), 1 / 255.0, dtype=torch.float64), torch.zeros(ch, 1, 1, dtype=torch.float64)
            if normalise:
                std = torch.tensor(self.cfg.std, dtype=torch.float64).view(-1, 1, 1)
                mean = torch.tensor(self.cfg.mean, dtype=torch.float64).view(-1, 1, 1)
                a, b = a / std, -mean / std
            self._affine[key] = (a.float().to(device), b.float().to(device))
        return self._affine[key]

    def _normalise(self, x: Tensor) -> Tensor:
        mean = torch.tensor(self.cfg.mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        std = torch.tensor(self.cfg.std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        return (x - mean) / std

    def test_view(self, images: Tensor, sizes: Tensor | None = None) -> Tensor:
        """Centre crop (of each image's own size when `sizes` is given) and normalise: float32 [B, C, crop, crop]."""
        sizes = self._check(images, sizes)
        b, _, h, w = images.shape
        c = self.cfg.crop_size
        if sizes is None:
            top, left = torch.full((b,), (h - c) // 2), torch.full((b,), (w - c) // 2)
        else:
            top, left = (sizes[:, 0] - c) // 2, (sizes[:, 1] - c) // 2
        if images.device.type == "cpu":
            return self._views_loop(images, 1, top.tolist(), left.tolist(), [False] * b, normalise=True)
        if sizes is None:  # one slice of the whole batch
            a, bias = self._scale_bias(images.device, True)
            return torch.addcmul(
                bias, images[..., (h - c) // 2 : (h - c) // 2 + c, (w - c) // 2 : (w - c) // 2 + c].float(), a
            )
        return self._gather(images, b, top, left, None, normalise=True)

    def train_views(
        self, images: Tensor, n_views: int, generator: torch.Generator, sizes: Tensor | None = None
    ) -> Tensor:
        """`n_views` independent augmentations, view-major: float32 [n_views * B, C, crop, crop].

        `generator` must live on the images' device; random draws come only from it (in this order: n tops, n lefts,
        n flip coins, then the jitter factors), so runs are reproducible. With `sizes` (images of different sizes,
        padded into the batch) each crop lies inside its image: offsets are drawn uniformly as floor(u * range) from
        n uniforms instead of n integers. On the CPU the views are cut with a per-view loop over slices of the uint8
        batch, each converted and normalised while it is in cache, into a reused output buffer (`BufferPool`);
        elsewhere with one batched gather. Both paths make the same draws and give the same views.
        """
        sizes = self._check(images, sizes)
        b, _, h, w = images.shape
        c = self.cfg.crop_size
        dev = images.device
        n = n_views * b
        if sizes is None:
            top = torch.randint(0, h - c + 1, (n,), generator=generator, device=dev)
            left = torch.randint(0, w - c + 1, (n,), generator=generator, device=dev)
        else:
            span = (sizes - c + 1).repeat(n_views, 1)
            top = (torch.rand(n, generator=generator, device=dev) * span[:, 0]).long().clamp_max_(span[:, 0] - 1)
            left = (torch.rand(n, generator=generator, device=dev) * span[:, 1]).long().clamp_max_(span[:, 1] - 1)
        flip = torch.rand(n, generator=generator, device=dev) < 0.5 if self.cfg.hflip else None
        jitter = self.cfg.color_jitter > 0
        if dev.type == "cpu" and not self._gather_on_cpu:
            flips = flip.tolist() if flip is not None else [False] * n
            x = self._views_loop(images, n_views, top.tolist(), left.tolist(), flips, normalise=not jitter)
        else:
            x = self._gather(images, n, top, left, flip, normalise=not jitter)
        return self._normalise(self._jitter(x, generator)) if jitter else x

    def _gather(self, images: Tensor, n: int, top: Tensor, left: Tensor, flip: Tensor | None, normalise: bool):
        """View i = crop (top[i], left[i]) of image i % B, flipped where `flip`: one uint8 gather, one fused pass."""
        b, c, dev = images.shape[0], self.cfg.crop_size, images.device
        idx = (torch.arange(n, device=dev) % b)[:, None, None, None]
        rows = (top[:, None] + torch.arange(c, device=dev)[None, :])[:, None, :, None]
        cols = (left[:, None] + torch.arange(c, device=dev)[None, :])[:, None, None, :]
        if flip is not None:
            cols = torch.where(flip[:, None, None, None], cols.flip(-1), cols)
        chan = torch.arange(images.shape[1], device=dev)[None, :, None, None]
        a, bias = self._scale_bias(dev, normalise)
        return torch.addcmul(bias, images[idx, chan, rows, cols].float(), a)

    def _views_loop(
        self, images: Tensor, n_views: int, tops: list[int], lefts: list[int], flips: list[bool], normalise: bool
    ) -> Tensor:
        """CPU path: view i = crop (tops[i], lefts[i]) of image i % B, flipped if flips[i]; each crop is a slice of
        the uint8 batch, converted into its row of the output and scaled in place while in cache (normalised, or
        float32 in [0, 1]). With `torch.get_num_threads()` = k > 1 the views are split over k threads."""
        b, ch = images.shape[:2]
        c = self.cfg.crop_size
        n = n_views * b
        out = self._pool.get((n, ch, c, c), torch.float32)
        a, bias = self._scale_bias(images.device, normalise)

        rows = out.unbind(0)
        s0, s1, s2, s3 = images.stride()
        base = images.storage_offset()

        def fill(lo: int, hi: int) -> None:
            for i in range(lo, hi):  # view = images[i % b, :, t : t + c, l : l + c], in one call
                view = images.as_strided((ch, c, c), (s1, s2, s3), base + (i % b) * s0 + tops[i] * s2 + lefts[i] * s3)
                o = rows[i]
                o.copy_(view.flip(-1) if flips[i] else view)
                o.mul_(a).add_(bias)

        k = min(torch.get_num_threads(), n // 8)
        threads = cpu_threads(k) if k > 1 else None
        if threads is not None:
            bounds = [n * j // k for j in range(k + 1)]
            for f in [threads.submit(fill, lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]:
                f.result()
        else:
            fill(0, n)
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
