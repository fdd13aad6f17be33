"""A make-shards folder read without its manifest.json is refused (its split lives only in the manifest), as is
data.shards naming the manifest itself; foreign WebDataset shards (.jpg + .cls) still load."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from infosieve_fast import cli
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
from infosieve_fast.data.shard_manifest import ManifestError

CLASSES, TRAIN_PER_CLASS, TEST_PER_CLASS, SIZE = 4, 4, 1, 32


def _png(cls: int, i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (SIZE, SIZE), (60 * cls, 40 * i, 200 - 30 * cls)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """`infosieve make-shards` of an imagefolder with train/ and test/, known classes 0-2 (not the first half)."""
    base = tmp_path_factory.mktemp("lost")
    for split, per_class in (("train", TRAIN_PER_CLASS), ("test", TEST_PER_CLASS)):
        for c in range(CLASSES):
            folder = base / "raw" / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                (folder / f"{i}.png").write_bytes(_png(c, i))
    out = base / "made"
    argv = ["make-shards", "--dataset", "imagefolder", "--root", str(base / "raw"), "--out", str(out)]
    assert cli.main([*argv, "--resize", str(SIZE), "--workers", "1", "--known-classes", "0-2", "--no-progress"]) == 0
    return out


def _open(spec) -> ShardSource:
    return ShardSource(spec, ReadOptions(num_workers=0, memory_threshold_mb=0))


def _copy_without_manifest(made: Path, to: Path) -> Path:
    to.mkdir()
    for tar in made.glob("*.tar"):
        (to / tar.name).write_bytes(tar.read_bytes())
    return to


def test_the_manifest_records_the_split_the_refusal_protects(made):
    src = _open(made)  # with the manifest: train samples only, the recorded known classes
    assert (src.n_train, src.n_old, src.n_classes) == (CLASSES * TRAIN_PER_CLASS, 3, CLASSES)


def test_a_folder_that_lost_its_manifest_is_refused_in_one_line(made, tmp_path):
    lost = _copy_without_manifest(made, tmp_path / "lost")
    assert sorted(p.name for p in lost.iterdir())[0].startswith("imagefolder-test-")  # the first shard probed
    with pytest.raises(ManifestError) as err:
        _open(lost)
    text = str(err.value)
    assert text.startswith(f"data.shards {lost} is a make-shards folder that lost its manifest.json")
    assert "restore manifest.json from where the folder came from, or run make-shards again" in text
    assert "\n" not in text
    glob_spec = str(lost / "*-train-*.tar")  # its tars named one by one are the same folder's
    with pytest.raises(ManifestError, match=f"{lost} is a make-shards folder that lost its manifest.json"):
        _open(glob_spec)


def test_train_on_a_folder_that_lost_its_manifest_exits_2_before_its_run_folder(made, tmp_path, capsys):
    lost = _copy_without_manifest(made, tmp_path / "lost")
    run = tmp_path / "run"
    argv = ["train", "--config", "configs/demo.yaml", "--out", str(run), "--set", "data.source=shards"]
    assert cli.main([*argv, "--set", f"data.shards={lost}"]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: data.shards {lost} is a make-shards folder that lost its")
    assert lines[0].endswith("or run make-shards again") and not run.exists() and "run folder:" not in out.out


def test_data_shards_naming_the_manifest_says_to_name_its_folder(made, tmp_path, capsys):
    with pytest.raises(ManifestError) as err:
        _open(made / "manifest.json")
    want = f"data.shards {made / 'manifest.json'} is the manifest of a make-shards folder, not a shard: "
    assert str(err.value) == want + f"point data.shards at its folder, {made}"
    run = tmp_path / "run"
    argv = ["train", "--config", "configs/demo.yaml", "--out", str(run), "--set", "data.source=shards"]
    assert cli.main([*argv, "--set", f"data.shards={made / 'manifest.json'}"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {err.value}" and not run.exists()


def test_shards_of_a_manifest_folder_named_one_by_one_point_to_the_folder(made):
    with pytest.raises(ManifestError, match=f"these are shards of the make-shards folder {made}: point data.shards"):
        _open(str(made / "*.tar"))


def test_foreign_jpg_cls_shards_still_load(tmp_path):
    """A hand-made WebDataset tar (.jpg + .cls, 2 classes x 3): every sample a train sample, first half known."""
    labels = [0, 1, 0, 1, 1, 0]
    shard = tmp_path / "foreign" / "part-000.tar"
    shard.parent.mkdir()
    with tarfile.open(shard, "w") as tar:
        for i, cls in enumerate(labels):
            buf = io.BytesIO()
            Image.new("RGB", (SIZE, SIZE), (40 * i, 0, 0)).save(buf, format="JPEG")
            for name, data in ((f"s{i:03d}.jpg", buf.getvalue()), (f"s{i:03d}.cls", str(cls).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    src = _open(shard.parent)
    assert (src.n_train, src.n_old, src.n_classes, src.class_names) == (6, 1, 2, ["0", "1"])
    by_uq = np.full(src.n_train, -1)
    by_uq[src.uq] = src.index.cls
    assert by_uq.tolist() == labels  # storage order; class 0 known -> target 0, class 1 novel -> target 1
