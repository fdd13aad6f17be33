"""Tiny inputs that asked for huge allocations or ran code: each is refused before anything is allocated (or run), in
one line naming the input, while a well-formed input of the same kind still reads. Each case failed before the fix:
the decoders were called on any header (a JPEG claiming 65500 x 65500 pixels asked for 12.9 GB), a `.cls` of
99999999999 sized the class list at 400 GB, YAML aliases expanded in memory, the k-means and seed settings had no
upper bound, and CIFAR batches were read with `pickle.load`."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from infosieve_fast.common import limits
from infosieve_fast.config.settings import ConfigError, IntakeConfig, load_config
from infosieve_fast.data.reading import decode
from infosieve_fast.data.reading.intake import open_foreign
from infosieve_fast.data.reading.stream import decode_image
from infosieve_fast.data.reading.tar import SampleKeys, index_shard
from infosieve_fast.data.writing.cifar_pickle import read_batch
from infosieve_fast.data.writing.encode import encode_job
from infosieve_fast.data.writing.layouts import read_dataset

from .test_fuzz_shards import png_header


def jpeg_header(h: int, w: int) -> bytes:
    """The first bytes of a baseline JPEG of h x w (SOI, then a start-of-frame segment): all its header says."""
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, h, w, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    return b"\xff\xd8" + sof + b"\xff\xda" + b"\x00" * 64


def small_jpeg(h: int = 12, w: int = 10) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 90, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def decoders_must_not_run(monkeypatch):
    """torchvision's decoders replaced by ones that fail the test: a bomb must be refused before any decoder runs."""

    def called(*args, **kwargs):
        raise AssertionError("the decoder was called on an image above the pixel limit")

    for name in ("decode_jpeg", "decode_png", "nvjpeg_decode"):
        monkeypatch.setattr(decode, name, called)


@pytest.mark.parametrize("header", [jpeg_header(65500, 65500), png_header(30000, 30000)], ids=["jpeg", "png"])
def test_a_header_claiming_too_many_pixels_is_refused_before_decoding(header, decoders_must_not_run):
    with pytest.raises(limits.ImageTooLarge, match=r"image of [\d,]+ x [\d,]+ = [\d,]+ pixels is above the limit"):
        decode_image(header)
    # the GPU route: the bomb never reaches nvJPEG, and only that image is lost
    counts = decode.DecodeCounts()
    assert decode.decode_gpu([decode.torch.frombuffer(bytearray(header), dtype=decode.torch.uint8)], "cpu", counts) == [
        None
    ]


def test_an_image_under_the_limit_still_decodes():
    img = decode_image(small_jpeg(12, 10))
    assert tuple(img.shape) == (3, 12, 10)


def test_the_shard_index_skips_a_bomb_naming_it_and_keeps_the_rest(tmp_path):
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w") as tar:
        for key, image in (("a", small_jpeg()), ("bomb", png_header(30000, 30000)), ("b", small_jpeg(8, 9))):
            for ext, data in (("jpg", image), ("cls", b"1"), ("uq", b"0"), ("lab", b"1")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    rows, problems = index_shard(str(path), SampleKeys())
    assert rows[:, 2:4].tolist() == [[12, 10], [8, 9]]
    assert len(problems) == 1 and "1 unreadable (first: bomb: image of 30,000 x 30,000" in problems[0]


def test_the_folder_route_uses_the_same_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "MAX_IMAGE_PIXELS", 1000)  # PIL's own default (89M) is untouched: the shared one reads
    Image.new("RGB", (40, 30)).save(tmp_path / "big.png")
    Image.new("RGB", (30, 30)).save(tmp_path / "fine.png")
    _, stored, error = encode_job((0, str(tmp_path / "big.png"), 16, 95, "jpg"))
    assert stored is None and error.startswith("ImageTooLarge: image of 40 x 30 = 1,200 pixels is above the limit")
    assert encode_job((1, str(tmp_path / "fine.png"), 16, 95, "jpg"))[1] is not None


# ---- labels ---------------------------------------------------------------------------------------------------------


