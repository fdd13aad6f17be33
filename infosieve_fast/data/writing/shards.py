"""`infosieve make-shards`: a dataset in its native layout -> WebDataset tar shards + `manifest.json`.

Every image is decoded once, converted to RGB, resized so its shorter side is `resize` (bicubic with antialiasing,
the long side `int(resize * long / short)`, exactly torchvision's `Resize(256, interpolation=3)` on a PIL image) and
stored as a JPEG (`--image-format jpg`, the default: quality 95, lossy, small and fast to decode) or as a PNG
(`--image-format png`: lossless, the decoded image equals the resized source exactly; several times the bytes and
the decode time). Each sample holds `jpg` or `png`, `cls` (target, known classes first), `uq` (the sample's index
in the dataset's native train order = the reference's `uq_idx`; the test index for test samples) and `lab` (1 when
its label may be used). Your own images (`--dataset discovery`) have no test split; their unlabelled pool has `cls`
-1 (`NO_LABEL`: no label at all), and `--holdout SHARE` serves a share of the labelled images with `lab` 0.
Train samples are written in a fixed random order (`RandomState(0)`) so that every shard mixes the classes; test
samples in native order.

Robustness:
- every shard is written to a temporary `.NAME.*.tmp`, fsynced and renamed (`common/files.py`'s `atomic_write`); a
  state file records each finished shard, so a killed run resumes after the last finished shard and produces
  byte-identical shards (fixed tar metadata);
- an image that cannot be read or decoded is skipped, reported, and listed in the manifest's `skipped`;
- re-running on complete output verifies every shard's size and sha256 and does nothing; a damaged or missing shard
  is rewritten;
- an output folder holding another dataset's shards, or shards made with other settings, is refused.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ...common.shown_text import terminal_safe
from ...common.wording import counted
from ..shard_format import DISCOVERY, IMAGE_FORMATS, resized_size
from ..shard_manifest import (
    FORMAT,
    MANIFEST,
    STATE,
    ShardsError,
    atomic_json,
    build_manifest,
    check_out,
    discovery_skipped,
    resumable,
    settings_fingerprint,
    verified,
    written_counts,
)
from ..splits import check_counts
from .encode import JPEG_QUALITY, load_rgb, resize_image
from .layout_discovery import DISCOVERY_LAYOUT
from .layouts import DATASETS, LayoutError, RawDataset, canonical_name, read_dataset
from .shard_writer import Plan, ShardWriter, encoding_pool, plans

__all__ = [  # with the names other modules import from here
    "DISCOVERY",
    "IMAGE_FORMATS",
    "JPEG_QUALITY",
    "MANIFEST",
    "STATE",
    "ShardsError",
    "add_cli_arguments",
    "load_rgb",
    "main",
    "make_shards",
    "parse_class_list",
    "resize_image",
    "resized_size",
    "run_cli",
    "written_counts",
]


def make_shards(
    dataset: str,
    root: str | Path | RawDataset,
    out: str | Path,
    *,
    shard_size_mb: float = 256,
    known_classes: list[int] | None = None,
    resize: int = 256,
    workers: int = min(8, os.cpu_count() or 1),
    progress: bool = True,
    jpeg_quality: int = JPEG_QUALITY,
    image_format: str = "jpg",
    holdout: float = 0.0,
    holdout_seed: int = 0,
) -> dict:
    """Write `dataset` (native layout under `root`) as shards into `out`; returns the manifest (`manifest.json`).
    `root` may also be the dataset already read: a `RawDataset`, whose samples are any sources `load_rgb` opens.

    `image_format`: "jpg" (lossy, quality `jpeg_quality`) or "png" (lossless). `holdout` (discovery only): the share of
    each known class's labelled images held out for evaluation (`splits.holdout_mask`, seeded by `holdout_seed`)."""
    _check_numbers(shard_size_mb, resize, workers, jpeg_quality, holdout, holdout_seed)
    dataset, codec = _checked(dataset, root, known_classes, image_format, holdout), (image_format, jpeg_quality)
    out = Path(out)
    raw = root if isinstance(root, RawDataset) else read_dataset(dataset, root, known_classes)
    train, test, counts = plans(raw, holdout, holdout_seed)
    fingerprint = settings_fingerprint(raw, resize, codec, shard_size_mb, holdout, holdout_seed)
    out.mkdir(parents=True, exist_ok=True)
    prev = check_out(out, dataset, fingerprint)
    log = (lambda msg: print(f"make-shards: {terminal_safe(msg)}", file=sys.stderr)) if progress else (lambda msg: None)
    _log_split(dataset, raw, counts, log)
    done, redo = {"train": [], "test": []}, {"train": [], "test": []}
    if prev is not None and prev.get("format") == FORMAT and "splits" in prev:  # a manifest: verify, repair
        done, redo = verified(out, prev)
        if not any(redo.values()):
            log(f"{out} is complete and verified (sha256): nothing to do")
            return prev
        log(f"repairing {sum(map(len, redo.values()))} damaged or missing shard(s)")
    elif prev is not None:  # a state file: resume
        done = resumable(out, prev)
        log(f"resuming after {len(done['train'])} train + {len(done['test'])} test shard(s)")
    for tmp in out.glob("*.tmp"):
        tmp.unlink()
    state = {"dataset": dataset, "fingerprint": fingerprint, "done": done}  # `done` grows as shards are written
    save_state = functools.partial(atomic_json, out / STATE, state)
    split_plans = {"train": train, "test": test}
    with _progress_bar(progress, dataset, split_plans, done, redo) as bar, encoding_pool(workers) as pool:
        writer = ShardWriter(out, resize, codec, pool, bar)
        if any(redo.values()):
            for split, recs in redo.items():
                for rec in recs:
                    writer.rewrite(split_plans[split], rec)
        else:
            save_state()
            for split in ("train", "test"):
                writer.append(split_plans[split], dataset, done[split], int(shard_size_mb * 2**20), save_state)
    manifest = build_manifest(raw, fingerprint, counts, done, resize, codec)
    atomic_json(out / MANIFEST, manifest)
    (out / STATE).unlink(missing_ok=True)
    _log_written(out, dataset, raw, train, manifest, log)
    return manifest


