"""Stored image bytes -> uint8 images, on the CPU (libjpeg-turbo / libpng via torchvision) or batched on a GPU (nvJPEG).

Images keep their stored size (shorter side = the shards' `resize`, aspect kept, as the reference's `Resize(256)`), so
the training crops range over the whole image as the reference's `RandomCrop(224)` does. `max_aspect` optionally caps
the longer side at `max_aspect` x the shorter one (centre crop), which bounds a batch's padded canvas. A batch of
images of different sizes is padded into one canvas [B, 3, max h, max w] (top-left aligned) with their sizes beside
it; `DeviceAugment` crops each image inside its own size.

A batch whose nvJPEG call fails (nvJPEG missing or broken on the machine, or one image it cannot decode: the batched
call then fails as a whole) is decoded on the CPU instead; only an image the CPU cannot decode either is lost.
`DecodeCounts` keeps how many images each path decoded; `DecodeWindow` reports them per epoch record. An image stored
at another size than the one served (`load_hw`) is resized after decoding (`resize_uint8`).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ...common.limits import check_image_pixels
from ..shard_format import resized_size
from .tar import PNG_MAGIC, image_hw

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


def load_hw(h: int, w: int, size: int) -> tuple[int, int]:
    """The (h, w) a stored h x w image is served at: as stored when its shorter side is `size` (make-shards wrote it
    so), else resized as make-shards resizes (torchvision's `Resize(size)`)."""
    if min(h, w) == size:
        return h, w
    new_w, new_h = resized_size(w, h, size)
    return new_h, new_w


def _per_size(hw: np.ndarray, size_of) -> np.ndarray:
    """`size_of(h, w)` of every row of `hw` [N, 2], computed once per distinct size (a reopened index of a million
    samples holds far fewer sizes)."""
    sizes, inverse = np.unique(hw.reshape(-1, 2), axis=0, return_inverse=True)
    mapped = np.asarray([size_of(int(h), int(w)) for h, w in sizes], np.int64).reshape(-1, 2)
    return mapped[inverse.reshape(-1)]


def served_sizes(stored_hw: np.ndarray, size: int, max_aspect: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `stored_hw` [N, 2]: the size the image is loaded at (`load_hw`), and the size it is served at after
    the aspect cap (`capped_hw`)."""
    loaded = _per_size(stored_hw, lambda h, w: load_hw(h, w, size))
    return loaded, _per_size(loaded, lambda h, w: capped_hw(h, w, max_aspect))


def resize_uint8(img: Tensor, hw: tuple[int, int]) -> Tensor:
    """uint8 [C, H, W] -> [C, *hw] (bicubic, antialiased), on the image's device; the image itself at that size."""
    if tuple(img.shape[-2:]) == tuple(hw):
        return img
    out = torch.nn.functional.interpolate(img[None].float(), size=tuple(hw), mode="bicubic", antialias=True)
    return out[0].round_().clamp_(0, 255).to(torch.uint8)


def _is_png(encoded: Tensor) -> bool:
    return bytes(encoded[:8].tolist()) == PNG_MAGIC


def as_buffer(data: bytes | memoryview | Tensor) -> Tensor:
    """Encoded image bytes as a CPU uint8 tensor, its size checked (`check_header_size`)."""
    buf = data if isinstance(data, Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)
    check_header_size(buf)
    return buf


def check_header_size(encoded: Tensor) -> None:
    """`limits.ImageTooLarge` when the image's header claims more pixels than any decoder may allocate; ValueError
    when it has no header to read the size from. Runs before every decode: the header is a few bytes, the decoded
    image of a forged one gigabytes."""
    check_image_pixels(*image_hw(memoryview(encoded.numpy())))


def decode_cpu(data: bytes | memoryview | Tensor) -> Tensor:
    """JPEG or PNG bytes -> RGB uint8 [3, H, W] (the format is read from the bytes). A 16-bit PNG (another tool's
    shard) keeps its high byte, as torchvision's `convert_image_dtype` does: torchvision decodes it to uint16, which a
    uint8 batch would otherwise wrap."""
    buf = as_buffer(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if _is_png(buf):
            img = decode_png(buf, mode=ImageReadMode.RGB)
            return (img.to(torch.int32) >> 8).to(torch.uint8) if img.dtype == torch.uint16 else img
        return decode_jpeg(buf, mode=ImageReadMode.RGB)


@dataclass
class DecodeCounts:
    """Running totals of the images decoded, by where (one addition per batch: cheap enough to always keep). A
    benchmark reads them before and after an epoch; a pass served from a decoded cache adds nothing."""

    cpu: int = 0  # decoded on the CPU (DataLoader workers, PNGs, nvJPEG fallbacks)
    gpu: int = 0  # decoded by nvJPEG
    gpu_fallback: int = 0  # JPEGs nvJPEG failed on, handed to the CPU (those that decoded there are in `cpu` too)
    gpu_error: str | None = None  # the first nvJPEG failure, "Type: message"

    def as_dict(self) -> dict[str, int]:
        return {"cpu": self.cpu, "gpu": self.gpu, "gpu_fallback": self.gpu_fallback}

    def since(self, before: DecodeCounts) -> DecodeCounts:
        """The images decoded after `before` (an earlier copy of these counts); the first nvJPEG error when nvJPEG
        failed in between."""
        fallback = self.gpu_fallback - before.gpu_fallback
        error = self.gpu_error if fallback else None
        return DecodeCounts(self.cpu - before.cpu, self.gpu - before.gpu, fallback, error)


class DecodeWindow:
    """The images a source decodes from one epoch record to the next, by decoder (`fields`), so that a GPU decode
    which fell back to the CPU shows in the record instead of passing for a slow loader. A source without
    `decode_counts` (an in-memory set) decodes nothing."""

    def __init__(self, source):
        self.source = source
        self._counts: DecodeCounts | None = getattr(source, "decode_counts", None)
        self._before = dataclasses.replace(self._counts) if self._counts is not None else DecodeCounts()

    def fields(self) -> dict:
        """`decoded_cpu`, `decoded_gpu`, `decoded_gpu_fallback` since the previous call (the first: since this window
        was made) and `decode_cpu_reason` (the source's one line on why the CPU decoded where a GPU decode was asked
        for; None when it decoded nothing or was asked to); the next window starts here."""
        if self._counts is None:
            window, reason = DecodeCounts(), None
        else:
            window = self._counts.since(self._before)
            self._before = dataclasses.replace(self._counts)
            reason = self.source.cpu_decode_reason(window) if window.cpu else None
        return {
            "decoded_cpu": window.cpu,
            "decoded_gpu": window.gpu,
            "decoded_gpu_fallback": window.gpu_fallback,
            "decode_cpu_reason": reason,
        }


def nvjpeg_decode(jpegs: list[Tensor], device: torch.device) -> list[Tensor]:
    """JPEGs (CPU uint8 tensors) -> RGB uint8 [3, H, W] on `device` in one batched nvJPEG call (torchvision). Raises
    when nvJPEG is missing or broken, or when any one image does not decode: the call fails as a whole."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device)


def decode_gpu(encoded: list[Tensor], device: torch.device, counts: DecodeCounts) -> list[Tensor | None]:
    """JPEGs and PNGs (CPU uint8 tensors) -> RGB uint8 [3, H, W] on `device`: the JPEGs in one batched nvJPEG call,
    the PNGs on the CPU. When the nvJPEG call fails, its JPEGs are decoded on the CPU instead and moved to `device`
    (counted in `counts.gpu_fallback`, the first error kept in `counts.gpu_error`); None only for an image that the
    CPU cannot decode either."""
    png = [_is_png(e) or not _fits(e) for e in encoded]  # an image too large is refused by the CPU decoder
    jpeg_at = [i for i, p in enumerate(png) if not p]
    on_cpu = [i for i, p in enumerate(png) if p]
    out: list[Tensor | None] = [None] * len(encoded)
    if jpeg_at:
        try:
            for i, img in zip(jpeg_at, nvjpeg_decode([encoded[i] for i in jpeg_at], device), strict=True):
                out[i] = img
            counts.gpu += len(jpeg_at)
        except Exception as exn:  # whatever nvJPEG raises (no CUDA kernel, a bad image, ...), the CPU gets the images
            counts.gpu_fallback += len(jpeg_at)
            counts.gpu_error = counts.gpu_error or f"{type(exn).__name__}: {exn}"
            on_cpu += jpeg_at
    for i in on_cpu:
        img = _decode_cpu_or_none(encoded[i])
        if img is not None:
            out[i] = img.to(device, non_blocking=True)
            counts.cpu += 1
    return out


def _fits(encoded: Tensor) -> bool:
    try:
        check_header_size(encoded)
        return True
    except ValueError:
        return False


def _decode_cpu_or_none(encoded: Tensor) -> Tensor | None:
    try:
        return decode_cpu(encoded)
    except Exception:  # any decoder error: the caller counts the image unreadable
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
