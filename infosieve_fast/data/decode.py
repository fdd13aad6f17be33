"""Stored image bytes -> uint8 images, on the CPU (libjpeg-turbo / libpng via torchvision) or batched on a GPU (nvJPEG).

Images keep their stored size (shorter side = the shards' `resize`, aspect kept, as the reference's `Resize(256)`), so
the training crops range over the whole image as the reference's `RandomCrop(224)` does. `max_aspect` optionally caps
the longer side at `max_aspect` x the shorter one (centre crop), which bounds a batch's padded canvas. A batch of
images of different sizes is padded into one canvas [B, 3, max h, max w] (top-left aligned) with their sizes beside
it; `DeviceAugment` crops each image inside its own size.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .tar import PNG_MAGIC

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29 deprecates its image codecs
    from torchvision.io import ImageReadMode, decode_jpeg, decode_png


def capped_hw(h: int, w: int, max_aspect: float | None) -> tuple[int, int]:
    """The size an image of h x w is served at: the longer side cut to `max_aspect` x the shorter one (if set)."""
    if max_aspect is None:
        return h, w
    if h > w:
        return min(h, int(max_aspect * w)), w
    return h, min(w, int(max_aspect * h))


def cap_aspect(img: Tensor, max_aspect: float | None) -> Tensor:
    """Centre crop of `img` [C, H, W] to `capped_hw` (a view; the image itself when no cap applies)."""
    h, w = img.shape[-2:]
    ch, cw = capped_hw(h, w, max_aspect)
    top, left = (h - ch) // 2, (w - cw) // 2
    return img[:, top : top + ch, left : left + cw]


def decode_cpu(data: bytes | memoryview | Tensor) -> Tensor:
    """JPEG or PNG bytes -> RGB uint8 [3, H, W] (the format is read from the bytes)."""
    buf = data if isinstance(data, Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if bytes(buf[:8].tolist()) == PNG_MAGIC:
            return decode_png(buf, mode=ImageReadMode.RGB)
        return decode_jpeg(buf, mode=ImageReadMode.RGB)


def decode_gpu(encoded: list[Tensor], device: torch.device) -> list[Tensor | None]:
    """JPEGs (CPU uint8 tensors) -> RGB uint8 [3, H, W] on `device`, in one batched nvJPEG call; None for an image
    that does not decode (found by decoding one by one after the batched call failed). PNGs go through the CPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        is_png = [bytes(e[:8].tolist()) == PNG_MAGIC for e in encoded]
        jpegs = [e for e, png in zip(encoded, is_png, strict=True) if not png]
        try:
            decoded = iter(decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device) if jpegs else [])
            out: list[Tensor | None] = [None if png else next(decoded) for png in is_png]
        except RuntimeError:
            out = [None if png else _decode_one_gpu(e, device) for e, png in zip(encoded, is_png, strict=True)]
        for i, png in enumerate(is_png):
            if png:
                try:
                    out[i] = decode_png(encoded[i], mode=ImageReadMode.RGB).to(device, non_blocking=True)
                except RuntimeError:
                    out[i] = None
    return out


def _decode_one_gpu(encoded: Tensor, device: torch.device) -> Tensor | None:
    try:
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        return None


def pad_into(images: list[Tensor], out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Images [C, h_i, w_i] -> (canvas uint8 [B, C, max h, max w], sizes long [B, 2]); the canvas is `out` when given
    (its shape must fit). Pixels outside an image's size are zero and never read by the augmentation."""
    sizes = torch.tensor([tuple(img.shape[-2:]) for img in images], dtype=torch.long).reshape(-1, 2)
    hm, wm = (int(v) for v in sizes.max(0).values) if len(images) else (0, 0)
    if out is None:
        ch, dev = (images[0].shape[0], images[0].device) if images else (3, "cpu")
        out = torch.empty(len(images), ch, hm, wm, dtype=torch.uint8, device=dev)
    uniform = bool((sizes == sizes[:1]).all())
    if not uniform:
        out.zero_()
    for i, img in enumerate(images):
        out[i, :, : img.shape[1], : img.shape[2]].copy_(img)
    return out, sizes
