"""ShardSource: exactly-once passes over 2 simulated ranks x 2 workers, training epochs, labelled share, both paths."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from infosieve_fast.data.reading.sampler import reference_labelled_share
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
from infosieve_fast.data.writing.shards import make_shards

N_PER_CLASS, N_CLASSES = 30, 8  # 240 train images of real CIFAR-10 + a test split of 80


@pytest.fixture(scope="module")
def shards(realdata, tmp_path_factory) -> dict[str, Path]:
    """The same small real dataset written as many small shards and as a single shard (stored at 64 px: fast)."""
    base = tmp_path_factory.mktemp("stream")
    src = realdata / "cifar10_test" / "test"
    for cls in sorted(os.listdir(src))[:N_CLASSES]:
        files = sorted(os.listdir(src / cls))
        for i, f in enumerate(files[: N_PER_CLASS + 10]):
            dst = base / "raw" / ("test" if i >= N_PER_CLASS else "train") / cls / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(src / cls / f, dst)
    out = {}
    for name, size_mb in [("many", 0.05), ("one", 100)]:
        make_shards(
            "imagefolder", base / "raw", base / name, shard_size_mb=size_mb, resize=64, workers=2, progress=False
        )
        out[name] = base / name
    return out


N = N_PER_CLASS * N_CLASSES


def _uqs(batches) -> list[int]:
    return [u for b in batches for u in b.uq.tolist()]


@pytest.mark.parametrize("layout", ["many", "one"])  # split by shard / split by sample
@pytest.mark.parametrize("threshold", [0, 1e6])  # streaming / in memory
def test_two_ranks_two_workers_exactly_once(shards, layout, threshold):
    sources = [
        ShardSource(shards[layout], ReadOptions(memory_threshold_mb=threshold, num_workers=2), rank=r, world_size=2)
        for r in range(2)
    ]
    assert all(s.in_memory == (threshold > 0) for s in sources)
    if layout == "many" and threshold == 0:
        assert len(sources[0].urls) >= 4  # enough shards to split by shard
    per_rank = [_uqs(s.feature_batches(16)) for s in sources]
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(N))
    assert _uqs(sources[0].feature_batches(16)) == per_rank[0]  # fixed order
    test = [_uqs(s.test_batches(16)) for s in sources]
    assert sorted(test[0] + test[1]) == list(range(10 * N_CLASSES))
    # training epoch, no re-weighting: every sample at most once, the same number of full batches on each rank
    train = [
        ShardSource(
            shards[layout],
            ReadOptions(memory_threshold_mb=threshold, num_workers=2, sampling="shuffle"),
            rank=r,
            world_size=2,
        )
        for r in range(2)
    ]
    epochs = [list(s.train_batches(16, epoch=3, seed=1)) for s in train]
    assert len(epochs[0]) == len(epochs[1]) == N // 32
    assert all(len(b.uq) == 16 for e in epochs for b in e)
    got = _uqs(epochs[0]) + _uqs(epochs[1])
    if threshold > 0 or layout == "one":  # balanced split: the epoch is a permutation minus the dropped remainder
        assert len(set(got)) == len(got) == N // 32 * 32


def test_batches_carry_the_manifest_bookkeeping(shards):
    import json

    manifest = json.loads((shards["many"] / "manifest.json").read_text())
    src = ShardSource(shards["many"], ReadOptions(memory_threshold_mb=0, num_workers=2))
    mem = ShardSource(shards["many"], ReadOptions(memory_threshold_mb=1e6, num_workers=2))
    assert (src.n_train, src.n_old, src.n_classes) == (N, N_CLASSES // 2, N_CLASSES)
    a = {
        int(u): (int(t), bool(lab), img)
        for b in src.feature_batches(32)
        for u, t, lab, img in zip(b.uq, b.targets, b.labelled, b.images, strict=True)
    }
    b = {
        int(u): (int(t), bool(lab), img)
        for bb in mem.feature_batches(32)
        for u, t, lab, img in zip(bb.uq, bb.targets, bb.labelled, bb.images, strict=True)
    }
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][:2] == b[k][:2] and torch.equal(a[k][2], b[k][2])
    assert sum(lab for _, lab, _ in a.values()) == manifest["counts"]["labelled"]
    assert all(t < N_CLASSES // 2 for t, lab, _ in a.values() if lab)
    assert next(iter(a.values()))[2].shape == (3, 64, 64)


@pytest.mark.parametrize("threshold", [0, 1e6])
def test_training_stream_is_reproducible_and_varies_by_epoch(shards, threshold):
    src = ShardSource(shards["many"], ReadOptions(memory_threshold_mb=threshold, num_workers=2))
    e0 = _uqs(src.train_batches(16, epoch=0, seed=0))
    assert e0 == _uqs(src.train_batches(16, epoch=0, seed=0))
    assert e0 != _uqs(src.train_batches(16, epoch=1, seed=0))
    assert len(e0) == N // 16 * 16


@pytest.mark.parametrize("threshold", [0, 1e6])
@pytest.mark.parametrize("share", [None, 0.8])
def test_labelled_share(shards, threshold, share):
    src = ShardSource(shards["one"], ReadOptions(memory_threshold_mb=threshold, num_workers=2, labelled_share=share))
    n_lab = sum(int(b.labelled.sum()) for b in src.feature_batches(64))
    want = reference_labelled_share(n_lab, N - n_lab) if share is None else share
    labs = [b.labelled.float().mean().item() for e in range(4) for b in src.train_batches(16, epoch=e, seed=0)]
    assert abs(np.mean(labs) - want) < 0.06, (np.mean(labs), want)
    uqs = [u for e in range(2) for u in _uqs(src.train_batches(16, epoch=e, seed=0))]
    assert len(set(uqs)) < len(uqs)  # drawn with replacement, like the reference's sampler


def test_device_in_memory(shards, device):
    src = ShardSource(shards["one"], ReadOptions(memory_threshold_mb=1e6, num_workers=0), device=device)
    batch = next(iter(src.train_batches(8, epoch=0, seed=0)))
    assert batch.images.device.type == device.type and batch.uq.device.type == device.type
    assert batch.images.shape == (8, 3, 64, 64)


def _wds_samples(path: str) -> list[dict]:
    import webdataset as wds

    return [
        {k: v for k, v in s.items() if k != "__local_path__"} for s in wds.tariterators.tarfile_samples([{"url": path}])
    ]


@pytest.mark.parametrize("fmt", ["shard", "pax", "gnu", "ustar"])
def test_tar_reader_matches_webdataset(shards, tmp_path, fmt):
    """The stream's own tar reader groups members into samples exactly as webdataset does, for make-shards' tars and
    for what `tarfile` writes in each format (long names, pax headers, directories)."""
    import io
    import tarfile

    from infosieve_fast.data.reading.tar import tar_samples

    if fmt == "shard":
        path = str(next(iter(sorted(shards["one"].glob("*-train-*.tar")))))
    else:
        path = str(tmp_path / "t.tar")
        with tarfile.open(
            path, "w", format={"pax": tarfile.PAX_FORMAT, "gnu": tarfile.GNU_FORMAT, "ustar": tarfile.USTAR_FORMAT}[fmt]
        ) as tar:
            tar.addfile(_dir_info())
            prefix = "deep/" * 30 if fmt != "ustar" else "sub/"
            for i in range(4):
                for ext, data in (("JPG", b"\xff" * (700 + i)), ("cls", b"%d" % i), ("uq", b"%d" % (10 + i))):
                    info = tarfile.TarInfo(f"{prefix}k{i:03d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    ours = [dict(s) for s in tar_samples(path)]
    assert ours == _wds_samples(path) and len(ours) >= 4


def _dir_info():
    import tarfile

    info = tarfile.TarInfo("a-directory")
    info.type = tarfile.DIRTYPE
    return info


def test_tar_reader_damage(shards, tmp_path):
    """A truncated or corrupted shard: the samples before the damage, then `tarfile.ReadError`."""
    import tarfile

    from infosieve_fast.data.reading.tar import tar_samples

    shard = next(iter(sorted(shards["one"].glob("*-train-*.tar"))))
    src = shard.read_bytes()
    whole = list(tar_samples(str(shard)))
    with tarfile.open(shard) as tar:
        hdr = tar.getmembers()[41].offset  # a header in the middle
    for name, data in [("cut.tar", src[: len(src) // 2]), ("bad.tar", src[:hdr] + b"x" * 512 + src[hdr + 512 :])]:
        (tmp_path / name).write_bytes(data)
        got = []
        with pytest.raises(tarfile.ReadError):
            for s in tar_samples(str(tmp_path / name)):
                got.append(s)
        assert 0 < len(got) < len(whole) and all(
            g == {**w, "__url__": g["__url__"]} for g, w in zip(got, whole, strict=False)
        )
