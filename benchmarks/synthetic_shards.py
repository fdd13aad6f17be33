"""Synthetic images written as make-shards output, for the benchmarks that need shards without a dataset.

Two kinds of image, each generated from (index, label, size, seed) alone:
- "class" (`class_image`): a flat colour from a palette + stripes of a class-specific orientation and frequency +
  noise; its mean colour names its class, so a reader can check that pixels and labels stay together;
- "natural" (`natural_image`): 1/f-spectrum texture, flat-coloured ellipses, sensor noise; about 50 KB as a
  quality-95 JPEG at shorter side 256, close to ImageNet images resized to 256.

`write_synthetic_shards` writes `n` of them with `make_shards` itself (its split, tar format, manifest, resume and
sha256 verification): the images are generated lazily in its encoding workers (`SyntheticImage`), so the set never
sits in memory, and a complete folder is verified and reused. The GCD split is make-shards' own: the first half of
the classes known, half of their images labelled.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.harness import timed
from infosieve_fast.data.writing import shards as shards_mod
from infosieve_fast.data.writing.layouts import RawDataset

GENERATOR_VERSION = 1  # bump when the synthetic images change: the cache folders are named by it
DATASET = "imagefolder"  # make-shards' generic layout name: no reference counts to compare against
# the cache folder and manifest note the existing caches were written with (by the scale rehearsal these scripts
# came from): renaming either would make every cached folder fail its check or be written again
CACHE_DIR = Path(tempfile.gettempdir()) / "infosieve-bench-scale"
_NOTE_PREFIX = "bench_scale synthetic"


def palette(n_classes: int, seed: int = 0) -> np.ndarray:
    """[n_classes, 3] distinct colours on a grid over [40, 200] (spacing >= 17 per channel for <= 1,000 classes)."""
    levels = max(2, math.ceil(n_classes ** (1 / 3)))
    grid = np.linspace(40, 200, levels)
    cube = np.stack(np.meshgrid(grid, grid, grid, indexing="ij"), -1).reshape(-1, 3)
    return cube[np.random.RandomState(seed).permutation(len(cube))[:n_classes]].astype(np.float32)


def class_image(index: int, label: int, colours: np.ndarray, size: int, seed: int) -> np.ndarray:
    """size x size x 3 uint8: the class colour + class stripes (orientation, frequency) + per-image phase, brightness
    and pixel noise. Its mean colour stays within a few levels of the class colour."""
    rng = np.random.default_rng([seed, 0, index])
    theta = label * 2.399963  # golden angle: neighbouring classes far apart in orientation
    freq = 2 + label % 5
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    stripes = 30 * np.sin(2 * np.pi * freq * (xx * np.cos(theta) + yy * np.sin(theta)) + rng.uniform(0, 2 * np.pi))
    img = colours[label] + rng.uniform(-6, 6) + stripes[..., None] + rng.normal(0, 8, (size, size, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def natural_image(index: int, size: int, seed: int) -> np.ndarray:
    """A "natural-ish" image, shorter side `size`, long side size..1.5 size: 1/f-spectrum texture (luminance plus
    some per-channel colour), a few flat-coloured ellipses with sharp edges, sensor noise. About 50 KB as a
    quality-95 JPEG at 256, close to ImageNet images resized to 256."""
    rng = np.random.default_rng([seed, 1, index])
    h, w = size, int(rng.integers(size, size * 3 // 2 + 1))
    f = np.sqrt(np.fft.fftfreq(h)[:, None] ** 2 + np.fft.rfftfreq(w)[None, :] ** 2)
    f[0, 0] = 1.0
    amp = 1.0 / f
    amp[0, 0] = 0.0
    chans = []
    for _ in range(3):
        spec = amp * np.exp(2j * np.pi * rng.random(amp.shape)) * rng.standard_normal(amp.shape)
        c = np.fft.irfft2(spec, s=(h, w))
        chans.append(c / c.std())
    base, mix = rng.uniform(60, 190, 3), rng.uniform(0.6, 1.0, 3)
    img = np.stack([base[c] + 45 * (mix[c] * chans[0] + (1 - mix[c]) * chans[c]) for c in range(3)], -1)
    yy, xx = np.mgrid[0:h, 0:w]
    for _ in range(int(rng.integers(2, 6))):
        cy, cx, ry, rx = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(15, h / 2), rng.uniform(15, w / 2)
        mask = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1
        img[mask] = img[mask] * 0.4 + rng.uniform(0, 255, 3) * 0.6
    img += rng.normal(0, 3, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


class SyntheticImage:
    """One synthetic image as a make-shards source: a file-like object (PIL reads it as a binary PPM) whose pixels are
    generated on first read. Only (kind, index, label, ...) is pickled, so make-shards' encoding workers generate the
    images in parallel and the full set never sits in memory."""

    def __init__(self, kind: str, index: int, label: int, size: int, seed: int, n_classes: int):
        self.kind, self.index, self.label = kind, index, label
        self.size, self.seed, self.n_classes = size, seed, n_classes
        self._buf: io.BytesIO | None = None

    def pixels(self) -> np.ndarray:
        if self.kind == "class":
            return class_image(self.index, self.label, palette(self.n_classes, self.seed), self.size, self.seed)
        return natural_image(self.index, self.size, self.seed)

    def _file(self) -> io.BytesIO:
        if self._buf is None:
            a = self.pixels()
            self._buf = io.BytesIO(b"P6 %d %d 255\n" % (a.shape[1], a.shape[0]) + a.tobytes())
        return self._buf

    def read(self, n: int = -1) -> bytes:
        return self._file().read(n)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._file().seek(pos, whence)

    def tell(self) -> int:
        return self._file().tell()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_buf"} | {"_buf": None}


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every script that writes synthetic shards: where they are cached, how many processes encode."""
    parser.add_argument(
        "--shards-dir",
        default=str(CACHE_DIR),
        help="cache of the generated shards (one sub-folder per setting; reused when complete)",
    )
    parser.add_argument("--write-workers", type=int, default=os.cpu_count() or 2, help="make-shards encoding processes")


