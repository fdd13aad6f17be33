"""Foreign WebDataset shards: shard specs, keys, the class list, make-shards' split, the saved index, bad input."""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from infosieve_fast.config.settings import ConfigError, IntakeConfig, load_config
from infosieve_fast.data.reading.intake import expand_braces, foreign_keys, index_locations, shard_paths
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
from infosieve_fast.data.reading.tar import image_hw, index_shard
from infosieve_fast.data.writing.layouts import read_dataset
from infosieve_fast.data.writing.shards import make_shards, resize_image

wds = pytest.importorskip("webdataset")

CLASSES, PER_CLASS, SIZE = 4, 6, 64


@pytest.fixture(scope="module")
def tree(realdata, tmp_path_factory) -> Path:
    """An imagefolder tree of 4 real CUB classes x 6 images (symlinks)."""
    root = tmp_path_factory.mktemp("intake") / "raw"
    images = realdata / "cub100" / "images"
    for cls in sorted(os.listdir(images))[:CLASSES]:
        (root / cls).mkdir(parents=True)
        for f in sorted(os.listdir(images / cls))[:PER_CLASS]:
            os.symlink(images / cls / f, root / cls / f)
    return root


def _write_foreign(raw, out: Path, per_shard: int, sample) -> None:
    """The train images of `raw` in native order as TarWriter shards; `sample(i)` gives sample i's members."""
    out.mkdir(parents=True)
    for start in range(0, len(raw.train), per_shard):
        with wds.TarWriter(str(out / f"train-{start // per_shard:06d}.tar")) as sink:
            for i in range(start, min(start + per_shard, len(raw.train))):
                sink.write({"__key__": f"s{i:06d}", **sample(i)})


@pytest.fixture(scope="module")
def both(tree, tmp_path_factory):
    """The same images written by make-shards and by webdataset's TarWriter (.jpg + .cls, native order)."""
    base = tree.parent
    make_shards("imagefolder", tree, base / "made", resize=SIZE, workers=1, progress=False)
    raw = read_dataset("imagefolder", tree)
    (base / "classes.txt").write_text("".join(raw.class_names[c] + "\n" for c in range(len(raw.class_names))))
    _write_foreign(
        raw, base / "foreign", 5, lambda i: {"jpg": Path(raw.train[i]).read_bytes(), "cls": int(raw.train_labels[i])}
    )
    return base, raw


def _per_uq(src: ShardSource) -> tuple[np.ndarray, np.ndarray]:
    """(target, labelled) by uq."""
    cls = np.full(src.n_train, -1)
    cls[src.uq] = src.index.cls
    return cls, src.labelled


def test_brace_glob_folder_and_list_name_the_same_shards(both):
    base, _ = both
    folder = sorted(str(p) for p in (base / "foreign").glob("*.tar"))
    assert len(folder) == 5
    assert expand_braces("a-{08..11}-{x,y}.tar") == [f"a-{n}-{c}.tar" for n in ("08", "09", "10", "11") for c in "xy"]
    assert shard_paths(base / "foreign") == folder
    assert shard_paths(str(base / "foreign" / "train-{000000..000004}.tar")) == folder
    assert shard_paths(str(base / "foreign" / "train-*.tar")) == folder
    assert shard_paths([folder[3], str(base / "foreign" / "train-00000[0-1].tar")]) == [folder[3], *folder[:2]]
    with pytest.raises(FileNotFoundError, match="2 of the 7 shards it names are missing"):
        shard_paths(str(base / "foreign" / "train-{000000..000006}.tar"))


def test_foreign_split_equals_make_shards_split(both):
    """Per image (native index = make-shards' uq = the foreign storage order): the same target and labelled flag."""
    base, raw = both
    made = ShardSource(base / "made", ReadOptions(num_workers=0, memory_threshold_mb=0))
    opts = IntakeConfig(class_list=str(base / "classes.txt"))
    foreign = ShardSource(
        str(base / "foreign" / "train-{000000..000004}.tar"),
        ReadOptions(num_workers=0, memory_threshold_mb=0, intake=opts, resize=SIZE),
    )
    assert foreign.n_train == made.n_train == CLASSES * PER_CLASS
    assert foreign.class_names == made.class_names and foreign.n_old == made.n_old == CLASSES // 2
    cls_m, lab_m = _per_uq(made)
    cls_f, lab_f = _per_uq(foreign)
    assert (cls_m == cls_f).all() and (lab_m == lab_f).all()
    # independent property: half of each known class's images labelled (PROP 0.5), no novel image labelled
    known = raw.train_labels < CLASSES // 2
    assert lab_f.sum() == known.sum() // 2 and not lab_f[~known].any()


