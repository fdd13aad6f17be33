"""What make-shards stores and the readers rely on: the image files it reads (which predict sorts too), the image
encodings, the resize rule, the PNG level recorded in the manifest, and the name of the dataset of your own images."""

from __future__ import annotations

# the image files make-shards reads and predict sorts (torchvision's IMG_EXTENSIONS), lower case
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGE_FORMATS = ("jpg", "png")  # the stored image's encoding = the sample's image key in the tar
PNG_COMPRESS_LEVEL = 1  # zlib level: much faster to write than the default 6, for a few more bytes
DISCOVERY = "discovery"  # the dataset name; make-shards' --holdout applies to it alone


def resized_size(width: int, height: int, size: int) -> tuple[int, int]:
    """torchvision's `Resize(size)` output (w, h): shorter side `size`, longer side `int(size * long / short)`."""
    if width <= height:
        return size, int(size * height / width)
    return int(size * width / height), size
