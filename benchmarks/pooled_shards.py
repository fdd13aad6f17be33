"""Synthetic JPEG shards fast enough to write inside a GPU check: synthetic_shards' "natural" images, from a pool.

synthetic_shards' `natural_image` (1/f texture, ellipses, noise; ~50 KB as a quality-95 JPEG at 256) costs ~25 ms of
CPU per image, so 34k images take about a minute even on 16 cores. Here each image is a crop of one of `POOL` such
textures (made once per writing process), at its own aspect (long side 1-1.5 x the shorter, half of them portrait),
flipped at random and tinted per channel: every image's bytes differ, the JPEG statistics are the pool's, and an
image costs a few ms. The shards are written by make-shards itself (`synthetic_shards.write_synthetic_shards`: its
split, tar format, manifest, reuse and verification), in parallel processes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from benchmarks.synthetic_shards import SyntheticImage, natural_image, write_synthetic_shards

KIND = "pooled-v1"  # names the generator in the shards' manifest: change it when the images change
POOL = 64


@functools.lru_cache(maxsize=POOL)
def _texture(k: int, size: int, seed: int) -> np.ndarray:
    """Pool texture k: a natural image beside its mirror image (at least 2 x size wide, so every crop fits)."""
    img = natural_image(k, size, seed)
    return np.concatenate([img, img[:, ::-1]], axis=1)


def pooled_natural_image(index: int, size: int, seed: int) -> np.ndarray:
    """Image `index`: shorter side `size`, a crop of a pool texture at a random aspect, maybe flipped, tinted, and
    transposed to portrait for about half of the images."""
    rng = np.random.default_rng([seed, 2, index])
    base = _texture(int(rng.integers(POOL)), size, seed)
    w = int(rng.integers(size, size * 3 // 2 + 1))
    left = int(rng.integers(0, base.shape[1] - w + 1))
    img = base[:, left : left + w]
    if rng.random() < 0.5:
        img = img[:, ::-1]
    lut = np.arange(256)[:, None] * rng.uniform(0.8, 1.2, 3) + rng.uniform(-20, 20, 3)  # [level, channel]
    lut = np.clip(lut, 0, 255).astype(np.uint8)
    img = np.stack([lut[img[..., c], c] for c in range(3)], -1)
    return np.ascontiguousarray(img.transpose(1, 0, 2)) if rng.random() < 0.5 else img


class PooledImage(SyntheticImage):
    """A make-shards source whose pixels are `pooled_natural_image` (generated in the encoding worker)."""

    def pixels(self) -> np.ndarray:
        return pooled_natural_image(self.index, self.size, self.seed)


def write_pooled_shards(out: Path, *, n: int, n_classes: int, size: int, workers: int, seed: int = 0) -> dict:
    """Write (or verify and reuse) `n` pooled images of `n_classes` classes as make-shards output in `out`; returns
    synthetic_shards' description of the shards."""
    return write_synthetic_shards(
        out,
        kind=KIND,
        n=n,
        n_classes=n_classes,
        size=size,
        seed=seed,
        shard_size_mb=64,
        workers=workers,
        image=PooledImage,
    )