def test_json_label_field_by_class_name_gives_the_same_split(both, tmp_path):
    base, raw = both
    _write_foreign(
        raw,
        tmp_path / "js",
        7,
        lambda i: {
            "input.jpg": Path(raw.train[i]).read_bytes(),
            "json": {"label": raw.class_names[int(raw.train_labels[i])]},
        },
    )
    opts = IntakeConfig(
        image_keys="input.jpg", label_key="json", label_field="label", class_list=str(base / "classes.txt")
    )
    src = ShardSource(tmp_path / "js", ReadOptions(num_workers=0, memory_threshold_mb=0, intake=opts))
    ref = ShardSource(base / "made", ReadOptions(num_workers=0, memory_threshold_mb=0))
    assert [a.tolist() for a in _per_uq(src)] == [a.tolist() for a in _per_uq(ref)]


def test_full_size_images_are_resized_on_load(both):
    """The foreign shards hold the original CUB images; served at shorter side 64 like make-shards' resize."""
    base, raw = both
    src = ShardSource(
        base / "foreign",
        ReadOptions(
            num_workers=0, memory_threshold_mb=0, resize=SIZE, intake=IntakeConfig(class_list=str(base / "classes.txt"))
        ),
    )
    batch = next(src.feature_batches(4))
    sizes = batch.sizes if batch.sizes is not None else torch.tensor([batch.images.shape[2:]] * len(batch.uq))
    for img, size, uq in zip(batch.images, sizes, batch.uq.tolist(), strict=True):
        with Image.open(raw.train[uq]) as im:
            want = np.asarray(resize_image(im.convert("RGB"), SIZE))  # PIL bicubic antialiased: make-shards' resize
        h, w = size.tolist()
        assert (h, w) == want.shape[:2] and min(h, w) == SIZE
        got = img[:, :h, :w].permute(1, 2, 0).numpy().astype(float)
        assert np.abs(got - want).mean() < 3.0  # two bicubic resamplers of the same image


def test_index_is_saved_reused_and_rebuilt_when_a_shard_changes(both, tmp_path):
    base, _ = both
    folder = tmp_path / "copy"
    folder.mkdir()
    for p in sorted((base / "foreign").glob("*.tar")):
        (folder / p.name).write_bytes(p.read_bytes())
    opts = IntakeConfig(class_list=str(base / "classes.txt"), index_cache=str(tmp_path / "cache"))
    first = ShardSource(folder, ReadOptions(num_workers=0, memory_threshold_mb=0, intake=opts))
    again = ShardSource(folder, ReadOptions(num_workers=0, memory_threshold_mb=0, intake=opts))
    assert not first.reused_index and again.reused_index
    assert all((getattr(first.index, k) == getattr(again.index, k)).all() for k in ("offset", "length", "hw", "cls"))
    assert len(list(folder.glob(".infosieve-index-*.npz"))) == 1
    shard = folder / "train-000001.tar"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert not ShardSource(folder, ReadOptions(num_workers=0, memory_threshold_mb=0, intake=opts)).reused_index


def test_index_goes_to_the_cache_folder_when_the_shards_folder_is_not_writable(both, tmp_path):
    base, _ = both
    opts = IntakeConfig(class_list=str(base / "classes.txt"), index_cache=str(tmp_path / "cache"))
    urls = shard_paths(base / "foreign")
    beside, cached = index_locations(urls, {"kind": "foreign", "keys": repr(foreign_keys(opts))}, opts.index_cache)
    beside.unlink(missing_ok=True)
    beside.mkdir()  # the index file cannot be written there (what a read-only folder does)
    try:
        first = ShardSource(base / "foreign", ReadOptions(num_workers=0, memory_threshold_mb=0, intake=opts))
        again = ShardSource(base / "foreign", ReadOptions(num_workers=0, memory_threshold_mb=0, intake=opts))
    finally:
        beside.rmdir()
    assert cached.is_file() and not first.reused_index and again.reused_index


