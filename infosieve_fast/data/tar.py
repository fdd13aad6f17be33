"""Reading `make-shards` tars: members, samples (grouped as webdataset groups them) and a random-access sample index.

A plain-Python reader over mmap: about 6x faster than `tarfile` (which parses every header field of every member). It
reads what `tarfile` writes (ustar, GNU long names, pax headers) and groups members into samples exactly as webdataset
does (key = path up to the first dot of the file name, lower-case extension).

`index_shards` walks the headers once and records where each sample's image lies, its size (read from the image's own
header) and its bookkeeping; the stream then reads any sample by offset, so an epoch can be any global order.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
IMAGE_KEYS = ("jpg", "png")  # a sample's image, by the shards' --image-format
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _octal(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:
        raise tarfile.ReadError("base-256 numeric header fields are not supported")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise tarfile.ReadError(f"invalid number {text[:12]!r} in a header: damaged archive") from None


def _pax_records(data: bytes) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        out[key.decode("utf-8")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def open_mmap(path: str) -> mmap.mmap:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise tarfile.ReadError("empty file")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _member_spans(mm: mmap.mmap) -> Iterator[tuple[str, int, int]]:
    """(name, data offset, data length) of every regular file, in order; damage raises `tarfile.ReadError` after the
    members before it."""
    size = len(mm)
    pos, long_name, pax = 0, None, {}
    while pos + 512 <= size:
        hdr = mm[pos : pos + 512]
        if hdr.count(0) == 512:
            return  # end-of-archive marker
        if _octal(hdr[148:156]) != sum(hdr) - sum(hdr[148:156]) + 256:
            raise tarfile.ReadError(f"bad header checksum at byte {pos:,}: damaged archive")
        n = _octal(hdr[124:136])
        kind = hdr[156:157]
        start, pos = pos + 512, pos + 512 + (n + 511) // 512 * 512
        if start + n > size:
            raise tarfile.ReadError(f"member at byte {start - 512:,} ends after the end of the file: truncated")
        if kind == b"L":  # GNU long name of the next member
            long_name = mm[start : start + n].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            continue
        if kind in (b"x", b"g"):  # pax header (per member / global)
            if kind == b"x":
                pax = _pax_records(mm[start : start + n])
            continue
        if kind not in (b"0", b"\0", b"7"):  # directories, links, ...: not sample data
            long_name, pax = None, {}
            continue
        name = hdr[0:100].split(b"\0", 1)[0]
        if hdr[257:262] == b"ustar" and hdr[345:346] != b"\0":
            name = hdr[345:500].split(b"\0", 1)[0] + b"/" + name
        name = pax.get("path") or long_name or name.decode("utf-8", "surrogateescape")
        if "size" in pax:
            raise tarfile.ReadError("pax size override is not supported")
        long_name, pax = None, {}
        yield name, start, n
    if pos < size:
        raise tarfile.ReadError(f"{size - pos} stray bytes at the end: truncated")


def _sample_spans(mm: mmap.mmap) -> Iterator[tuple[str, dict[str, tuple[int, int]]]]:
    """(key, {extension: (offset, length)}) per sample, grouped as webdataset groups members."""
    key, parts = None, {}
    for name, start, n in _member_spans(mm):
        m = _KEY_EXT.match(name)
        if m is None:
            continue
        k, ext = m.group(1), m.group(2).lower()
        if key is None or key != k or ext in parts:
            if key is not None:
                yield key, parts
            key, parts = k, {}
        parts[ext] = (start, n)
    if key is not None:
        yield key, parts


def tar_members(path: str) -> Iterator[tuple[str, bytes]]:
    """(name, data) of every regular file in the tar at `path`, in order; a damaged or truncated archive raises
    `tarfile.ReadError` after the members before the damage."""
    mm = open_mmap(path)
    try:
        for name, start, n in _member_spans(mm):
            yield name, mm[start : start + n]
    finally:
        mm.close()


def tar_samples(path: str) -> Iterator[dict]:
    """The samples of one shard: dicts of extension -> bytes, plus `__key__` and `__url__` (as webdataset's)."""
    mm = open_mmap(path)
    try:
        for key, parts in _sample_spans(mm):
            yield {"__key__": key, "__url__": path, **{ext: mm[a : a + n] for ext, (a, n) in parts.items()}}
    finally:
        mm.close()


def image_hw(head: bytes) -> tuple[int, int]:
    """(height, width) of a JPEG or PNG from its first bytes (PNG IHDR, or the JPEG's start-of-frame segment)."""
    if head[:8] == PNG_MAGIC:
        w, h = struct.unpack(">II", head[16:24])
        return h, w
    if head[:2] != b"\xff\xd8":
        raise ValueError("neither a JPEG nor a PNG")
    pos = 2
    while pos + 9 <= len(head):
        if head[pos] != 0xFF:
            raise ValueError(f"damaged JPEG header at byte {pos}")
        marker = head[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        seg = struct.unpack(">H", head[pos + 2 : pos + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn
            h, w = struct.unpack(">HH", head[pos + 5 : pos + 9])
            return h, w
        pos += 2 + seg
    raise ValueError("JPEG header without a start-of-frame segment in its first bytes")


@dataclass
class ShardIndex:
    """Every readable sample of a split's shards, in storage order (shard by shard)."""

    shard: np.ndarray  # int32: position in the split's shard list
    offset: np.ndarray  # int64: byte offset of the image in its shard
    length: np.ndarray  # int64: byte length of the image
    hw: np.ndarray  # int64 [N, 2]: the stored image's height and width
    cls: np.ndarray  # int64: target, known classes first
    uq: np.ndarray  # int64: native index (before compaction over make-shards' skipped images)
    lab: np.ndarray  # bool: label may be used

    def __len__(self) -> int:
        return len(self.uq)


def index_shard(path: str) -> tuple[np.ndarray, str | None]:
    """(int64 [n, 7]: offset, length, h, w, cls, uq, lab of the readable samples of one shard; problem or None)."""
    rows: list[tuple] = []
    try:
        mm = open_mmap(path)
    except (OSError, tarfile.ReadError) as exn:
        return np.zeros((0, 7), np.int64), f"{path}: {type(exn).__name__}: {exn}"
    problem = None
    try:
        for key, parts in _sample_spans(mm):
            img = next((parts[k] for k in IMAGE_KEYS if k in parts), None)
            if img is None or not all(k in parts for k in ("cls", "uq", "lab")):
                problem = f"{path}: incomplete sample {key} skipped"
                continue
            try:
                a, n = img
                h, w = image_hw(mm[a : a + min(n, 65536)])
                meta = [int(mm[parts[k][0] : parts[k][0] + parts[k][1]]) for k in ("cls", "uq", "lab")]
            except ValueError as exn:
                problem = f"{path}: sample {key} unreadable ({exn})"
                continue
            rows.append((a, n, h, w, *meta))
    except tarfile.ReadError as exn:
        problem = f"{path}: {exn}; the samples after the damage are unreadable"
    finally:
        mm.close()
    return np.asarray(rows, np.int64).reshape(-1, 7), problem


def index_shards(paths: list[str], processes: int | None = None) -> tuple[ShardIndex, list[str]]:
    """The index of every readable sample of `paths`, and the problems met (damaged shards, unreadable headers).

    The shards are indexed in parallel by `processes` (default: one per CPU core, up to one per shard): the header
    walk costs ~30 us per sample in Python, ~40 s for ImageNet-1k on one core."""
    processes = min(len(paths), processes or os.cpu_count() or 1)
    if processes > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(processes) as pool:
            results = pool.map(index_shard, paths, chunksize=1)
    else:
        results = [index_shard(p) for p in paths]
    shard = np.concatenate(
        [np.full(len(r), i, np.int32) for i, (r, _) in enumerate(results)] or [np.zeros(0, np.int32)]
    )
    rows = np.concatenate([r for r, _ in results] or [np.zeros((0, 7), np.int64)])
    index = ShardIndex(shard, rows[:, 0], rows[:, 1], rows[:, 2:4], rows[:, 4], rows[:, 5], rows[:, 6].astype(bool))
    return index, [p for _, p in results if p]
