"""make-shards: exact round trips of the two real folders, a JPEG round trip, corrupt inputs, truncated shards, resume
after kill, no-op rerun.

Exact round trips: `cifar10_test` (ImageFolder layout, 10,000 images) and `cub100` (CUB-style files, 5,902 images) are
sharded in full with the lossless `--image-format png` (once per session); every sample's label, labelled flag and uq
is compared with the source, and every decoded image with the source after the same resize, for uint8 equality. The
default JPEG format is lossy: a smaller real tree checks it image by image against a PSNR bound. The tar reader and
the stream are both used to read images back.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
from infosieve_fast.data.splits import gcd_split
from infosieve_fast.data.writing.layouts import read_dataset
from infosieve_fast.data.writing.shards import (
    MANIFEST,
    STATE,
    ShardsError,
    add_cli_arguments,
    load_rgb,
    make_shards,
    resize_image,
    resized_size,
    run_cli,
)

REAL = [
    ("cifar10_test", "imagefolder", ("cifar10_test", "test")),
    ("cub100", "cubfiles", ("cub100",)),
]


def _tar_samples(path: Path) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            key, ext = m.name.split(".", 1)
            out.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return out


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _want(source, size: int = 256) -> np.ndarray:
    """The source image after make-shards' resize, H x W x 3 uint8, with its expected shape checked."""
    src = load_rgb(source)
    want = np.asarray(resize_image(src, size))
    assert want.shape == (*resized_size(src.width, src.height, size)[::-1], 3)
    return want


def _check_shard(job: tuple) -> tuple[list[tuple[int, int, int]], list[tuple[int, float]]]:
    """Every sample of one shard: (uq, cls, lab) and, if `decode`, per image (uq, PSNR against the resized source;
    99 = equal).

    Runs in a worker process; the image comparison is independent of the stream's decoder (PIL here)."""
    path, ext, sources, decode = job
    meta, quality = [], []
    for key, s in _tar_samples(path).items():
        uq = int(s["uq"])
        assert key == f"{uq:08d}" and set(s) == {ext, "cls", "uq", "lab"}, (path, key, sorted(s))
        meta.append((uq, int(s["cls"]), int(s["lab"])))
        if not decode:
            continue
        stored = np.asarray(Image.open(io.BytesIO(s[ext])).convert("RGB"))
        want = _want(sources[uq])
        assert stored.shape == want.shape, (path, uq, stored.shape, want.shape)
        quality.append((uq, 99.0 if np.array_equal(stored, want) else _psnr(stored, want)))
    return meta, quality


def _round_trip(dataset: str, root: Path, out: Path, manifest: dict, ext: str, decode: bool = True) -> np.ndarray:
    """Check every train sample of `out` (read from the tars) against the source: key, uq, target, labelled flag and
    (`decode`) the image; returns the PSNR of each image by uq (99 = equal; NaN without `decode`)."""
    import multiprocessing as mp

    raw = read_dataset(dataset, root)
    labelled, targets = gcd_split(raw.train_labels, raw.known, novel_classes=raw.novel)
    n = len(raw.train)
    assert manifest["counts"]["written_train"] == n and manifest["skipped"] == []
    assert manifest["counts"]["labelled"] == labelled.sum() == int(0.5 * np.isin(raw.train_labels, raw.known).sum())
    assert manifest["n_old"] == len(raw.known) and manifest["classes"]["names"][0] == raw.class_names[raw.known[0]]
    assert manifest["image_format"] == manifest["fingerprint"]["image_format"] == ext
    jobs = [(out / rec["name"], ext, raw.train, decode) for rec in manifest["splits"]["train"]["shards"]]
    seen = np.zeros(n, int)
    psnr = np.full(n, np.nan)
    with mp.get_context("fork").Pool(2) as pool:
        for meta, quality in pool.imap_unordered(_check_shard, jobs):
            for uq, cls, lab in meta:
                seen[uq] += 1
                assert cls == targets[uq] and bool(lab) == labelled[uq], uq
            for uq, q in quality:
                psnr[uq] = q
    assert (seen == 1).all()
    return psnr


