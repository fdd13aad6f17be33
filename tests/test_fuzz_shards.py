"""Fuzzed tar shards and their saved index: every damaged shard ends in a one-line problem naming it, every sample
before the damage is still read, and a saved index that is stale, tampered with or from another version is rebuilt.

The expected rows come from the list of samples the test wrote (their image sizes and labels) and the member offsets
`tarfile` reports, not from the reader under test."""

import io
import re
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from infosieve_fast.config.settings import IntakeConfig
from infosieve_fast.data.reading import intake
from infosieve_fast.data.reading.intake import ForeignKeys, cached_index
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
from infosieve_fast.data.reading.tar import PNG_MAGIC, image_members, index_rows, index_shard, tar_samples

from .fuzz_profiles import no_hang, scaled

KEYS = ForeignKeys(("png",), ("cls",))


def png_header(h: int, w: int) -> bytes:
    """The first bytes of a PNG of h x w: all `image_hw` reads."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return PNG_MAGIC + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))


# a sample: (key, image bytes or None for a PNG header of (h, w), its size, label text, whether the label is written)
names = st.one_of(
    st.text(st.characters(blacklist_characters="./\0", blacklist_categories=("Cs",)), min_size=1, max_size=120),
    st.binary(min_size=1, max_size=30)
    .filter(lambda b: not set(b) & set(b"./\0"))
    .map(
        lambda b: b.decode("utf-8", "surrogateescape")  # names that are not UTF-8
    ),
)
images = st.one_of(
    st.tuples(st.integers(1, 5000), st.integers(1, 5000)).map(lambda hw: png_header(*hw)),
    st.binary(max_size=40),  # garbage or zero-length
    st.integers(0, 32).map(lambda n: png_header(7, 9)[:n]),  # a PNG cut short
)
labels = st.one_of(st.integers(0, 999).map(str), st.sampled_from(["", "-3", "x", "٣", "²", "1e3", " 7 ", "4\n"]))
samples = st.lists(st.tuples(names, images, labels, st.booleans()), max_size=12)


def expected_row(image: bytes, label: str, has_label: bool) -> tuple | None:
    """(length, h, w, cls) of a sample the reader must read, None for one it must skip."""
    if not has_label or len(image) < 24 or image[:8] != PNG_MAGIC:
        return None
    text = label.strip()
    if not text.isdecimal():  # a label is a non-negative decimal integer (in any script's digits, as int() reads)
        return None
    w, h = struct.unpack(">II", image[16:24])
    return len(image), h, w, int(text)


def write_tar(path: Path, rows: list, fmt: int) -> tuple[bytes, list[int]]:
    """The tar of `rows` (written to `path`) and, per sample, the byte where its last member's data ends."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape") as tar:
        for key, image, label, has_label in rows:
            members = [("png", image)] + ([("cls", label.encode())] if has_label else [])
            for ext, data in members:
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    with tarfile.open(fileobj=io.BytesIO(data), encoding="utf-8", errors="surrogateescape") as tar:
        members = tar.getmembers()
    ends, i = [], 0
    for _, _, _, has_label in rows:
        i += 1 + has_label
        m = members[i - 1]
        ends.append(m.offset_data + m.size)
    path.write_bytes(data)
    return data, ends


def skipped_count(problems: list[str]) -> int:
    """The samples the problems say were skipped ('3 with no ...', '2 unreadable ...')."""
    return sum(int(n.replace(",", "")) for p in problems for n in re.findall(r"([\d,]+) (?:with|unreadable)", p))


def check_problems(problems: list[str], path: Path) -> None:
    for p in problems:
        assert "\n" not in p and p.startswith(str(path)), p


