"""`infosieve make-shards`: a dataset in its native layout -> WebDataset tar shards + `manifest.json`.

Every image is decoded once, converted to RGB, resized so its shorter side is `resize` (bicubic with antialiasing,
the long side `int(resize * long / short)`, exactly torchvision's `Resize(256, interpolation=3)` on a PIL image) and
stored as a JPEG (`--image-format jpg`, the default: quality 95, lossy, small and fast to decode) or as a PNG
(`--image-format png`: lossless, the decoded image equals the resized source exactly; about 4x the bytes and 5x the
decode time). Each sample holds `jpg` or `png`, `cls` (target, known classes first), `uq` (the sample's index
in the dataset's native train order = the reference's `uq_idx`; the test index for test samples) and `lab` (1 when
its label may be used). Your own images (`--dataset discovery`) have no test split; their unlabelled pool has `cls`
-1 (`metrics.NO_LABEL`: no label at all), and `--holdout SHARE` serves a share of the labelled images with `lab` 0.
Train samples are written in a fixed random order (`RandomState(0)`) so that every shard mixes the classes; test
samples in native order.

Robustness:
- every shard is written to a temporary `.NAME.*.tmp`, fsynced and renamed (`checkpoint.atomic_write`); a state file
  records each finished shard, so a killed run resumes after the last finished shard and produces byte-identical
  shards (fixed tar metadata);
- an image that cannot be read or decoded is skipped, reported, and listed in the manifest's `skipped`;
- re-running on complete output verifies every shard's size and sha256 and does nothing; a damaged or missing shard
  is rewritten;
- an output folder holding another dataset's shards, or shards made with other settings, is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import struct
import sys
import tarfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..checkpoint import atomic_write
from .layouts import DATASETS, RawDataset, canonical_name, read_dataset
from .splits import check_counts, discovery_counts, discovery_split, gcd_split, split_counts

FORMAT = "infosieve-shards/1"
JPEG_QUALITY = 95
IMAGE_FORMATS = ("jpg", "png")  # the stored image's encoding = the sample's image key in the tar
PNG_COMPRESS_LEVEL = 1  # zlib level: 1 is ~3x faster to write than 6 for ~10% more bytes
MANIFEST = "manifest.json"
STATE = ".make-shards-state.json"
ORDER_SEED = 0  # the fixed shuffle of the train write order
PROP, SPLIT_SEED = 0.5, 0  # REFERENCE.md §7: half of the known-class images labelled, RandomState(0)
DISCOVERY = "discovery"  # your own images: labelled/<class>/ + unlabelled/ (layouts.py); --holdout applies to it


class ShardsError(RuntimeError):
    """The output folder cannot be used (another dataset, other settings)."""


# ---- image processing (runs in worker processes) ---------------------------------------------------------------


def resized_size(width: int, height: int, size: int) -> tuple[int, int]:
    """torchvision's `Resize(size)` output (w, h): shorter side `size`, longer side `int(size * long / short)`."""
    if width <= height:
        return size, int(size * height / width)
    return int(size * width / height), size


def load_rgb(source) -> Image.Image:  # noqa: F821
    """A sample's image, fully decoded, as RGB. `source` is a path or an HxWx3 uint8 array."""
    from PIL import Image

    if isinstance(source, np.ndarray):
        return Image.fromarray(source, "RGB")
    with Image.open(source) as im:
        im.load()
        return im.convert("RGB")


def resize_image(im: Image.Image, size: int) -> Image.Image:  # noqa: F821
    from PIL import Image

    target = resized_size(im.width, im.height, size)
    return im if target == im.size else im.resize(target, Image.BICUBIC)


def encode_image(source, size: int, quality: int = JPEG_QUALITY, image_format: str = "jpg") -> bytes:
    """The stored bytes of one sample: RGB, shorter side `size`, JPEG (`quality`) or lossless PNG."""
    im = resize_image(load_rgb(source), size)
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
    (vectorised; the row above the first counts as zeros, as the PNG spec says) and one zlib stream. About 2x faster
    than PIL's encoder at the same level (which tries every filter on every row) for about the same size."""
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


def _encode_job(job: tuple) -> tuple[int, bytes | None, str | None]:
    pos, source, size, quality, image_format = job
    try:
        return pos, encode_image(source, size, quality, image_format), None
    except Exception as exn:  # any unreadable/corrupt image is skipped and reported, never fatal
        return pos, None, f"{type(exn).__name__}: {exn}"