@pytest.fixture(scope="session")
def real_shards(realdata, tmp_path_factory):
    """Both real folders written in full as lossless (PNG) shards, once per test session."""
    base = tmp_path_factory.mktemp("real_shards")
    out = {}
    for name, dataset, parts in REAL:
        root = realdata.joinpath(*parts)
        manifest = make_shards(
            dataset, root, base / name, shard_size_mb=48, workers=2, progress=False, image_format="png"
        )
        out[name] = (dataset, root, base / name, manifest)
    return out


@pytest.mark.parametrize("name, reader", [("cifar10_test", "tar"), ("cub100", "stream")])
def test_round_trip_exact(real_shards, name, reader):
    """Every label, labelled flag, uq and image (uint8, after the resize) equals the source.

    The images are read back with PIL straight from the tars (cifar10_test), or as the trainer reads them, through the
    streaming `ShardSource` with 2 workers (cub100: every uq once, with its target and flag). The stream's fixed
    256x256 centre crop is the whole stored image here: both folders hold square images only (checked)."""
    dataset, root, out, manifest = real_shards[name]
    assert len(manifest["splits"]["train"]["shards"]) >= 2
    psnr = _round_trip(dataset, root, out, manifest, "png", decode=reader == "tar")
    if reader == "stream":
        raw = read_dataset(dataset, root)
        labelled, targets = gcd_split(raw.train_labels, raw.known, novel_classes=raw.novel)
        src = ShardSource(out, ReadOptions(memory_threshold_mb=0, num_workers=2))
        assert (src.n_train, src.n_old, src.n_classes) == (len(raw.train), 50, 100) and not src.in_memory
        for b in src.feature_batches(256):
            assert b.images.shape[1:] == (3, 256, 256) and b.images.dtype == torch.uint8
            np.testing.assert_array_equal(b.targets.numpy(), targets[b.uq.numpy()])
            np.testing.assert_array_equal(b.labelled.numpy(), labelled[b.uq.numpy()])
            for img, uq in zip(b.images, b.uq.tolist(), strict=True):
                want = _want(raw.train[uq])
                assert want.shape == (256, 256, 3) and np.isnan(psnr[uq])  # square source; each uq once
                got = img.permute(1, 2, 0).numpy()
                psnr[uq] = 99.0 if np.array_equal(got, want) else _psnr(got, want)
    differ = np.flatnonzero(psnr != 99.0)
    assert len(differ) == 0, f"{len(differ)} images differ from (or miss) the source, e.g. uq {differ[:5].tolist()}"


def test_round_trip_jpeg(realdata, tmp_path):
    """The default (lossy) JPEG shards: exact bookkeeping, every image within PSNR 30 dB of the resized source, the
    same through the stream; an output folder from before `--image-format` (no format in its fingerprint) is taken as
    JPEG."""
    tree = tmp_path / "raw"
    _small_tree(realdata, tree, 12, classes=12)
    out = tmp_path / "out"
    manifest = make_shards("imagefolder", tree, out, shard_size_mb=0.5, workers=2, progress=False)
    assert len(manifest["splits"]["train"]["shards"]) >= 2
    psnr = _round_trip("imagefolder", tree, out, manifest, "jpg")
    assert (psnr > 30).all() and (psnr < 99).any(), psnr.min()  # lossy, but close
    raw = read_dataset("imagefolder", tree)
    for threshold in (0, 1e6):  # the stream decodes JPEG shards on both paths
        src = ShardSource(out, ReadOptions(memory_threshold_mb=threshold, num_workers=2))
        n = 0
        for b in src.feature_batches(64):
            for img, uq in zip(b.images, b.uq.tolist(), strict=True):
                assert _psnr(img.permute(1, 2, 0).numpy(), _want(raw.train[uq])) > 30
                n += 1
        assert n == len(raw.train)
    legacy = json.loads((out / MANIFEST).read_text())
    del legacy["image_format"], legacy["fingerprint"]["image_format"], legacy["fingerprint"]["png_compress_level"]
    (out / MANIFEST).write_text(json.dumps(legacy))
    assert make_shards("imagefolder", tree, out, shard_size_mb=0.5, workers=2, progress=False) == legacy
    with pytest.raises(ShardsError, match="other settings.*image_format"):
        make_shards("imagefolder", tree, out, shard_size_mb=0.5, workers=2, progress=False, image_format="png")