@given(samples, st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
def test_an_intact_shard_reads_every_sample_and_counts_the_rest(tmp_path_factory, rows, fmt):
    path = tmp_path_factory.mktemp("tar") / "s.tar"
    write_tar(path, rows, fmt)
    expected = [r for r in (expected_row(i, lab, has) for _, i, lab, has in rows) if r is not None]
    with no_hang(10):
        got, problems = index_shard(str(path), KEYS)
    assert got[:, 1:].tolist() == [list(r) for r in expected]
    check_problems(problems, path)
    assert len(got) + skipped_count(problems) == len(rows)  # nothing silently dropped


@given(samples, st.data())
def test_a_truncated_shard_keeps_every_sample_before_the_cut(tmp_path_factory, rows, data):
    path = tmp_path_factory.mktemp("tar") / "s.tar"
    whole, ends = write_tar(path, rows, tarfile.GNU_FORMAT)
    full, _ = index_shard(str(path), KEYS)
    cut = data.draw(st.integers(0, len(whole)), label="cut")
    path.write_bytes(whole[:cut])
    with no_hang(10):
        got, problems = index_shard(str(path), KEYS)
    assert got.tolist() == full[: len(got)].tolist()
    readable = [i for i in range(len(rows)) if ends[i] <= cut and expected_row(*rows[i][1:]) is not None]
    assert len(got) >= len(readable)  # every sample whose members all lie before the cut
    check_problems(problems, path)
    if rows and cut < ends[-1]:
        assert problems  # the damage is reported (a cut in the padding after the last member's data loses nothing)


@given(samples.filter(bool), st.data())
def test_a_header_with_a_wrong_size_keeps_the_samples_before_it(tmp_path_factory, rows, data):
    path = tmp_path_factory.mktemp("tar") / "s.tar"
    whole, ends = write_tar(path, rows, tarfile.GNU_FORMAT)
    full, _ = index_shard(str(path), KEYS)
    with tarfile.open(fileobj=io.BytesIO(whole), encoding="utf-8", errors="surrogateescape") as tar:
        headers = [m.offset for m in tar.getmembers()]
    at = data.draw(st.sampled_from(headers), label="header")
    field = data.draw(
        st.one_of(
            st.integers(0, 8**11 - 1).map(lambda n: b"%011o\0" % n),  # any size, a huge one included
            st.integers(1, 8**10).map(lambda n: b"-%010o" % n),  # a negative size
            st.binary(min_size=12, max_size=12),
        ),
        label="size field",
    )
    damaged = bytearray(whole)
    damaged[at + 124 : at + 136] = field
    damaged[at + 148 : at + 156] = b" " * 8
    damaged[at + 148 : at + 156] = b"%06o\0 " % sum(damaged[at : at + 512])  # a valid checksum: only the size lies
    path.write_bytes(bytes(damaged))
    with no_hang(10):
        got, problems = index_shard(str(path), KEYS)
        list(_all_samples(path))
    check_problems(problems, path)
    before = [i for i, end in enumerate(ends) if end <= at]  # samples wholly before the damaged header
    k = sum(expected_row(*rows[i][1:]) is not None for i in before)
    assert got[:k].tolist() == full[:k].tolist()


def _all_samples(path: Path):
    """Every sample `tar_samples` yields, stopping at the first damage (which must be a `tarfile.ReadError`)."""
    try:
        yield from tar_samples(str(path))
    except tarfile.ReadError:
        return


@given(samples, st.data())
def test_random_byte_damage_never_escapes_as_a_traceback(tmp_path_factory, rows, data):
    path = tmp_path_factory.mktemp("tar") / "s.tar"
    whole, _ = write_tar(path, rows, data.draw(st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])))
    damaged = bytearray(whole)
    for _ in range(data.draw(st.integers(1, 8), label="flips")):
        if damaged:
            damaged[data.draw(st.integers(0, len(damaged) - 1))] = data.draw(st.integers(0, 255))
    damaged += data.draw(st.binary(max_size=600), label="appended")
    path.write_bytes(bytes(damaged))
    with no_hang(10):
        got, problems = index_shard(str(path), KEYS)
        list(_all_samples(path))
        try:
            image_members(str(path), ("png",))
        except tarfile.ReadError as exn:
            assert "\n" not in str(exn)
    check_problems(problems, path)
    assert len(got) <= len(rows) + 8


# ---- the saved index ----------------------------------------------------------------------------------------------


def _shards(folder: Path, rows: list) -> list[str]:
    paths = []
    for i in range(2):
        write_tar(folder / f"s{i}.tar", rows[i::2], tarfile.GNU_FORMAT)
        paths.append(str(folder / f"s{i}.tar"))
    return paths


def _open(paths: list[str], cache: Path) -> tuple[dict, list[str], bool]:
    return cached_index(paths, {"kind": "fuzz"}, lambda: _fresh(paths), str(cache))