# ---- tar writing -----------------------------------------------------------------------------------------------


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o644, "", ""
    tar.addfile(info, io.BytesIO(data))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_json(path: Path, obj: dict) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


class _Plan:
    """What to write for one split: sources in write order, with their cls/uq/lab fields."""

    def __init__(self, split: str, sources: list, names: list[str], cls: np.ndarray, uq: np.ndarray, lab: np.ndarray):
        self.split, self.sources, self.names, self.cls, self.uq, self.lab = split, sources, names, cls, uq, lab

    def __len__(self) -> int:
        return len(self.sources)


def _encoded(plan: _Plan, start: int, stop: int, resize: int, codec: tuple[str, int], pool) -> Iterator[tuple]:
    """(pos, bytes or None, error) for positions start..stop-1, in order; `codec` = (image format, JPEG quality)."""
    fmt, quality = codec
    jobs = ((p, plan.sources[p], resize, quality, fmt) for p in range(start, stop))
    if pool is None:
        yield from map(_encode_job, jobs)
    else:
        yield from pool.imap(_encode_job, jobs, chunksize=8)


def _write_shards(
    plan: _Plan, out: Path, prefix: str, done: list[dict], stop_at: int, size_bytes: int, resize: int,
    codec: tuple[str, int], pool, on_shard, bar,
) -> None:  # fmt: skip
    """Append shards to `done` from position done[-1].end on, calling `on_shard` after each finished one."""
    pos = done[-1]["start"] + done[-1]["count"] if done else 0
    results = _encoded(plan, pos, stop_at, resize, codec, pool)
    while pos < stop_at:
        record = _write_one(
            plan, out, f"{prefix}-{plan.split}-{len(done):05d}.tar", pos, results, size_bytes, stop_at, bar, codec[0]
        )
        done.append(record)
        pos += record["count"]
        on_shard()


def _write_one(
    plan: _Plan, out: Path, name: str, start: int, results: Iterator[tuple], size_bytes: int, stop_at: int, bar,
    image_format: str,
) -> dict:  # fmt: skip
    """Write positions start.. into `name` until it reaches `size_bytes` (or `stop_at`); atomic."""
    skipped, written, pos = [], 0, start

    def write(f) -> None:
        nonlocal written, pos
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            while pos < stop_at and f.tell() < size_bytes:
                p, data, err = next(results)
                assert p == pos, (p, pos)
                if data is None:
                    skipped.append(
                        {"split": plan.split, "uq": int(plan.uq[p]), "labelled": bool(plan.lab[p]),
                         "source": plan.names[p], "error": err}
                    )  # fmt: skip
                    print(f"make-shards: skipped {plan.names[p]} ({plan.split}): {err}", file=sys.stderr)
                else:
                    key = f"{int(plan.uq[p]):08d}"
                    _add(tar, f"{key}.{image_format}", data)
                    _add(tar, key + ".cls", b"%d" % int(plan.cls[p]))
                    _add(tar, key + ".uq", b"%d" % int(plan.uq[p]))
                    _add(tar, key + ".lab", b"%d" % int(plan.lab[p]))
                    written += 1
                pos += 1
                if bar is not None:
                    bar.update(1)

    atomic_write(out / name, write)
    size = (out / name).stat().st_size
    return {
        "name": name, "start": start, "count": pos - start, "written": written, "bytes": size,
        "sha256": _sha256(out / name), "skipped": skipped,
    }  # fmt: skip


# ---- the command -----------------------------------------------------------------------------------------------


