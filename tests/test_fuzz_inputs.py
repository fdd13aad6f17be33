"""Fuzzed inputs other than the tars themselves: images (truncated, CMYK, 16-bit, palette, EXIF-rotated, beyond PIL's
decompression-bomb limit), config YAML, the discovery layout (symlink loops, `..` in names, empty classes, one class)
and a shards folder's `manifest.json`. Each ends in data read correctly, a skipped-and-counted sample, or one named
one-line error; never another traceback or a hang."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from infosieve_fast.config.settings import Config, ConfigError, load_config
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource, decode_image
from infosieve_fast.data.reading.tar import image_hw
from infosieve_fast.data.shard_format import resized_size
from infosieve_fast.data.shard_manifest import ManifestError
from infosieve_fast.data.writing.encode import encode_job
from infosieve_fast.data.writing.layout_common import LayoutError
from infosieve_fast.data.writing.layouts import read_dataset
from infosieve_fast.data.writing.shards import make_shards

from .fuzz_profiles import no_hang, scaled

# ---- images ---------------------------------------------------------------------------------------------------------

MODES = {  # mode -> formats PIL writes it in
    "RGB": ("PNG", "JPEG", "WEBP"),
    "L": ("PNG", "JPEG"),
    "LA": ("PNG",),
    "RGBA": ("PNG", "WEBP"),
    "P": ("PNG",),
    "CMYK": ("JPEG",),
    "I;16": ("PNG",),
}


@st.composite
def image_files(draw) -> tuple[bytes, int, int, str]:
    """(encoded bytes, width, height, mode), maybe EXIF-rotated (JPEG) and maybe cut short."""
    mode = draw(st.sampled_from(sorted(MODES)))
    fmt = draw(st.sampled_from(MODES[mode]))
    w, h = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**16))
    depth = np.uint16 if mode == "I;16" else np.uint8
    bands = len(Image.new(mode, (1, 1)).getbands())
    pixels = np.random.default_rng(seed).integers(0, np.iinfo(depth).max, (h, w, bands), dtype=depth, endpoint=True)
    im = Image.frombytes(mode, (w, h), pixels.astype("<u2" if mode == "I;16" else np.uint8).tobytes())
    extra = {}
    if fmt == "JPEG" and draw(st.booleans()):
        exif = Image.Exif()
        exif[0x0112] = draw(st.integers(1, 8))  # orientation
        extra["exif"] = exif.tobytes()
    buf = io.BytesIO()
    im.save(buf, fmt, **extra)
    data = buf.getvalue()
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data) - 1))]  # truncated
    return data, w, h, mode


@given(image_files(), st.integers(8, 24))
def test_make_shards_encodes_an_image_at_its_size_or_skips_it_with_a_one_line_reason(tmp_path_factory, image, size):
    data, w, h, _ = image
    path = tmp_path_factory.mktemp("img") / "x.img"
    path.write_bytes(data)
    with no_hang(10):
        _, stored, error = encode_job((0, str(path), size, 95, "png"))
    if stored is None:
        assert error and "\n" not in error
        event(f"skipped: {error.split(':')[0]}")
        return
    event("encoded")
    # the pixels as stored: no EXIF rotation, as the reference's PIL loader reads them
    assert Image.open(io.BytesIO(stored)).size == resized_size(w, h, size)


@given(image_files())
def test_the_reader_decodes_an_image_to_rgb_uint8_at_its_header_size_or_raises(image):
    data, w, h, _ = image
    try:
        hw = image_hw(data)
    except ValueError:
        hw = None  # the index leaves it out, counted unreadable
    with no_hang(10):
        try:
            img = decode_image(data)
        except Exception as err:  # the reader counts the sample unreadable (stream._Reader) and reads on
            event(f"unreadable: {type(err).__name__}")
            return
    event("decoded")
    assert img.dtype == torch.uint8  # a 16-bit PNG too
    assert tuple(img.shape) == (3, h, w) and hw == (h, w)


def test_an_image_beyond_the_decompression_bomb_limit_is_skipped_naming_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64 x 64 = 4096 > 2 x the limit: PIL's error
    Image.new("RGB", (64, 64)).save(tmp_path / "bomb.png")
    Image.new("RGB", (30, 30)).save(tmp_path / "fine.png")  # under the limit: read
    _, stored, error = encode_job((0, str(tmp_path / "bomb.png"), 16, 95, "jpg"))
    assert stored is None and error.startswith("DecompressionBombError: Image size (4096 pixels) exceeds limit")
    assert encode_job((1, str(tmp_path / "fine.png"), 16, 95, "jpg"))[1] is not None


# ---- config YAML ----------------------------------------------------------------------------------------------------

SECTIONS = {f: sorted(Config().to_dict()[f]) for f in Config().to_dict() if isinstance(Config().to_dict()[f], dict)}
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=12),
    st.sampled_from(["auto", "off", "on", "1e-3", "cpu", "weighted", "nan", "-inf"]),
)  # fmt: skip
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner))
settings_of = st.sampled_from(sorted(SECTIONS)).flatmap(
    lambda s: st.dictionaries(st.sampled_from(SECTIONS[s]) | st.text(max_size=8), values, max_size=3).map(
        lambda d: {s: d}
    )
)
documents = st.one_of(
    st.lists(settings_of, max_size=4).map(lambda parts: {k: v for p in parts for k, v in p.items()}).map(yaml.dump),
    st.text(max_size=60),  # any text, YAML or not
    st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
)


@given(documents)
def test_a_config_file_loads_or_fails_with_one_named_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    try:
        cfg = load_config(path)
    except ConfigError as err:
        assert "\n" not in str(err), str(err)
        event("refused: ConfigError")
        return
    event("loaded")
    assert isinstance(cfg, Config)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("train:\n  device: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"config file {path} is not UTF-8 text"):
        load_config(path)


# ---- the discovery layout -------------------------------------------------------------------------------------------

class_names = st.text(st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)), min_size=1, max_size=8)
class_names = class_names.filter(lambda n: n not in (".", ".."))
file_names = st.sampled_from(["a.png", "b..png", "..c.png", "d.PNG", "g.png", "e.txt", "f"])  # mostly images


@settings(max_examples=scaled(30))
@given(
    st.dictionaries(class_names, st.lists(file_names, min_size=1, max_size=3, unique=True), max_size=4),
    st.lists(file_names, max_size=3, unique=True),
    st.sampled_from(["none", "loop", "up", "self", "sibling"]),
)
def test_a_discovery_folder_reads_every_image_once_or_names_the_problem(tmp_path_factory, classes, pool, link):
    root = tmp_path_factory.mktemp("disc")
    for name, files in {**{f"labelled/{c}": f for c, f in classes.items()}, "unlabelled": pool}.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for f in files:
            if _is_image(f):
                Image.new("RGB", (4, 4)).save(root / name / f, "PNG")
            else:
                (root / name / f).touch()
    first = next(iter(sorted(classes)), None)
    if first is not None and link != "none":
        target = {"loop": ".", "up": "..", "self": "linked", "sibling": f"../{sorted(classes)[-1]}"}[link]
        os.symlink(target, root / "labelled" / first / "linked")  # "self": a link to itself (ELOOP)
    with no_hang(20):
        try:
            raw = read_dataset("discovery", root)
        except LayoutError as err:
            assert "\n" not in str(err)
            event("refused: LayoutError")
            return
    event("read")
    images = [p for p in raw.train if not isinstance(p, np.ndarray)]
    real = [os.path.realpath(p) for p in images]
    assert len(set(real)) == len(real)  # every image once, however links lead back into the tree
    expected = {str((root / "labelled" / c / f).resolve()) for c, fs in classes.items() for f in fs if _is_image(f)}
    expected |= {str((root / "unlabelled" / f).resolve()) for f in pool if _is_image(f)}
    assert set(real) == expected
    assert raw.class_names == sorted(classes)


def _is_image(name: str) -> bool:
    return name.lower().endswith(".png")


# ---- manifest.json --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards_folder(tmp_path_factory) -> Path:
    """make-shards' output for a small discovery folder (2 classes, a pool)."""
    root = tmp_path_factory.mktemp("mf")
    rng = np.random.default_rng(0)
    for name, n in (("labelled/a", 3), ("labelled/b", 3), ("unlabelled", 4)):
        (root / name).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (12, 10, 3), np.uint8)).save(root / name / f"{i}.png")
    make_shards("discovery", root, root / "out", resize=8, workers=1, progress=False)
    return root / "out"


