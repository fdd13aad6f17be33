"""The sizes an input may ask for before anything is allocated for it: a few bytes of a file (an image header, a
label) must not make the program allocate gigabytes.

- `MAX_IMAGE_PIXELS`: every decoder (make-shards' PIL, the shards' torchvision and nvJPEG, predict) reads the image's
  size from its header and refuses one above this before decoding it. PIL's own default, so the folder route, which
  PIL guarded already, keeps its limit and the shard and predict routes get the same one.
- `MAX_CLASSES`: the most classes a label may imply (a class id is at most `MAX_CLASSES - 1`), and the most clusters.
- `MAX_SEED`: seeds are what NumPy's and PyTorch's generators take, 0..2**32-1.
"""

from __future__ import annotations

MAX_IMAGE_PIXELS = 89_478_485  # PIL.Image.MAX_IMAGE_PIXELS: 0.25 GiB of RGB pixels
MAX_CLASSES = 1_000_000  # 45x ImageNet-21k's 21,841 classes
MAX_SEED = 2**32 - 1


class ImageTooLarge(ValueError):
    """An image whose header claims more pixels than `MAX_IMAGE_PIXELS`."""


def check_image_pixels(h: int, w: int) -> None:
    """Refuse an h x w image above `MAX_IMAGE_PIXELS`, before it is decoded."""
    if h * w > MAX_IMAGE_PIXELS:
        raise ImageTooLarge(
            f"image of {w:,} x {h:,} = {h * w:,} pixels is above the limit of {MAX_IMAGE_PIXELS:,} pixels (a "
            "decompression bomb, or a picture to shrink before use): not decoded"
        )


def open_image(source):
    """A PIL image opened at `source` (a path or a file), its size checked against `MAX_IMAGE_PIXELS` before any
    pixel is decoded (PIL decodes lazily; its own check only warns below twice its limit)."""
    from PIL import Image

    im = Image.open(source)
    try:
        check_image_pixels(im.height, im.width)
    except ImageTooLarge:
        im.close()
        raise
    return im
