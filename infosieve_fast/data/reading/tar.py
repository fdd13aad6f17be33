"""Reading WebDataset tars: members, samples (grouped as webdataset groups them) and a random-access sample index.

A plain-Python reader over mmap: faster than `tarfile`, which parses every header field of every member. It
reads what `tarfile` writes (ustar, GNU long names, pax headers) and groups members into samples exactly as webdataset
does (key = path up to the first dot of the file name, lower-case extension).

`index_rows` walks the headers once and records where each sample's image lies, its size (read from the image's own
header) and its integer fields (`SampleKeys`: make-shards' cls/uq/lab, or a foreign label, `data.intake`); the stream
then reads any sample by offset, so an epoch can be any global order. A compressed shard is recognised by its first
bytes and reported with its sample count.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import tarfile
from collections import Counter
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np

from ...common.limits import check_image_pixels
from ...common.worker_processes import forked_pool

_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
IMAGE_KEYS = ("jpg", "png")  # a sample's image, by the shards' --image-format
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _octal(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:
        raise tarfile.ReadError("base-256 numeric header fields are not supported")
    text = field.split(b"\0", 1)[0].strip()
    if text and not text.isdigit():  # int() would also take a sign: a negative size would walk backwards forever
        raise tarfile.ReadError(f"invalid number {text[:12]!r} in a header: damaged archive")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise tarfile.ReadError(f"invalid number {text[:12]!r} in a header: damaged archive") from None


def _pax_records(data: bytes) -> dict[str, str]:
    """The records of a pax header ("LENGTH key=value\n" each); `tarfile.ReadError` when one is malformed."""
    out, pos = {}, 0
    try:
        while pos < len(data) and data[pos:].strip(b"\0"):
            space = data.index(b" ", pos)
            length = int(data[pos:space])
            if length <= space - pos:  # a record must reach past its own length field, or the walk never ends
                raise ValueError(f"record length {length}")
            key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
            out[key.decode("utf-8")] = value.decode("utf-8", "surrogateescape")
            pos += length
    except ValueError as exn:
        raise tarfile.ReadError(f"malformed pax header ({exn}): damaged archive") from None
    return out


def open_mmap(path: str) -> mmap.mmap:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise tarfile.ReadError("empty file")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _member_spans(mm: mmap.mmap) -> Generator[tuple[str, int, int], None, bool]:
    """(name, data offset, data length) of every regular file, in order; damage raises `tarfile.ReadError` after the
    members before it. Returns whether the walk ended at the end-of-archive marker."""
    size = len(mm)
    pos, long_name, pax = 0, None, {}
    while pos + 512 <= size:
        hdr = mm[pos : pos + 512]
        if hdr.count(0) == 512:
            return True  # end-of-archive marker (the generator's return value: `ends_with_marker`)
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
    return False


def sample_spans(mm: mmap.mmap, flush_at_damage: bool = False) -> Iterator[tuple[str, dict[str, tuple[int, int]]]]:
    """(key, {extension: (offset, length)}) per sample, grouped as webdataset groups members. At damage, with
    `flush_at_damage`, the sample read so far (its whole members: it may lack those after the damage) comes first,
    then the `tarfile.ReadError`."""
    key, parts = None, {}
    try:
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
    except tarfile.ReadError:
        if key is not None and flush_at_damage:
            yield key, parts
        raise
    if key is not None:
        yield key, parts


def ends_with_marker(path: str) -> bool:
    """The tar at `path` reads to its end-of-archive marker (the zero block tar writes after the last member): a
    tar cut short between two members reads as a whole one with fewer samples, and only the marker tells them apart."""
    try:
        mm = open_mmap(path)
    except tarfile.ReadError:  # an empty file
        return False
    spans = _member_spans(mm)
    try:
        while True:
            next(spans)
    except StopIteration as end:
        return end.value
    except tarfile.ReadError:
        return False
    finally:
        spans.close()
        mm.close()


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
        for key, parts in sample_spans(mm):
            yield {"__key__": key, "__url__": path, **{ext: mm[a : a + n] for ext, (a, n) in parts.items()}}
    finally:
        mm.close()


def image_members(
    path: str, image_keys: tuple[str, ...], damage: list[str] | None = None
) -> tuple[list[tuple[str, int, int]], int]:
    """((key, offset, length) of each sample's image: the first of `image_keys` present, in storage order; the number
    of samples with none of them). A compressed shard raises `tarfile.ReadError` with what to do; so does a damaged
    one, unless `damage` is given: then the samples before the damage are returned (as `index_shard` keeps them for
    training) and the damage is appended to `damage`."""
    mm = open_mmap(path)
    found, without = [], 0
    try:
        kind = compression(mm[:512])
        if kind is not None:
            raise tarfile.ReadError(compressed_shard_problem(path, kind))
        for key, parts in sample_spans(mm, flush_at_damage=damage is not None):
            span = next((parts[k] for k in image_keys if k in parts), None)
            if span is None:
                without += 1
            else:
                found.append((key, *span))
    except tarfile.ReadError as exn:
        if damage is None or kind is not None:
            raise
        damage.append(f"{exn}; the samples after the damage are unreadable")
    finally:
        mm.close()
    return found, without


def read_span(path: str, offset: int, length: int) -> bytes:
    """`length` bytes of the file at `path` from `offset`: one seek and one read."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def image_hw(buf, start: int = 0, end: int | None = None) -> tuple[int, int]:
    """(height, width) of the JPEG, PNG or WebP in `buf[start:end]` (bytes or an mmap), read from its header: the PNG
    IHDR, the WebP frame header or the JPEG's start-of-frame segment. JPEG segments are skipped by their lengths, so
    metadata of any size before the frame header (a large ICC profile, EXIF thumbnails) costs a few reads."""
    end = len(buf) if end is None else end
    head = buf[start : min(end, start + 32)]
    if head[:8] == PNG_MAGIC:
        if len(head) < 24:
            raise ValueError(f"PNG cut short in its header ({len(head)} bytes)")
        w, h = struct.unpack(">II", head[16:24])
        return h, w
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        if len(head) < 30:
            raise ValueError(f"WebP cut short in its header ({len(head)} bytes)")
        return _webp_hw(head)
    if head[:2] != b"\xff\xd8":
        raise ValueError("neither a JPEG, a PNG nor a WebP")
    pos = start + 2
    while pos + 9 <= end:
        seg = buf[pos : pos + 9]
        if seg[0] != 0xFF:
            raise ValueError(f"damaged JPEG header at byte {pos - start}")
        marker = seg[1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn
            h, w = struct.unpack(">HH", seg[5:9])
            return h, w
        pos += 2 + struct.unpack(">H", seg[2:4])[0]
    raise ValueError("JPEG without a start-of-frame segment")


def _webp_hw(head: bytes) -> tuple[int, int]:
    """(height, width) from the first 30 bytes of a WebP (lossy VP8, lossless VP8L or extended VP8X)."""
    kind = head[12:16]
    if kind == b"VP8 ":
        w, h = struct.unpack("<HH", head[26:30])
        return h & 0x3FFF, w & 0x3FFF
    if kind == b"VP8L":
        bits = int.from_bytes(head[21:25], "little")
        return ((bits >> 14) & 0x3FFF) + 1, (bits & 0x3FFF) + 1
    if kind == b"VP8X":
        return int.from_bytes(head[27:30], "little") + 1, int.from_bytes(head[24:27], "little") + 1
    raise ValueError(f"WebP with an unknown chunk {kind!r}")


# The first bytes of a compressed tar: what the shard is, and how to decompress it.
COMPRESSED_MAGIC = {
    b"\x1f\x8b": ("gzip", "gunzip"),
    b"BZh": ("bzip2", "bunzip2"),
    b"\xfd7zXZ\x00": ("xz", "unxz"),
    b"\x28\xb5\x2f\xfd": ("zstd", "unzstd"),
}


def compression(head: bytes) -> tuple[str, str] | None:
    """(compression, the command that undoes it) when `head` (the file's first 512 bytes) starts a compressed file,
    else None. A valid tar header is a tar whatever its first bytes: a member's name may start like a magic number."""
    kind = next((v for magic, v in COMPRESSED_MAGIC.items() if head.startswith(magic)), None)
    if kind is None or len(head) < 512:
        return kind
    try:
        return None if _octal(head[148:156]) == sum(head[:512]) - sum(head[148:156]) + 256 else kind
    except tarfile.ReadError:
        return kind


def compressed_shard_problem(path: str, kind: tuple[str, str]) -> str:
    """The message for a compressed shard: how many samples it holds (counted through Python's decompressor) and
    what to do."""
    try:
        with tarfile.open(path, "r:*") as tar:
            keys = {m.group(1) for m in map(_KEY_EXT.match, (i.name for i in tar if i.isfile())) if m}
        count = f"its {len(keys):,} samples are"
    except (tarfile.TarError, OSError, EOFError):
        count = "all of its samples are"
    name, tool = kind
    return (
        f"{path} is a {name}-compressed shard: {count} skipped. Decompress it (`{tool} -c {path} > NAME.tar`) and "
        "point data.shards at the .tar: samples are read by byte offset, which a compressed stream does not allow"
    )


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


@dataclass(frozen=True)
class SampleKeys:
    """Which members of a sample hold its image (the first of `image` present) and its integer `fields` (as
    make-shards writes them: cls, uq, lab). `data.intake` derives the keys of foreign shards from this."""

    image: tuple[str, ...] = IMAGE_KEYS
    fields: tuple[str, ...] = ("cls", "uq", "lab")

    def missing(self, parts: dict) -> list[str]:
        """The keys a sample lacks ('image' for no image key at all)."""
        lacks = [] if any(k in parts for k in self.image) else ["image"]
        return lacks + [k for k in self.fields if k not in parts]

    def read(self, mm: mmap.mmap, parts: dict) -> list[int]:
        """The sample's integer fields; ValueError when one does not parse."""
        return [int(member_bytes(mm, parts[k])) for k in self.fields]

    def describe(self, key: str) -> str:
        """What a missing `key` means, for the message."""
        return f"no image (none of {', '.join(self.image)})" if key == "image" else f"no {key!r} member"


def member_bytes(mm: mmap.mmap, span: tuple[int, int]) -> bytes:
    a, n = span
    return mm[a : a + n]


def _skipped_message(path: str, keys: SampleKeys, missing: Counter, unreadable: list[str]) -> str | None:
    """One message for every sample of a shard that was left out: counts per missing key, and unreadable headers."""
    parts = [f"{n:,} with {keys.describe(k)}" for k, n in sorted(missing.items())]
    if unreadable:
        parts.append(f"{len(unreadable):,} unreadable (first: {unreadable[0]})")
    if not parts:
        return None
    fix = " (set data.intake.image_keys / data.intake.label_key to the shards' member names)" if missing else ""
    return f"{path}: samples skipped: {'; '.join(parts)}{fix}"


def index_shard(path: str, keys: SampleKeys = SampleKeys()) -> tuple[np.ndarray, list[str]]:
    """(int64 [n, 4 + len(keys.fields)]: offset, length, h, w, fields... of the readable samples of one shard;
    the problems met)."""
    width = 4 + len(keys.fields)
    rows: list[tuple] = []
    try:
        mm = open_mmap(path)
    except (OSError, tarfile.ReadError) as exn:
        return np.zeros((0, width), np.int64), [f"{path}: {type(exn).__name__}: {exn}"]
    kind = compression(mm[:512])
    if kind is not None:
        mm.close()
        return np.zeros((0, width), np.int64), [compressed_shard_problem(path, kind)]
    problems, missing, unreadable = [], Counter(), []
    try:
        for key, parts in sample_spans(mm, flush_at_damage=True):  # a sample cut short lacks keys: counted below
            lacks = keys.missing(parts)
            if lacks:
                missing.update(lacks)
                continue
            a, n = next(parts[k] for k in keys.image if k in parts)
            try:
                hw = image_hw(mm, a, a + n)
                check_image_pixels(*hw)  # refused here, it never counts towards a cache's size or a batch's canvas
                rows.append((a, n, *hw, *keys.read(mm, parts)))
            except ValueError as exn:
                unreadable.append(f"{key if key.isprintable() else repr(key)}: {exn}")  # a name may hold a newline
    except tarfile.ReadError as exn:
        problems.append(f"{path}: {exn}; the samples after the damage are unreadable")
    finally:
        mm.close()
    skipped = _skipped_message(path, keys, missing, unreadable)
    return np.asarray(rows, np.int64).reshape(-1, width), problems + ([skipped] if skipped else [])


def index_rows(
    paths: list[str], keys: SampleKeys = SampleKeys(), processes: int | None = None
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(shard position per row, `index_shard` rows of every shard, problems) of `paths`, in storage order.

    The shards are indexed in parallel by `processes` (default: one per CPU core, up to one per shard): the header
    walk is Python, a cost per sample that adds up on ImageNet-size sets."""
    processes = min(len(paths), processes or os.cpu_count() or 1)
    if processes > 1:
        with forked_pool(processes) as pool:
            results = pool.map(partial(index_shard, keys=keys), paths, chunksize=1)
    else:
        results = [index_shard(p, keys) for p in paths]
    shard = np.concatenate(
        [np.full(len(r), i, np.int32) for i, (r, _) in enumerate(results)] or [np.zeros(0, np.int32)]
    )
    rows = np.concatenate([r for r, _ in results] or [np.zeros((0, 4 + len(keys.fields)), np.int64)])
    return shard, rows, [msg for _, problems in results for msg in problems]


def index_shards(paths: list[str], processes: int | None = None) -> tuple[ShardIndex, list[str]]:
    """The index of every readable sample of make-shards' `paths`, and the problems met (damaged shards, unreadable
    headers, incomplete samples)."""
    shard, rows, problems = index_rows(paths, SampleKeys(), processes)
    return make_shards_index(shard, rows), problems


def make_shards_index(shard: np.ndarray, rows: np.ndarray) -> ShardIndex:
    """The `ShardIndex` of `index_rows` read with make-shards' keys (fields cls, uq, lab)."""
    return ShardIndex(shard, rows[:, 0], rows[:, 1], rows[:, 2:4], rows[:, 4], rows[:, 5], rows[:, 6].astype(bool))