def _train_split(raw: RawDataset, holdout: float, holdout_seed: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """(labelled mask, targets, counts) of the train samples in native order: the GCD split (REFERENCE.md §7), or for
    your own images every labelled image but the held-out share (`splits.discovery_split`)."""
    if raw.dataset == DISCOVERY:
        labelled, targets, held = discovery_split(raw.train_labels, holdout, holdout_seed)
        return labelled, targets, discovery_counts(targets, held)
    labelled, targets = gcd_split(raw.train_labels, raw.known, PROP, SPLIT_SEED, novel_classes=raw.novel)
    return labelled, targets, split_counts(labelled, targets, len(raw.known), len(raw.test))


def _plans(raw: RawDataset, holdout: float, holdout_seed: int) -> tuple[_Plan, _Plan, dict]:
    labelled, targets, counts = _train_split(raw, holdout, holdout_seed)
    order = raw.known + raw.novel
    remap = {c: i for i, c in enumerate(order)}
    stray = sorted(set(raw.test_labels.tolist()) - set(order))
    if stray:
        raise ShardsError(f"test classes {stray[:10]} are not train classes")
    test_targets = np.asarray([remap[c] for c in raw.test_labels.tolist()], np.int64)
    n = len(raw.train)
    write_order = np.random.RandomState(ORDER_SEED).permutation(n)
    train = _Plan(
        "train", [raw.train[i] for i in write_order], [raw.train_names[i] for i in write_order],
        targets[write_order], write_order, labelled[write_order],
    )  # fmt: skip
    nt = len(raw.test)
    test = _Plan("test", raw.test, raw.test_names, test_targets, np.arange(nt), np.zeros(nt, bool))
    return train, test, counts


def _fingerprint(
    raw: RawDataset, resize: int, codec: tuple[str, int], shard_size_mb: float, holdout: float, holdout_seed: int
) -> dict:
    fmt, quality = codec
    fingerprint = {
        "format": FORMAT, "dataset": raw.dataset, "resize": resize, "image_format": fmt,
        "jpeg_quality": quality if fmt == "jpg" else None,
        "png_compress_level": PNG_COMPRESS_LEVEL if fmt == "png" else None,
        "shard_size_mb": shard_size_mb, "known": raw.known, "novel": raw.novel, "n_train": len(raw.train),
        "n_test": len(raw.test), "prop": PROP, "split_seed": SPLIT_SEED, "order_seed": ORDER_SEED,
    }  # fmt: skip
    if raw.dataset == DISCOVERY:  # only there: the other datasets' folders written before keep their fingerprint
        fingerprint.update(holdout=holdout, holdout_seed=holdout_seed)
    return fingerprint


def _check_out(out: Path, dataset: str, fingerprint: dict) -> dict | None:
    """The previous manifest or state in `out` when it belongs to this run; refuse anything else."""
    for fname in (MANIFEST, STATE):
        path = out / fname
        if path.exists():
            prev = json.loads(path.read_text())
            if prev.get("dataset") != dataset:
                raise ShardsError(
                    f"{out} holds shards of dataset {prev.get('dataset')!r}, not {dataset!r}: choose another --out"
                )
            # outputs written before --image-format existed are JPEG with no format in the fingerprint
            prev_fp = {"image_format": "jpg", "png_compress_level": None, **prev.get("fingerprint", {})}
            if prev_fp != fingerprint:
                diff = sorted(k for k in fingerprint if prev_fp.get(k) != fingerprint[k])
                raise ShardsError(
                    f"{out} holds {dataset} shards made with other settings ({', '.join(diff)}): choose another --out "
                    "or delete the folder"
                )
            return prev
    foreign = sorted(p.name for p in out.glob("*.tar") if not p.name.startswith(dataset + "-"))
    if foreign:
        raise ShardsError(f"{out} holds shards of another dataset ({foreign[0]}, ...): choose another --out")
    return None


def _shard_ok(out: Path, rec: dict) -> bool:
    path = out / rec["name"]
    return path.is_file() and path.stat().st_size == rec["bytes"] and _sha256(path) == rec["sha256"]


def _manifest(
    raw: RawDataset, fingerprint: dict, counts: dict, done: dict, resize: int, codec: tuple[str, int]
) -> dict:
    order = raw.known + raw.novel
    if codec[0] == "jpg":
        image = f"RGB JPEG (quality {codec[1]})"
    else:
        image = f"RGB PNG (lossless; filter Up, zlib level {PNG_COMPRESS_LEVEL})"
    skipped = [s for split in ("train", "test") for rec in done[split] for s in rec["skipped"]]
    counts = dict(counts)
    for split in ("train", "test"):
        counts[f"written_{split}"] = sum(r["written"] for r in done[split])
        counts[f"skipped_{split}"] = sum(len(r["skipped"]) for r in done[split])
    problems = check_counts(raw.dataset, counts)
    return {
        "format": FORMAT,
        "dataset": raw.dataset,
        "root": str(raw.root),
        "fingerprint": fingerprint,
        "image": f"{image}, shorter side {resize} (bicubic, antialiased), aspect kept",
        "image_format": codec[0],
        "resize": resize,
        "classes": {
            "names": [raw.class_names[c] for c in order],  # by target (remapped id)
            "native_ids": order,  # target -> native class id
            "known": raw.known,
            "novel": raw.novel,
        },
        "n_old": len(raw.known),
        "n_classes": None if raw.dataset == DISCOVERY else len(order),  # discovery: the novel classes are unknown
        "counts": counts,
        "reference_check": problems if problems else ("ok" if check_counts_applies(raw.dataset, counts) else "n/a"),
        "splits": {
            split: {"n": fingerprint[f"n_{split}"], "written": counts[f"written_{split}"], "shards": done[split]}
            for split in ("train", "test")
        },
        "skipped": skipped,
        "notes": raw.notes,
    }


def check_counts_applies(dataset: str, counts: dict) -> bool:
    from .splits import EXPECTED_COUNTS

    exp = EXPECTED_COUNTS.get(dataset)
    if exp is None:
        return False
    if "train" in exp:
        return counts.get("train") == exp["train"]
    return counts.get("train", 0) >= exp.get("train_min", 0)


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
    if image_format not in IMAGE_FORMATS:
        raise ShardsError(f"image format must be one of {', '.join(IMAGE_FORMATS)}, got {image_format!r}")
    codec = (image_format, jpeg_quality)
    dataset = canonical_name(dataset)
    if holdout and dataset != DISCOVERY:
        raise ShardsError(f"--holdout applies to --dataset {DISCOVERY} (your own images); {dataset} has its GCD split")
    if not 0.0 <= holdout < 1.0:
        raise ShardsError(f"--holdout {holdout}: the held-out share must lie in [0, 1), e.g. --holdout 0.1")
    out = Path(out)
    if isinstance(root, RawDataset) and known_classes is not None:
        raise ShardsError("known_classes applies to a dataset read from its folder: set the RawDataset's known classes")
    raw = root if isinstance(root, RawDataset) else read_dataset(dataset, root, known_classes)
    train, test, counts = _plans(raw, holdout, holdout_seed)
    fingerprint = _fingerprint(raw, resize, codec, shard_size_mb, holdout, holdout_seed)
    out.mkdir(parents=True, exist_ok=True)
    prev = _check_out(out, dataset, fingerprint)
    log = (lambda msg: print(f"make-shards: {msg}", file=sys.stderr)) if progress else (lambda msg: None)
    log(_describe_split(raw, counts))
    for note in raw.notes:
        log(note)
    for problem in check_counts(dataset, counts):
        print(f"make-shards: WARNING: {problem}", file=sys.stderr)

    plans = {"train": train, "test": test}
    done: dict[str, list[dict]] = {"train": [], "test": []}
    redo: dict[str, list[dict]] = {"train": [], "test": []}
    if prev is not None and prev.get("format") == FORMAT and "splits" in prev:  # a manifest: verify, repair
        for split in plans:
            done[split] = prev["splits"][split]["shards"]
            redo[split] = [r for r in done[split] if not _shard_ok(out, r)]
        if not any(redo.values()):
            log(f"{out} is complete and verified (sha256): nothing to do")
            return prev
        log(f"repairing {sum(map(len, redo.values()))} damaged or missing shard(s)")
    elif prev is not None:  # a state file: resume
        done = {split: [r for r in prev["done"][split]] for split in plans}
        for split in plans:  # a finished shard that went missing since is rewritten in order
            good = []
            for rec in done[split]:
                if not _shard_ok(out, rec):
                    break
                good.append(rec)
            done[split] = good
        log(f"resuming after {len(done['train'])} train + {len(done['test'])} test shard(s)")
    for tmp in out.glob("*.tmp"):
        tmp.unlink()

    def save_state() -> None:
        _atomic_json(out / STATE, {"dataset": dataset, "fingerprint": fingerprint, "done": done})

    size_bytes = int(shard_size_mb * 2**20)
    bar = None
    if progress:
        from tqdm import tqdm

        todo = sum(len(plans[s]) - sum(r["count"] for r in done[s]) for s in plans) if not any(redo.values()) else None
        bar = tqdm(total=todo, unit="img", desc=f"make-shards {dataset}", file=sys.stderr)
    pool = None
    if workers > 1:
        import multiprocessing as mp

        pool = mp.get_context("fork").Pool(workers)
    try:
        if any(redo.values()):
            for split, recs in redo.items():
                for rec in recs:
                    stop = rec["start"] + rec["count"]
                    results = _encoded(plans[split], rec["start"], stop, resize, codec, pool)
                    new = _write_one(
                        plans[split], out, rec["name"], rec["start"], results, 1 << 62, stop, bar, image_format
                    )
                    if new["sha256"] != rec["sha256"]:
                        print(
                            f"make-shards: WARNING: rewritten {rec['name']} differs from the manifest", file=sys.stderr
                        )
                    rec.update(new)
        else:
            save_state()
            for split in ("train", "test"):
                _write_shards(
                    plans[split], out, dataset, done[split], len(plans[split]), size_bytes, resize, codec, pool,
                    save_state, bar,
                )  # fmt: skip
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    manifest = _manifest(raw, fingerprint, counts, done, resize, codec)
    _atomic_json(out / MANIFEST, manifest)
    (out / STATE).unlink(missing_ok=True)
    n_shards = sum(len(done[s]) for s in done)
    log(
        f"wrote {out}: {n_shards} shard(s), {manifest['counts']['written_train']:,} train + "
        f"{manifest['counts']['written_test']:,} test samples, {len(manifest['skipped'])} skipped"
    )
    if manifest["skipped"]:
        where = ""
        if dataset == DISCOVERY:
            where = " (" + ", ".join(f"{n} {part}" for part, n in _discovery_skipped(manifest).items() if n) + ")"
        print(
            f"make-shards: WARNING: {len(manifest['skipped'])} unreadable image(s) skipped{where}, listed in "
            f"{out / MANIFEST} under 'skipped': re-save them in a format PIL reads (JPEG, PNG) or remove them",
            file=sys.stderr,
        )
    if dataset == DISCOVERY:
        for name in _classes_left_unlabelled(raw, train, manifest["skipped"]):
            print(f"make-shards: WARNING: every labelled image of labelled/{name}/ is unreadable, so the class has no "
                  "labelled image to anchor its cluster: replace its images or remove the folder, then run "
                  "make-shards again into a new --out", file=sys.stderr)  # fmt: skip
    return manifest


def _describe_split(raw: RawDataset, counts: dict) -> str:
    """The split's counts, as make-shards prints them."""
    if raw.dataset == DISCOVERY:
        return (f"{DISCOVERY}: {len(raw.known)} known classes; train {counts['train']:,} = labelled "
                f"{counts['labelled']:,} + held out for evaluation {counts['held_out']:,} + unlabelled "
                f"{counts['unlabelled']:,} (no labels); no test split")  # fmt: skip
    return (
        f"{raw.dataset}: {len(raw.class_names)} classes ({len(raw.known)} known, {len(raw.novel)} novel); train "
        f"{counts['train']:,} = labelled {counts['labelled']:,} + unlabelled {counts['unlabelled']:,} "
        f"({counts['unlabelled_known']:,} known, {counts['unlabelled_novel']:,} novel); test {counts['test']:,}"
    )


def _discovery_skipped(manifest: dict) -> dict[str, int]:
    """{"labelled", "held_out", "unlabelled"}: how many of each a discovery folder's skipped images were."""
    def part(s: dict) -> str:
        if Path(s["source"]).parts[0] == "unlabelled":
            return "unlabelled"
        return "labelled" if s["labelled"] else "held_out"

    parts = [part(s) for s in manifest["skipped"]]
    return {k: parts.count(k) for k in ("labelled", "held_out", "unlabelled")}


def _classes_left_unlabelled(raw: RawDataset, train: _Plan, skipped: list[dict]) -> list[str]:
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
    parser.add_argument("--root", required=True, help="the raw dataset in its official layout (see docs/data.md)")
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
    from .layouts import LayoutError

    known = parse_class_list(" ".join(args.known_classes)) if args.known_classes else None
    t0 = time.time()
    try:
        manifest = make_shards(
            args.dataset, args.root, args.out, shard_size_mb=args.shard_size_mb, known_classes=known,
            resize=args.resize, workers=args.workers, progress=not args.no_progress, jpeg_quality=args.jpeg_quality,
            image_format=getattr(args, "image_format", "jpg"), holdout=args.holdout, holdout_seed=args.holdout_seed,
        )  # fmt: skip
    except (ShardsError, LayoutError) as exn:
        print(f"make-shards: error: {exn}", file=sys.stderr)
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


def written_counts(manifest: dict) -> dict[str, int]:
    """What the shards hold: the split's counts less the images skipped as unreadable (labelled, unlabelled, test; for
    your own images labelled, held_out, unlabelled)."""
    c = manifest["counts"]
    if manifest["dataset"] == DISCOVERY:
        return {k: c[k] - n for k, n in _discovery_skipped(manifest).items()}
    gone = [(s["split"], bool(s["labelled"])) for s in manifest["skipped"]]
    return {
        "labelled": c["labelled"] - gone.count(("train", True)),
        "unlabelled": c["unlabelled"] - gone.count(("train", False)),
        "test": c["test"] - sum(split == "test" for split, _ in gone),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infosieve make-shards", description=__doc__.split("\n")[0])
    add_cli_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