def _fresh(paths: list[str]) -> tuple[dict, list[str]]:
    shard, rows, problems = index_rows(paths, KEYS, processes=1)
    return {"shard": shard, "rows": rows}, problems


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@given(samples.filter(lambda r: len(r) >= 2), st.data())
def test_a_tampered_saved_index_is_rebuilt_never_trusted(tmp_path_factory, rows, data):
    folder = tmp_path_factory.mktemp("idx")
    paths = _shards(folder, rows)
    arrays, problems, reused = _open(paths, folder / "cache")
    assert not reused
    saved = intake.index_locations(paths, {"kind": "fuzz"}, str(folder / "cache"))[0]
    blob = bytearray(saved.read_bytes())
    how = data.draw(st.sampled_from(["flip", "truncate", "rows", "version", "garbage"]), label="tampering")
    if how == "flip":
        blob[data.draw(st.integers(0, 10**6)) % len(blob)] ^= data.draw(st.integers(1, 255))
        saved.write_bytes(bytes(blob))
    elif how == "truncate":
        saved.write_bytes(bytes(blob[: data.draw(st.integers(0, 10**6)) % len(blob)]))
    elif how == "garbage":
        saved.write_bytes(data.draw(st.binary(max_size=200)))
    else:  # a well-formed file whose rows were edited, or one written by another version
        with np.load(saved) as f:
            fields = {k: f[k] for k in f.files}
        if how == "rows":
            noise = data.draw(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=4))
            fields["rows"] = fields["rows"].copy()
            flat = fields["rows"].reshape(-1)
            if flat.size:
                flat[data.draw(st.integers(0, 10**6)) % flat.size] = noise[0]
            else:
                fields["rows"] = np.asarray(noise, np.int64)
        else:
            meta = fields["meta"].item().replace('"version": 1', '"version": 0')
            fields["meta"] = np.asarray(meta)
        with open(saved, "wb") as f:
            np.savez(f, **fields)
    with no_hang(20):
        again, again_problems, reused = _open(paths, folder / "cache")
    assert _same(again, arrays) and again_problems == problems  # what the shards hold, whatever the saved file says


@given(samples.filter(lambda r: len(r) >= 2), st.data())
def test_a_saved_index_of_changed_shards_is_rebuilt(tmp_path_factory, rows, data):
    folder = tmp_path_factory.mktemp("idx")
    paths = _shards(folder, rows)
    _open(paths, folder / "cache")
    changed = data.draw(samples, label="new samples of shard 0")
    write_tar(Path(paths[0]), changed, tarfile.PAX_FORMAT)
    again, _, reused = _open(paths, folder / "cache")
    assert not reused and _same(again, _fresh(paths)[0])


# ---- the reader over foreign shards -----------------------------------------------------------------------------


def png_file(h: int, w: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@settings(max_examples=scaled(10))
@given(st.lists(st.tuples(st.integers(4, 12), st.integers(4, 12), st.booleans()), min_size=2, max_size=10))
def test_the_reader_skips_and_counts_an_image_that_does_not_decode_and_reads_the_rest(tmp_path_factory, rows):
    folder = tmp_path_factory.mktemp("foreign")
    samples = []
    for i, (h, w, intact) in enumerate(rows):
        image = png_file(h, w, i)
        if not intact:  # the header (and so the index) is whole, the pixels are not
            image = image[:33] + bytes(len(image) - 33)
        samples.append((f"s{i:03d}", image, str(i % 2), True))  # both classes present: the split needs them
    write_tar(folder / "a.tar", samples[::2], tarfile.GNU_FORMAT)
    write_tar(folder / "b.tar", samples[1::2], tarfile.GNU_FORMAT)
    intake_opts = IntakeConfig(image_keys="png", index_cache=str(folder / "index"))
    source = ShardSource(folder, ReadOptions(num_workers=0, cache="off", intake=intake_opts, resize=8))
    with no_hang(60):
        read = [u for b in source.feature_batches(3) for u in b.uq.tolist()]
    order = [*range(0, len(rows), 2), *range(1, len(rows), 2)]  # storage order: shard a, then shard b
    intact = [rows[i][2] for i in order]
    assert read == [uq for uq, ok in enumerate(intact) if ok]  # every intact image, in storage order
    assert source.unreadable() == [uq for uq, ok in enumerate(intact) if not ok]  # the others skipped and counted