def _jpeg(size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size[1], size[0], 3), 90, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_missing_keys_are_counted_per_key(tmp_path):
    path = tmp_path / "mixed.tar"
    with wds.TarWriter(str(path)) as sink:
        for i in range(3):
            sink.write({"__key__": f"ok{i}", "jpeg": _jpeg(), "cls": 1})
        for i in range(2):
            sink.write({"__key__": f"nolabel{i}", "webp": _jpeg(), "cls2": 1})
        sink.write({"__key__": "noimage", "txt": "x", "cls": 0})
    rows, problems = index_shard(str(path), foreign_keys(IntakeConfig()))
    assert len(rows) == 3 and rows[:, 4].tolist() == [1, 1, 1]
    assert len(problems) == 1
    assert "2 with no 'cls' member" in problems[0] and "1 with no image (none of jpg, jpeg, png, webp)" in problems[0]
    assert "data.intake.image_keys" in problems[0]


def test_gzipped_shard_is_reported_as_compressed_with_its_sample_count(tmp_path):
    plain = tmp_path / "plain.tar"
    with wds.TarWriter(str(plain)) as sink:
        for i in range(4):
            sink.write({"__key__": f"k{i}", "jpg": _jpeg(), "cls": i})
    packed = tmp_path / "packed.tar.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    rows, problems = index_shard(str(packed), foreign_keys(IntakeConfig()))
    assert len(rows) == 0 and len(problems) == 1
    assert "gzip-compressed shard: its 4 samples are skipped" in problems[0] and "gunzip" in problems[0]


def test_jpeg_with_metadata_longer_than_64k_is_read(tmp_path):
    plain = _jpeg((41, 29))
    app = [b"\xff\xe2" + struct.pack(">H", 60002) + bytes(60000) for _ in range(3)]  # 180 KB of APP2 (an ICC profile)
    big = plain[:2] + b"".join(app) + plain[2:]
    assert image_hw(big) == (29, 41)
    path = tmp_path / "icc.tar"
    with wds.TarWriter(str(path)) as sink:
        sink.write({"__key__": "big", "jpg": big, "cls": 0})
    rows, problems = index_shard(str(path), foreign_keys(IntakeConfig()))
    assert problems == [] and rows[:, 2:4].tolist() == [[29, 41]]


def test_config_keys_are_checked_at_load(tmp_path):
    cfg = load_config("configs/demo.yaml", ["data.shards=[a.tar, b.tar]", "data.intake.label_field=label"])
    assert cfg.data.shards == [os.path.abspath("a.tar"), os.path.abspath("b.tar")]
    assert cfg.data.intake.label_field == "label"
    with pytest.raises(ConfigError, match="data.intake.labelled_prop"):
        load_config("configs/demo.yaml", ["data.intake.labelled_prop=0"])
    with pytest.raises(ConfigError, match="data.resize"):
        load_config(None, ["data.resize=100", "data.crop_size=224"])


def test_foreign_labels_outside_the_class_list_are_reported(tmp_path):
    (tmp_path / "classes.txt").write_text("a\nb\n")
    path = tmp_path / "s.tar"
    with wds.TarWriter(str(path)) as sink:
        sink.write({"__key__": "in", "jpg": _jpeg(), "cls": 1})
        sink.write({"__key__": "out", "jpg": _jpeg(), "cls": 5})
        sink.write({"__key__": "name", "jpg": _jpeg(), "json": json.dumps({"y": "c"})})
    rows, problems = index_shard(str(path), foreign_keys(IntakeConfig(class_list=str(tmp_path / "classes.txt"))))
    assert rows[:, 4].tolist() == [1]
    assert "1 with no 'cls' member" in problems[0] and "1 unreadable (first: out: label 5 is outside" in problems[0]
    assert torch.equal(torch.tensor(rows[:, 2:4]), torch.tensor([[30, 40]]))


def test_build_source_reads_foreign_shards_from_the_config(both):
    from infosieve_fast.data import build_source

    base, raw = both
    overrides = [
        f"data.shards={base / 'foreign' / 'train-*.tar'}",
        f"data.intake.class_list={base / 'classes.txt'}",
        "data.intake.known_classes=[1, 3]",
        "data.num_workers=0",
        f"data.resize={SIZE}",
        "data.crop_size=32",
    ]
    cfg = load_config(None, overrides)
    src = build_source(cfg.data, cfg.train)
    assert src.n_train == len(raw.train) and src.size == SIZE
    assert src.class_names[:2] == [raw.class_names[1], raw.class_names[3]]  # known classes first, in the given order
    known = np.isin(raw.train_labels, [1, 3])
    assert src.labelled.sum() == known.sum() // 2 and not src.labelled[~known].any()