def foreign_shard(path: Path, labels: list[bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for i, label in enumerate(labels):
            for ext, data in (("jpg", small_jpeg()), ("cls", label)):
                info = tarfile.TarInfo(f"s{i:03d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_a_huge_label_is_skipped_naming_shard_and_sample_before_the_classes_are_counted(tmp_path):
    foreign_shard(tmp_path / "a.tar", [b"0", b"1", b"99999999999", b"3"])
    opened = open_foreign(str(tmp_path / "a.tar"), IntakeConfig(index_cache=str(tmp_path / "index")))
    assert len(opened.index) == 3 and len(opened.class_names) == 4  # ids 0..3: the bomb sized nothing
    [problem] = opened.problems
    assert problem.startswith(str(tmp_path / "a.tar")) and "s002: label 99,999,999,999 is above" in problem
    assert "\n" not in problem


# ---- config ---------------------------------------------------------------------------------------------------------


def test_yaml_aliases_are_refused_at_load(tmp_path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    (tmp_path / "c.yaml").write_text(bomb + "model:\n  backbone_kwargs: {depth: *b}\n")
    with pytest.raises(ConfigError, match=r"^config file .*c.yaml is not valid YAML: YAML anchors and aliases") as err:
        load_config(tmp_path / "c.yaml")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^override 'model.backbone_kwargs=.*anchors and aliases"):
        load_config(None, ["model.backbone_kwargs={a: &x [1], b: *x}"])


def test_no_shipped_config_uses_anchors():
    for path in sorted(Path("configs").glob("*.yaml")):
        load_config(path)  # refused if it did


@pytest.mark.parametrize(
    "override, message",
    [
        ("kmeans.n_clusters=1000000000", r"kmeans.n_clusters must be null, an integer in \[2, 1,000,000\] or auto"),
        ("kmeans.max_iter=1000000000000", r"kmeans.max_iter must lie in \[1, 10000\], got 1000000000000"),
        ("kmeans.n_init=100000", r"kmeans.n_init must lie in \[1, 1000\]"),
        ("train.seed=-1", r"train.seed must lie in \[0, 4294967295\], got -1"),
        ("train.seed=4294967296", r"train.seed must lie in \[0, 4294967295\]"),
        ("checkpoint.holdout_seed=-3", r"checkpoint.holdout_seed must lie in \[0, 4294967295\]"),
        ("data.intake.split_seed=18446744073709551616", r"data.intake.split_seed must lie in \[0, 4294967295\]"),
        ("data.digits.split_seed=-1", r"data.digits.split_seed must lie in"),
        ("data.crop_size=100000", r"data.crop_size must lie in \[1, 9459\]"),
        ("data.digits.image_size=0", r"data.digits.image_size must lie in \[1, 9459\]"),
        ("data.num_workers=-1", r"data.num_workers must lie in \[0, 256\]"),
        ("data.memory_threshold_mb=nan", r"data.memory_threshold_mb must be >= 0"),
        ("data.color_jitter=-0.5", r"data.color_jitter must be >= 0"),
        ("train.max_steps_per_epoch=0", r"train.max_steps_per_epoch must be >= 1 \(or null: a full epoch\)"),
        ("train.train_subset=-5", r"train.train_subset must be >= 1"),
        ("data.std=[0.2, 0, 0.2]", r"data.std must be a list of numbers > 0, one per channel"),
        ("data.mean=[0.5, .nan, 0.5]", r"data.mean must be a list of numbers finite, one per channel"),
    ],
)
def test_numeric_settings_are_bounded_at_load(override, message):
    with pytest.raises(ConfigError, match="^" + message) as err:
        load_config(None, [override])
    assert "\n" not in str(err.value)


def test_the_bounds_themselves_load():
    cfg = load_config(None, ["train.seed=4294967295", "kmeans.n_clusters=1000000", "kmeans.max_iter=10000"])
    assert (cfg.train.seed, cfg.kmeans.n_clusters, cfg.kmeans.max_iter) == (2**32 - 1, 10**6, 10_000)


# ---- CIFAR batches --------------------------------------------------------------------------------------------------


class _Hostile:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_cifar_batch_that_calls_a_function_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        (folder / name).write_bytes(pickle.dumps({b"data": _Hostile()}, protocol=4))
    with pytest.raises(ValueError, match=r"data_batch_1 is not a CIFAR batch file \(it calls posix.system"):
        read_dataset("cifar10", tmp_path)  # what make-shards --dataset cifar10 reads
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("protocol", [2, 5])
def test_a_real_format_cifar_batch_still_loads(tmp_path, protocol):
    data = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    batch = {b"batch_label": b"training batch 1 of 5", b"labels": [3, 7], b"data": data, b"filenames": [b"a.png"] * 2}
    raw = pickle.dumps(batch, protocol=protocol)
    if protocol == 2:  # the files on the CIFAR site were written by numpy 1, which names numpy.core
        raw = raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    (tmp_path / "b").write_bytes(raw)
    got = read_batch(tmp_path / "b")
    assert got["labels"] == [3, 7] and got["batch_label"] == b"training batch 1 of 5"
    np.testing.assert_array_equal(got["data"], data)


def test_a_make_shards_label_outside_the_manifest_classes_is_refused_naming_the_shard(tmp_path):
    from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
    from infosieve_fast.data.shard_manifest import ManifestError
    from infosieve_fast.data.writing.shards import make_shards

    root = tmp_path / "images"
    for name in ("labelled/a", "labelled/b", "unlabelled"):
        (root / name).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (10, 12), (40 * i, 0, 0)).save(root / name / f"{i}.png")
    make_shards("discovery", root, tmp_path / "out", resize=8, workers=1, progress=False)
    [shard] = sorted((tmp_path / "out").glob("*-train-*.tar"))
    with tarfile.open(shard) as tar:
        cls = next(m for m in tar.getmembers() if m.name.endswith(".cls") and tar.extractfile(m).read() == b"1")
    data = bytearray(shard.read_bytes())
    data[cls.offset_data] = ord("7")  # the same length: the shard's recorded size still matches
    shard.write_bytes(bytes(data))
    with pytest.raises(ManifestError) as err:
        ShardSource(
            tmp_path / "out",
            ReadOptions(num_workers=0, cache="off", intake=IntakeConfig(index_cache=str(tmp_path / "i"))),
        )
    assert str(err.value).startswith(
        f"{shard}: sample uq "
    ) and "has the .cls label 7, outside the manifest's 2" in str(err.value)


def test_a_labelled_sample_of_a_novel_class_is_refused_when_the_shards_open(tmp_path):
    """imagefolder with two classes: c0 known, c1 novel (the first half known). One c1 image's `.lab` flipped to 1 in
    the shard is refused by name when the shards open, before any method trains on it (GCD and SimGCD run no
    pseudo-label round whose check would catch it)."""
    from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
    from infosieve_fast.data.shard_manifest import ManifestError
    from infosieve_fast.data.writing.shards import make_shards

    for c in range(2):
        (tmp_path / "raw" / f"c{c}").mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (10, 12), (40 * i, 60 * c, 0)).save(tmp_path / "raw" / f"c{c}" / f"{i}.png")
    make_shards("imagefolder", tmp_path / "raw", tmp_path / "out", resize=8, workers=1, progress=False)
    options = ReadOptions(num_workers=0, cache="off", intake=IntakeConfig(index_cache=str(tmp_path / "i")))
    assert ShardSource(tmp_path / "out", options).n_old == 1  # as written, it opens
    [shard] = sorted((tmp_path / "out").glob("*-train-*.tar"))
    with tarfile.open(shard) as tar:
        members = {m.name: m for m in tar.getmembers()}
        novel = next(n for n, m in members.items() if n.endswith(".cls") and tar.extractfile(m).read() == b"1")
        lab = members[novel.removesuffix(".cls") + ".lab"]
        assert tar.extractfile(lab).read() == b"0"
    data = bytearray(shard.read_bytes())
    data[lab.offset_data] = ord("1")  # the same length: the shard's recorded size still matches
    shard.write_bytes(bytes(data))
    fresh_index = dataclasses.replace(options, intake=IntakeConfig(index_cache=str(tmp_path / "j")))
    with pytest.raises(ManifestError) as err:
        ShardSource(tmp_path / "out", fresh_index)
    said = str(err.value)
    assert said.startswith(f"{shard}: sample uq ")
    assert "is labelled with class 1 (c1), a novel one: labelled samples are of the manifest's 1 known" in said
