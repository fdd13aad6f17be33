"""`infosieve make-shards`' numeric flags out of range are refused (exit 2, one line, nothing written), a shard size
below one sample still ends (one sample per shard), and the known-classes message names every setting it can come
from (make-shards' flag and the foreign shards' setting)."""

from __future__ import annotations

import io
import json
import signal
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from infosieve_fast import cli
from infosieve_fast.config.settings import IntakeConfig
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource

CLASSES, PER_CLASS = 4, 3


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    """An imagefolder tree: 4 classes x 3 random 20x20 PNGs, all train images."""
    root = tmp_path_factory.mktemp("args") / "raw"
    rng = np.random.default_rng(0)
    for c in range(CLASSES):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(PER_CLASS):
            Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(root / f"class{c}" / f"{i}.png")
    return root


def _argv(raw: Path, out: Path, *extra: str) -> list[str]:
    return ["make-shards", "--dataset", "imagefolder", "--root", str(raw), "--out", str(out), "--resize", "8",
            "--workers", "1", "--no-progress", *extra]  # fmt: skip


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--shard-size-mb", "0", "--shard-size-mb 0: a shard's size must be above 0 MB, e.g. --shard-size-mb 256"),
        ("--shard-size-mb", "-1", "--shard-size-mb -1: a shard's size must be above 0 MB, e.g. --shard-size-mb 256"),
        ("--shard-size-mb", "nan", "--shard-size-mb nan: a shard's size must be above 0 MB"),
        ("--resize", "0", "--resize 0: the stored shorter side must be 1 px or more, e.g. --resize 256"),
        ("--resize", "-5", "--resize -5: the stored shorter side must be 1 px or more"),
        ("--jpeg-quality", "500", "--jpeg-quality 500: JPEG quality lies in 1..100, e.g. --jpeg-quality 95"),
        ("--jpeg-quality", "0", "--jpeg-quality 0: JPEG quality lies in 1..100"),
        ("--workers", "0", "--workers 0: at least 1 encoding process is needed, e.g. --workers 4"),
        ("--holdout-seed", "-1", "--holdout-seed -1: a seed lies in 0..2**32-1, e.g. --holdout-seed 0"),
        ("--holdout-seed", str(2**32), f"--holdout-seed {2**32}: a seed lies in 0..2**32-1"),
        ("--holdout", "1", "--holdout 1.0: the held-out share must lie in [0, 1)"),
    ],
)
def test_out_of_range_flag_is_refused_in_one_line_and_nothing_is_written(raw, tmp_path, capsys, flag, value, says):
    out = tmp_path / "out"
    assert cli.main(_argv(raw, out, flag, value)) == 2  # a flag given twice: argparse keeps the last
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"make-shards: error: {says}"), err
    assert captured.out == "" and not out.exists()


def _alarm(seconds: int) -> None:
    """A make-shards run that does not end fails the test after `seconds` instead of hanging it."""

    def fail(*_):
        raise TimeoutError(f"make-shards did not end within {seconds} s")

    signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)


def test_shard_size_below_one_sample_writes_one_sample_per_shard(raw, tmp_path, capsys):
    """1e-9 MB is 0 bytes once rounded: the writer still moves on, one sample per shard, every image written."""
    out = tmp_path / "out"
    _alarm(60)
    try:
        assert cli.main(_argv(raw, out, "--shard-size-mb", "1e-9", "--jpeg-quality", "1")) == 0
    finally:
        signal.alarm(0)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["labelled"] + summary["unlabelled"] == CLASSES * PER_CLASS and summary["skipped"] == 0
    shards = sorted(out.glob("*-train-*.tar"))
    assert len(shards) == CLASSES * PER_CLASS
    for shard in shards:
        with tarfile.open(shard) as tar:
            images = [m for m in tar.getmembers() if m.name.endswith(".jpg")]
            assert len(images) == 1
            assert Image.open(io.BytesIO(tar.extractfile(images[0]).read())).size == (8, 8)


def test_valid_flags_at_their_bounds_are_accepted(raw, tmp_path, capsys):
    out = tmp_path / "out"
    argv = _argv(raw, out, "--jpeg-quality", "100", "--holdout-seed", str(2**32 - 1))
    assert cli.main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["written_train"] == CLASSES * PER_CLASS


SETTINGS = "check --known-classes (make-shards), data.intake.known_classes (training on foreign shards)"


def test_known_class_without_images_names_the_make_shards_flag(raw, tmp_path, capsys):
    """An empty class folder named known: no train image; the message names --known-classes among the settings."""
    tree = tmp_path / "tree"
    for c in range(CLASSES):
        (tree / f"class{c}").mkdir(parents=True)
    for i, png in enumerate(sorted(raw.glob("class[123]/*.png"))):
        (tree / png.parent.name / f"{i}.png").write_bytes(png.read_bytes())
    argv = ["make-shards", "--dataset", "imagefolder", "--root", str(tree), "--out", str(tmp_path / "out"),
            "--known-classes", "0", "1", "--workers", "1", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "known classes [0] have no images in the train set" in err
    assert SETTINGS in err and not (tmp_path / "out").exists()


def test_known_class_without_images_names_the_intake_setting(raw, tmp_path):
    """Foreign shards (.png + .cls) read with data.intake.known_classes=[99]: the message names that setting."""
    folder = tmp_path / "foreign"
    folder.mkdir()
    with tarfile.open(folder / "train-000000.tar", "w") as tar:
        for i, png in enumerate(sorted(raw.glob("*/*.png"))):
            for ext, data in (("png", png.read_bytes()), ("cls", str(int(png.parent.name[-1])).encode())):
                info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError) as caught:
        ShardSource(folder, ReadOptions(num_workers=0, memory_threshold_mb=0, intake=IntakeConfig(known_classes=[99])))
    assert "known classes [99] have no images in the train set" in str(caught.value)
    assert SETTINGS in str(caught.value)