def _checked(
    dataset: str, root: str | Path | RawDataset, known_classes: list[int] | None, image_format: str, holdout: float
) -> str:
    """The canonical name of `dataset`, once make-shards' options are checked against it."""
    if image_format not in IMAGE_FORMATS:
        raise ShardsError(f"image format must be one of {', '.join(IMAGE_FORMATS)}, got {image_format!r}")
    dataset = canonical_name(dataset)
    if holdout and dataset != DISCOVERY:
        raise ShardsError(f"--holdout applies to --dataset {DISCOVERY} (your own images); {dataset} has its GCD split")
    if isinstance(root, RawDataset) and known_classes is not None:
        raise ShardsError("known_classes applies to a dataset read from its folder: set the RawDataset's known classes")
    return dataset


def _check_numbers(
    shard_size_mb: float, resize: int, workers: int, jpeg_quality: int, holdout: float, holdout_seed: int
) -> None:
    """Refuse a numeric option out of its range before anything is read or written."""
    if not (math.isfinite(shard_size_mb) and shard_size_mb > 0):
        raise ShardsError(
            f"--shard-size-mb {shard_size_mb:g}: a shard's size must be above 0 MB, e.g. --shard-size-mb 256"
        )
    if resize < 1:
        raise ShardsError(f"--resize {resize}: the stored shorter side must be 1 px or more, e.g. --resize 256")
    if workers < 1:
        raise ShardsError(f"--workers {workers}: at least 1 encoding process is needed, e.g. --workers 4")
    if not 1 <= jpeg_quality <= 100:
        raise ShardsError(f"--jpeg-quality {jpeg_quality}: JPEG quality lies in 1..100, e.g. --jpeg-quality 95")
    if not 0.0 <= holdout < 1.0:
        raise ShardsError(f"--holdout {holdout}: the held-out share must lie in [0, 1), e.g. --holdout 0.1")
    if not 0 <= holdout_seed < 2**32:
        raise ShardsError(f"--holdout-seed {holdout_seed}: a seed lies in 0..2**32-1, e.g. --holdout-seed 0")


def _log_split(dataset: str, raw: RawDataset, counts: dict, log) -> None:
    """The split's counts and the layout's notes (`log`), and any departure from the reference counts (warnings)."""
    log(_describe_split(raw, counts))
    for note in raw.notes:
        log(note)
    for problem in check_counts(dataset, counts):
        print(f"make-shards: WARNING: {problem}", file=sys.stderr)


@contextmanager
def _progress_bar(show: bool, dataset: str, split_plans: dict, done: dict, redo: dict) -> Iterator[object]:
    """A progress bar over the images still to write (None when not `show`); no total while repairing."""
    if not show:
        yield None
        return
    from tqdm import tqdm

    remaining = (len(p) - sum(r["count"] for r in done[s]) for s, p in split_plans.items())
    todo = None if any(redo.values()) else sum(remaining)
    bar = tqdm(total=todo, unit="img", desc=f"make-shards {dataset}", file=sys.stderr)
    try:
        yield bar
    finally:
        bar.close()


def _log_written(out: Path, dataset: str, raw: RawDataset, train: Plan, manifest: dict, log) -> None:
    """What make-shards wrote (`log`), and warnings about the images it skipped as unreadable."""
    n_shards = sum(len(manifest["splits"][s]["shards"]) for s in ("train", "test"))
    log(
        f"wrote {out}: {n_shards} shard(s), {manifest['counts']['written_train']:,} train + "
        f"{manifest['counts']['written_test']:,} test samples, {len(manifest['skipped'])} skipped"
    )
    if manifest["skipped"]:
        where = ""
        if dataset == DISCOVERY:
            where = " (" + ", ".join(f"{n} {part}" for part, n in discovery_skipped(manifest).items() if n) + ")"
        print(
            f"make-shards: WARNING: {len(manifest['skipped'])} unreadable image(s) skipped{where}, listed in "
            f"{out / MANIFEST} under 'skipped': re-save them in a format PIL reads (JPEG, PNG) or remove them",
            file=sys.stderr,
        )
    if dataset == DISCOVERY:
        for name in _classes_left_unlabelled(raw, train, manifest["skipped"]):
            print(
                f"make-shards: WARNING: every labelled image of labelled/{terminal_safe(name)}/ is unreadable, so the "
                "class has no labelled image to anchor its cluster: replace its images or remove the folder, then run "
                "make-shards again into a new --out",
                file=sys.stderr,
            )