def test_rerun_is_noop_and_other_dataset_refused(real_shards, capfd):
    dataset, root, out, manifest = real_shards["cifar10_test"]
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = make_shards(dataset, root, out, shard_size_mb=48, workers=2, progress=True, image_format="png")
    assert again == manifest
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    assert "nothing to do" in capfd.readouterr().err
    cub_dataset, cub_root, _, _ = real_shards["cub100"]
    with pytest.raises(ShardsError, match="another --out"):
        make_shards(cub_dataset, cub_root, out, progress=False)
    with pytest.raises(ShardsError, match="other settings"):
        make_shards(dataset, root, out, shard_size_mb=48, resize=128, workers=2, progress=False, image_format="png")
    with pytest.raises(ShardsError, match=r"other settings \(image_format, jpeg_quality, png_compress_level\)"):
        make_shards(dataset, root, out, shard_size_mb=48, workers=2, progress=False)  # jpg: the default
    import argparse

    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args(["--dataset", cub_dataset, "--root", str(cub_root), "--out", str(out), "--no-progress"])
    assert run_cli(args) == 2
    assert "holds shards of dataset 'imagefolder'" in capfd.readouterr().err


def _small_tree(realdata: Path, dst: Path, per_class: int, classes: int = 4) -> None:
    for c in range(classes):
        files = sorted((realdata / "cub100" / "images").iterdir())[c]
        for f in sorted(files.iterdir())[:per_class]:
            (dst / files.name).mkdir(parents=True, exist_ok=True)
            os.symlink(f, dst / files.name / f.name)