def _mutations(manifest: dict):
    """A manifest with one field at any depth deleted or replaced by another JSON value."""
    paths = []

    def walk(node, path):
        paths.append(path)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
        for k, v in items:
            walk(v, (*path, k))

    walk(manifest, ())
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-5, 10**6) | st.text(max_size=6),
        lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
        max_leaves=4,
    )
    return st.tuples(st.sampled_from(paths[1:]), st.booleans(), json_values)


@settings(max_examples=scaled(40))
@given(data=st.data())
def test_a_damaged_manifest_reads_or_ends_in_one_named_error(shards_folder, tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("copy")
    for f in shards_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((shards_folder / "manifest.json").read_text())
    how = data.draw(st.sampled_from(["field", "field", "field", "cut", "bytes"]), label="damage")
    if how == "field":
        path, delete, value = data.draw(_mutations(manifest), label="mutation")
        node = manifest
        for k in path[:-1]:
            node = node[k]
        if delete and isinstance(node, dict):
            del node[path[-1]]
        else:
            node[path[-1]] = value
        text = json.dumps(manifest).encode()
    elif how == "cut":
        whole = (shards_folder / "manifest.json").read_bytes()
        text = whole[: data.draw(st.integers(0, 10**6)) % len(whole)]
    else:
        text = data.draw(st.binary(max_size=80))
    (folder / "manifest.json").write_bytes(text)
    # a split listing no shard ends in IndexError in intake.index_locations: the known `eval --split test` issue,
    # fixed on its own (issue 33), so not drawn here
    assume(how != "field" or not _lists_no_train_shard(manifest))
    with no_hang(60):
        try:
            source = ShardSource(folder, ReadOptions(num_workers=0, cache="off", intake=_intake(folder)))
        except (ManifestError, FileNotFoundError) as err:
            assert "\n" not in str(err) and str(folder) in str(err)
            event(f"refused: {type(err).__name__}")
            return
        got = sum(len(b.uq) for b in source.feature_batches(4))
        event("read")
    assert got + len(source.unreadable()) >= len(source.index)


def _lists_no_train_shard(manifest: dict) -> bool:
    splits = manifest.get("splits")
    train = splits.get("train") if isinstance(splits, dict) else None
    return isinstance(train, dict) and train.get("shards") == []


def _intake(folder: Path):
    from infosieve_fast.config.settings import IntakeConfig

    return IntakeConfig(index_cache=str(folder / "index"))