def _describe_split(raw: RawDataset, counts: dict) -> str:
    """The split's counts, as make-shards prints them."""
    if raw.dataset == DISCOVERY:
        return (
            f"{DISCOVERY}: {counted(len(raw.known), 'known class')}; train {counts['train']:,} = labelled "
            f"{counts['labelled']:,} + held out for evaluation {counts['held_out']:,} + unlabelled "
            f"{counts['unlabelled']:,} (no labels); no test split"
        )
    return (
        f"{raw.dataset}: {counted(len(raw.class_names), 'class')} ({len(raw.known)} known, {len(raw.novel)} novel); "
        f"train {counts['train']:,} = labelled {counts['labelled']:,} + unlabelled {counts['unlabelled']:,} "
        f"({counts['unlabelled_known']:,} known, {counts['unlabelled_novel']:,} novel); test {counts['test']:,}"
    )


def _classes_left_unlabelled(raw: RawDataset, train: Plan, skipped: list[dict]) -> list[str]:
    """The known classes all of whose labelled images were skipped as unreadable."""
    have = np.bincount(train.cls[train.lab], minlength=len(raw.class_names))
    lost = np.zeros_like(have)
    for s in skipped:
        if s["labelled"]:
            lost[raw.train_labels[s["uq"]]] += 1
    return [raw.class_names[c] for c in np.flatnonzero((have > 0) & (lost >= have))]


# ---- CLI -------------------------------------------------------------------------------------------------------


def parse_class_list(text: str) -> list[int]:
    """'0,1,2', '0 1 2' or ranges '0-49' (inclusive)."""
    out: list[int] = []
    for part in text.replace(",", " ").split():
        if "-" in part[1:]:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `infosieve make-shards`."""
    parser.add_argument("--dataset", required=True, help=f"one of: {', '.join(DATASETS)}")
    parser.add_argument(
        "--root",
        required=True,
        help=f"the raw dataset in its official layout (see docs/data.md); --dataset {DISCOVERY}: your own images, "
        f"{DISCOVERY_LAYOUT}",
    )
    parser.add_argument("--out", required=True, help="output folder for the shards and manifest.json")
    parser.add_argument("--shard-size-mb", type=float, default=256, help="target size of one tar shard (default 256)")
    parser.add_argument(
        "--known-classes",
        nargs="+",
        default=None,
        help="known class ids (native), e.g. '0-49' or '0 1 2'; needed by imagefolder/cubfiles (default: first half); "
        "overrides the reference split for the named datasets",
    )
    parser.add_argument("--resize", type=int, default=256, help="shorter side of the stored images (default 256)")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="encoding processes")
    parser.add_argument(
        "--image-format",
        choices=IMAGE_FORMATS,
        default="jpg",
        help="stored image encoding: jpg (default; lossy, quality --jpeg-quality, small, fast) or png (lossless: "
        "decodes to exactly the resized source; ~4x the bytes, slower to write and read)",
    )
    parser.add_argument("--jpeg-quality", type=int, default=JPEG_QUALITY, help="JPEG quality of the stored images")
    parser.add_argument(
        "--holdout",
        type=float,
        default=0.0,
        metavar="SHARE",
        help=f"--dataset {DISCOVERY} only: hold out this share of each known class's labelled images (trained on as "
        "unlabelled, their labels kept for evaluation; default 0: none)",
    )
    parser.add_argument("--holdout-seed", type=int, default=0, help="seed of the held-out choice (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_cli(args: argparse.Namespace) -> int:
    """Run `make-shards` from parsed arguments; returns the exit code (2 on a bad input, with a message)."""
    known = parse_class_list(" ".join(args.known_classes)) if args.known_classes else None
    t0 = time.time()
    try:
        manifest = make_shards(
            args.dataset,
            args.root,
            args.out,
            shard_size_mb=args.shard_size_mb,
            known_classes=known,
            resize=args.resize,
            workers=args.workers,
            progress=not args.no_progress,
            jpeg_quality=args.jpeg_quality,
            image_format=getattr(args, "image_format", "jpg"),
            holdout=args.holdout,
            holdout_seed=args.holdout_seed,
        )
    except (ShardsError, LayoutError) as exn:
        print(f"make-shards: error: {terminal_safe(str(exn))}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {
                "dataset": manifest["dataset"],
                "out": str(args.out),
                **written_counts(manifest),
                "n_old": manifest["n_old"],
                "n_classes": manifest["n_classes"],
                "skipped": len(manifest["skipped"]),
                "reference_check": manifest["reference_check"],
                "seconds": round(time.time() - t0, 1),
            }
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infosieve make-shards", description=__doc__.split("\n")[0])
    add_cli_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