def cached_synthetic_shards(args: argparse.Namespace, name: str, **setting) -> tuple[Path, dict]:
    """`write_synthetic_shards` of `setting` into `<--shards-dir>/<name>-v<GENERATOR_VERSION>` (`name` spells out the
    setting, so each has its own folder) with `--write-workers`; returns the folder and its record."""
    folder = Path(args.shards_dir) / f"{name}-v{GENERATOR_VERSION}"
    shards = write_synthetic_shards(folder, workers=args.write_workers, **setting)
    done = "reused" if shards["reused"] else "written"
    print(
        f"shards: {folder}: {shards['n_shards']} shards, {shards['mb']} MiB, {done} in {shards['seconds']} s",
        file=sys.stderr,
        flush=True,
    )
    return folder, shards


def _signature(kind: str, n: int, n_classes: int, size: int, seed: int) -> str:
    return f"{_NOTE_PREFIX} v{GENERATOR_VERSION}: kind={kind} n={n} classes={n_classes} size={size} seed={seed}"


def _check_counts(out: Path, manifest: dict, labels: np.ndarray, n_classes: int) -> None:
    """Raise unless make-shards wrote every image, with the labelled half of the known classes' images."""
    n, c = len(labels), manifest["counts"]
    want_labelled = int(0.5 * int(np.sum(labels < n_classes // 2)))
    problems = [
        f"{k} = {c.get(k)}, expected {v}"
        for k, v in {"train": n, "written_train": n, "skipped_train": 0, "labelled": want_labelled}.items()
        if c.get(k) != v
    ]
    if problems or manifest["n_classes"] != n_classes or manifest["n_old"] != n_classes // 2:
        raise RuntimeError(f"{out}: the shards do not hold what was asked: {problems or manifest['classes']}")


def _raw_dataset(out: Path, sources: list, labels: np.ndarray, n_classes: int, note: str) -> RawDataset:
    """The synthetic set as make-shards' input, in place of a folder: the first half of the classes known."""
    return RawDataset(
        DATASET,
        out,
        [f"synthetic{c:04d}" for c in range(n_classes)],
        list(range(n_classes // 2)),
        list(range(n_classes // 2, n_classes)),
        sources,
        labels,
        [f"synthetic[{i}]" for i in range(len(labels))],
        notes=[note],
    )


def write_synthetic_shards(
    out: Path,
    *,
    kind: str,
    n: int,
    n_classes: int,
    size: int,
    seed: int,
    shard_size_mb: float,
    workers: int,
    image: type = SyntheticImage,
) -> dict:
    """Write (or verify and reuse) `n` synthetic images (`image` objects, generated in make-shards' encoding workers)
    as make-shards output in `out`; returns a description of the shards (`mb`: MiB). make_shards takes the synthetic
    `RawDataset` in place of a folder; everything else (split, write order, tar format, manifest, resume, sha256
    verification of a complete folder) is its own."""
    sig = _signature(kind, n, n_classes, size, seed)
    manifest_path = out / shards_mod.MANIFEST
    reused = manifest_path.is_file()
    if reused and sig not in json.loads(manifest_path.read_text()).get("notes", []):
        raise RuntimeError(f"{out} holds other shards than '{sig}': delete it or choose another --shards-dir")
    labels = np.arange(n, dtype=np.int64) % n_classes
    sources = [image(kind, i, int(labels[i]), size, seed, n_classes) for i in range(n)]
    raw = _raw_dataset(out, sources, labels, n_classes, sig)
    with timed() as clock:  # workers >= 2: the encoding runs in a process pool, no generated pixels stay here
        manifest = shards_mod.make_shards(
            DATASET, raw, out, shard_size_mb=shard_size_mb, resize=size, workers=max(2, workers), progress=False
        )
    seconds = clock.seconds
    _check_counts(out, manifest, labels, n_classes)
    recs = manifest["splits"]["train"]["shards"]
    return {
        "dir": str(out),
        "reused": reused,
        "seconds": round(seconds, 1),
        "n_train": n,
        "n_labelled": manifest["counts"]["labelled"],
        "n_old": manifest["n_old"],
        "n_classes": n_classes,
        "stored_side": size,
        "n_shards": len(recs),
        "mb": round(sum(r["bytes"] for r in recs) / 2**20, 1),
        "mean_kb_per_image": round(sum(r["bytes"] for r in recs) / n / 1024, 1),
        "image": manifest["image"],
    }
