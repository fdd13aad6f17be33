"""A sample's image -> the bytes make-shards stores: RGB, shorter side `resize` (torchvision's `Resize`), JPEG or a
lossless PNG. Runs in make-shards' worker processes (`encode_job`)."""

from __future__ import annotations

import io
import os
import stat
import struct
import zlib

import numpy as np

from ...common.limits import open_image
from ..shard_format import IMAGE_FORMATS, PNG_COMPRESS_LEVEL, resized_size

JPEG_QUALITY = 95


def load_rgb(source) -> Image.Image:  # noqa: F821
    """A sample's image, fully decoded, as RGB. `source` is a path, an object PIL opens or an HxWx3 uint8 array."""
    from PIL import Image

    if isinstance(source, np.ndarray):
        return Image.fromarray(source, "RGB")
    if isinstance(source, (str, os.PathLike)):  # a file (other sources are objects PIL reads)
        refuse_special_file(source)
    with open_image(source) as im:
        im.load()
        return im.convert("RGB")


def refuse_special_file(path) -> None:
    """A FIFO, socket or device among the images is refused before it is opened: reading a FIFO waits for a writer
    that may never come."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device or special file"
        raise ValueError(f"{path} is {kind}, not a regular file")


def resize_image(im: Image.Image, size: int) -> Image.Image:  # noqa: F821
    from PIL import Image

    target = resized_size(im.width, im.height, size)
    return im if target == im.size else im.resize(target, Image.BICUBIC)


def encode_image(source, size: int, quality: int = JPEG_QUALITY, image_format: str = "jpg") -> bytes:
    """The stored bytes of one sample: RGB, shorter side `size`, JPEG (`quality`) or lossless PNG."""
    return encode_pil(load_rgb(source), size, quality, image_format)


def encode_pil(rgb: Image.Image, size: int, quality: int = JPEG_QUALITY, image_format: str = "jpg") -> bytes:  # noqa: F821
    """`encode_image` of an RGB image already decoded."""
    im = resize_image(rgb, size)
    if image_format == "png":
        return png_bytes(np.asarray(im))
    if image_format != "jpg":
        raise ValueError(f"image format must be one of {IMAGE_FORMATS}, got {image_format!r}")
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bytes(rgb: np.ndarray, level: int | None = None) -> bytes:
    """A standard 8-bit RGB PNG of an H x W x 3 uint8 array (lossless), written directly: filter "Up" on every row
    (vectorised; the row above the first counts as zeros, as the PNG spec says) and one zlib stream. Faster than
    PIL's encoder at the same level (which tries every filter on every row) for about the same size."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"png_bytes needs an H x W x 3 uint8 array, got {rgb.dtype} {rgb.shape}")
    h, w, _ = rgb.shape
    rows = np.ascontiguousarray(rgb).reshape(h, w * 3)
    raw = np.empty((h, w * 3 + 1), np.uint8)
    raw[:, 0] = 2  # filter type Up
    np.subtract(rows[1:], rows[:-1], out=raw[1:, 1:])  # uint8 arithmetic: modulo 256, as the filter is defined
    raw[0, 1:] = rows[0]
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8 bit, truecolour, deflate, filtered rows, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(raw.tobytes(), PNG_COMPRESS_LEVEL if level is None else level))
        + _png_chunk(b"IEND", b"")
    )


def encode_job(job: tuple) -> tuple[int, bytes | None, str | None]:
    """(pos, stored bytes or None, the error) of one (pos, source, size, quality, image format) job."""
    pos, source, size, quality, image_format = job
    try:
        return pos, encode_image(source, size, quality, image_format), None
    except Exception as exn:  # any unreadable/corrupt image is skipped and reported, never fatal
        return pos, None, f"{type(exn).__name__}: {exn}"