def test_corrupt_jpeg_skipped_and_reported(realdata, tmp_path, capfd):
    tree = tmp_path / "raw"
    _small_tree(realdata, tree, 6)
    cls = sorted(p.name for p in tree.iterdir())
    (tree / cls[0] / "zz_garbage.jpg").write_bytes(b"this is not a jpeg" * 50)
    good = sorted((tree / cls[3]).iterdir())[0].read_bytes()
    (tree / cls[3] / "zz_truncated.jpg").write_bytes(good[: len(good) // 3])
    manifest = make_shards("imagefolder", tree, tmp_path / "out", workers=2, progress=False)
    err = capfd.readouterr().err
    assert "zz_garbage.jpg" in err and "zz_truncated.jpg" in err and "2 unreadable image(s) skipped" in err
    skipped = {Path(s["source"]).name: s for s in manifest["skipped"]}
    assert set(skipped) == {"zz_garbage.jpg", "zz_truncated.jpg"}
    assert manifest["counts"]["train"] == 26 and manifest["counts"]["written_train"] == 24
    # uq values are compacted over the skipped ones so that they run over 0..n_train-1
    for threshold in (0, 1e6):
        src = ShardSource(tmp_path / "out", ReadOptions(memory_threshold_mb=threshold, num_workers=0))
        assert src.n_train == 24
        uq = torch.cat([b.uq for b in src.feature_batches(5)])
        assert sorted(uq.tolist()) == list(range(24))


def test_truncated_shard_reported_then_repaired(realdata, tmp_path, capfd):
    tree = tmp_path / "raw"
    _small_tree(realdata, tree, 10)
    out = tmp_path / "out"
    manifest = make_shards("imagefolder", tree, out, shard_size_mb=0.1, workers=1, progress=False)
    recs = manifest["splits"]["train"]["shards"]
    assert len(recs) >= 4
    victim = out / recs[1]["name"]
    original = victim.read_bytes()
    victim.write_bytes(original[: len(original) // 2])
    capfd.readouterr()
    for threshold in (0, 1e6):  # streaming and in-memory: reported, not fatal
        src = ShardSource(out, ReadOptions(memory_threshold_mb=threshold, num_workers=2))
        n = sum(len(b.uq) for b in src.feature_batches(8))
        assert recs[1]["written"] // 2 - 1 <= 40 - n <= recs[1]["written"]
        err = capfd.readouterr().err
        assert "truncated or damaged" in err and recs[1]["name"] in err and "in no readable shard" in err
        lost = src.unreadable()
        assert len(lost) == 40 - n and all(src.describe(u)["shard"] is None for u in lost)
    src = ShardSource(out, ReadOptions(memory_threshold_mb=0, num_workers=2))
    batches = list(src.train_batches(4, epoch=0, seed=0))
    assert len(batches) == n // 4  # N draws from the readable samples only
    assert not set(torch.cat([b.uq for b in batches]).tolist()) & set(lost)
    make_shards("imagefolder", tree, out, shard_size_mb=0.1, workers=1, progress=False)  # repairs
    assert victim.read_bytes() == original
    assert json.loads((out / MANIFEST).read_text()) == manifest


def test_killed_make_shards_resumes(realdata, tmp_path):
    tree = tmp_path / "raw"
    _small_tree(realdata, tree, 50, classes=6)
    ref = make_shards("imagefolder", tree, tmp_path / "ref", shard_size_mb=0.1, workers=1, progress=False)
    out = tmp_path / "out"
    code = (
        "from infosieve_fast.data.writing.shards import make_shards; "
        f"make_shards('imagefolder', {str(tree)!r}, {str(out)!r}, shard_size_mb=0.1, workers=1, progress=False)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[1])
    state = out / STATE
    deadline = time.time() + 60
    while time.time() < deadline:
        if state.exists():
            try:
                if len(json.loads(state.read_text())["done"]["train"]) >= 3:
                    break
            except (json.JSONDecodeError, KeyError):
                pass
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / MANIFEST).exists(), "make-shards finished before it could be killed"
    done = json.loads(state.read_text())["done"]["train"]
    assert 3 <= len(done) < len(ref["splits"]["train"]["shards"])
    (out / "imagefolder-train-09999.tar.tmp").write_bytes(b"half-written")  # what a kill mid-shard leaves
    manifest = make_shards("imagefolder", tree, out, shard_size_mb=0.1, workers=1, progress=False)
    assert [r["sha256"] for r in manifest["splits"]["train"]["shards"]] == [
        r["sha256"] for r in ref["splits"]["train"]["shards"]
    ]
    assert not state.exists() and not list(out.glob("*.tmp"))


def test_a_dataset_already_read_gives_the_shards_of_its_folder(realdata, tmp_path):
    # make_shards takes a RawDataset in place of a folder (the benchmarks' synthetic sets): the same shards, bytewise
    tree = tmp_path / "raw"
    _small_tree(realdata, tree, 3)
    from_folder = make_shards("imagefolder", tree, tmp_path / "a", workers=1, progress=False)
    raw = read_dataset("imagefolder", tree)
    from_raw = make_shards("imagefolder", raw, tmp_path / "b", workers=1, progress=False)
    shards = lambda m: [(r["name"], r["sha256"]) for s in ("train", "test") for r in m["splits"][s]["shards"]]
    assert shards(from_raw) == shards(from_folder) and from_raw["counts"] == from_folder["counts"]
    with pytest.raises(ShardsError, match="known_classes applies to a dataset read from its folder"):
        make_shards("imagefolder", raw, tmp_path / "c", known_classes=[0], progress=False)
