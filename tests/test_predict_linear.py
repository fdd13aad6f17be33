"""`infosieve predict` on shards reads each image by offset: the same bytes per image whatever the shard's size, and
no rescan of the tar (the work per image was proportional to its position in the shard before)."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
from PIL import Image

from infosieve_fast.commands import predict
from infosieve_fast.data.reading import tar
from infosieve_fast.data.writing.shards import make_shards

wds = pytest.importorskip("webdataset")


def _jpeg(i: int) -> bytes:
    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (20 + i % 7, 30 + i % 5, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _shard(path, n: int) -> dict[str, bytes]:
    """A TarWriter shard of n samples (.jpg + .cls); the image bytes by key."""
    images = {f"s{i:04d}": _jpeg(i) for i in range(n)}
    with wds.TarWriter(str(path)) as sink:
        for key, data in images.items():
            sink.write({"__key__": key, "jpg": data, "cls": 0})
    return images


@pytest.fixture
def counted(monkeypatch):
    """Bytes read per call of the offset reader; any full-tar scan fails the test."""
    reads: list[int] = []

    def read_span(path, offset, length):
        data = tar.read_span(path, offset, length)
        reads.append(len(data))
        return data

    def no_scan(*_):
        raise AssertionError("predict rescanned a tar")

    monkeypatch.setattr(predict, "read_span", read_span)
    monkeypatch.setattr(tar, "tar_samples", no_scan)
    return reads


def _load_all(items) -> list[np.ndarray]:
    return [predict._load(source, 32, 3, None)[0].numpy() for _, source in items]


def test_bytes_read_per_image_do_not_grow_with_the_shard(tmp_path, counted):
    for name in ("small", "big"):
        (tmp_path / name).mkdir()
    small = _shard(tmp_path / "small" / "a.tar", 4)
    big = _shard(tmp_path / "big" / "a.tar", 60)
    small_items = predict.image_items(tmp_path / "small", ("jpg",))
    big_items = predict.image_items(tmp_path / "big", ("jpg",))
    assert [n for n, _ in small_items] == [f"a.tar/{k}" for k in small]
    assert [n for n, _ in big_items] == [f"a.tar/{k}" for k in big]

    small_imgs = _load_all(small_items)
    small_reads = list(counted)
    counted.clear()
    big_imgs = _load_all(big_items)
    # one read per image, of exactly its stored bytes: the last image of a 60-sample shard costs what the first does
    assert small_reads == [len(v) for v in small.values()]
    assert counted == [len(v) for v in big.values()]
    for ours, key in zip(big_imgs, big, strict=True):  # the bytes read are the image webdataset stored
        want = predict._load(io.BytesIO(big[key]), 32, 3, None)[0].numpy()
        assert np.array_equal(ours, want)
    assert all(np.array_equal(a, b) for a, b in zip(small_imgs, big_imgs[:4], strict=True))


def test_shard_specs_and_make_shards_folders(tmp_path, counted):
    shards = tmp_path / "wds"
    shards.mkdir()
    first = _shard(shards / "p-000.tar", 3)
    second = _shard(shards / "p-001.tar", 2)
    names = [f"p-000.tar/{k}" for k in first] + [f"p-001.tar/{k}" for k in second]
    assert [n for n, _ in predict.image_items(str(shards / "p-{000..001}.tar"))] == names
    assert [n for n, _ in predict.image_items(str(shards / "p-*.tar"))] == names
    assert [n for n, _ in predict.image_items(shards / "p-001.tar")] == names[3:]

    raw = tmp_path / "raw"
    for c in range(2):
        (raw / f"c{c}").mkdir(parents=True)
        for i in range(3):
            (raw / f"c{c}" / f"{i}.jpg").write_bytes(_jpeg(10 * c + i))
    make_shards("imagefolder", raw, tmp_path / "made", resize=32, workers=1, progress=False)
    items = predict.image_items(tmp_path / "made")
    assert len(items) == 6 and all(name.startswith("imagefolder-train-") for name, _ in items)
    _load_all(items)
    stored = []  # the JPEG members' sizes, as Python's tarfile lists them
    for shard in sorted((tmp_path / "made").glob("*.tar")):
        with tarfile.open(shard) as t:
            stored += [m.size for m in t.getmembers() if m.name.endswith(".jpg")]
    assert counted == stored


def test_samples_without_an_image_key_are_counted(tmp_path, capfd):
    path = tmp_path / "x.tar"
    with wds.TarWriter(str(path)) as sink:
        sink.write({"__key__": "a", "jpg": _jpeg(0), "cls": 0})
        sink.write({"__key__": "b", "webp": _jpeg(1), "cls": 0})
        sink.write({"__key__": "c", "txt": "no image", "cls": 0})
    assert [n for n, _ in predict.image_items(path, ("jpg",))] == ["x.tar/a"]
    assert "2 sample(s) of" in capfd.readouterr().err
    assert [n for n, _ in predict.image_items(path, ("jpg", "webp"))] == ["x.tar/a", "x.tar/b"]
