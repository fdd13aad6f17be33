"""ImageNet-1k (ILSVRC-2012 folders): class order, GCD's split, the refusals, and `infosieve make-shards` end to end.

The fake tree has the real shape: 1000 `train/<wnid>/` folders (wnids created in shuffled order, 1-3 tiny generated
JPEGs each) and the same 1000 `val/<wnid>/` folders (one image each). The expected native order, class ids and
labelled set are recomputed here from the published recipe, not taken from the code under test.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from infosieve_fast import cli
from infosieve_fast.config.settings import load_config
from infosieve_fast.data.splits import class_split, gcd_split
from infosieve_fast.data.writing.layouts import DATASETS, LayoutError, canonical_name, read_dataset

REPO = Path(__file__).resolve().parents[1]
WNIDS = sorted(f"n{x:08d}" for x in np.random.RandomState(7).choice(10**8, size=1000, replace=False))
PER_CLASS = [1 + (i * 7) % 3 for i in range(1000)]  # 1..3 train images, by sorted class id


def _jpeg(c: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (c % 256, (c * 7) % 256, (c * 13) % 256)).save(buf, "JPEG")
    return buf.getvalue()


def _folders(root: Path, train: list[str], val: list[str]) -> None:
    """Empty class folders only: enough for the checks that refuse a tree before reading any image."""
    for w in train:
        (root / "train" / w).mkdir(parents=True)
    (root / "val").mkdir(parents=True)
    for w in val:
        (root / "val" / w).mkdir()


@pytest.fixture(scope="module")
def ilsvrc(tmp_path_factory) -> tuple[Path, dict]:
    """A fake ILSVRC-2012 tree and what a correct reader gives: native order = sorted wnids, then sorted files."""
    root = tmp_path_factory.mktemp("ilsvrc")
    create = np.random.RandomState(3).permutation(1000)  # folders and files are made out of order
    val_ids = np.random.RandomState(4).permutation(1000)  # val file names are not in class order either
    for c in create:
        w, data = WNIDS[c], _jpeg(int(c))
        (root / "train" / w).mkdir(parents=True)
        (root / "val" / w).mkdir(parents=True)
        for k in reversed(range(PER_CLASS[c])):
            (root / "train" / w / f"{w}_{k}.JPEG").write_bytes(data)
        (root / "val" / w / f"ILSVRC2012_val_{val_ids[c] + 1:08d}.JPEG").write_bytes(data)
    (root / "train" / WNIDS[3] / "notes.txt").write_text("not an image")  # skipped, as ImageFolder skips it
    train_names = [f"train/{WNIDS[c]}/{WNIDS[c]}_{k}.JPEG" for c in range(1000) for k in range(PER_CLASS[c])]
    train_labels = np.repeat(np.arange(1000), PER_CLASS)
    test_names = [f"val/{WNIDS[c]}/ILSVRC2012_val_{val_ids[c] + 1:08d}.JPEG" for c in range(1000)]
    return root, {"train_names": train_names, "train_labels": train_labels, "test_names": test_names}


def _gcd_labelled(labels: np.ndarray, n_known: int = 500) -> np.ndarray:
    """GCD's recipe: the known-class train images in native order, then `subsample_instances(prop=0.5)`, i.e.
    `np.random.seed(0); np.random.choice(range(n), replace=False, size=int(0.5 * n))` over them."""
    known_pos = np.flatnonzero(labels < n_known)
    n = len(known_pos)
    chosen = np.random.RandomState(0).choice(range(n), replace=False, size=(int(0.5 * n),))
    mask = np.zeros(len(labels), bool)
    mask[known_pos[chosen]] = True
    return mask


def test_class_order_known_and_native_order(ilsvrc):
    root, want = ilsvrc
    raw = read_dataset("imagenet1k", root)
    assert raw.dataset == "imagenet1k"
    assert raw.class_names == WNIDS  # class id = position in the sorted wnid folders
    assert raw.known == list(range(500)) and raw.novel == list(range(500, 1000))
    assert list(class_split("imagenet1k").known) == raw.known
    assert raw.train_names == want["train_names"]  # sorted files per class, notes.txt skipped
    np.testing.assert_array_equal(raw.train_labels, want["train_labels"])
    assert raw.test_names == want["test_names"]
    np.testing.assert_array_equal(raw.test_labels, np.arange(1000))
    assert all(Path(p) == root / n for p, n in zip(raw.train, raw.train_names, strict=True))
    for alias in ("imagenet-1k", "imagenet_1k", "ImageNet-1k"):
        assert canonical_name(alias) == "imagenet1k"
    assert read_dataset("imagenet-1k", root).train_names == raw.train_names


def test_labelled_set_is_gcds(ilsvrc):
    root, want = ilsvrc
    raw = read_dataset("imagenet1k", root)
    labelled, targets = gcd_split(raw.train_labels, raw.known, 0.5, 0, novel_classes=raw.novel)
    expected = _gcd_labelled(want["train_labels"])
    np.testing.assert_array_equal(labelled, expected)
    np.testing.assert_array_equal(targets, want["train_labels"])  # known 0..499 first: the remap is the identity
    n_known = int((want["train_labels"] < 500).sum())
    assert labelled.sum() == n_known // 2 and not labelled[want["train_labels"] >= 500].any()


def test_make_shards_end_to_end(ilsvrc, tmp_path, capsys):
    root, want = ilsvrc
    out = tmp_path / "shards"
    argv = ["make-shards", "--dataset", "imagenet-1k", "--root", str(root), "--out", str(out), "--resize", "8"]
    assert cli.main([*argv, "--workers", "1", "--shard-size-mb", "1", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = _gcd_labelled(want["train_labels"])
    n_train = len(want["train_labels"])
    assert summary["dataset"] == "imagenet1k" and (summary["n_old"], summary["n_classes"]) == (500, 1000)
    assert (summary["labelled"], summary["unlabelled"], summary["test"]) == (
        expected.sum(),
        n_train - expected.sum(),
        1000,
    )
    assert summary["reference_check"] == "n/a"  # no exact ImageNet-1k counts to compare with
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["classes"]["names"] == WNIDS and manifest["classes"]["known"] == list(range(500))
    assert manifest["skipped"] == []
    seen = {"train": np.zeros(n_train, int), "test": np.zeros(1000, int)}
    for split in ("train", "test"):
        for rec in manifest["splits"][split]["shards"]:
            with tarfile.open(out / rec["name"]) as tar:
                files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
            for name in (n for n in files if n.endswith(".uq")):
                key = name[: -len(".uq")]
                uq, cls, lab = (int(files[f"{key}.{x}"]) for x in ("uq", "cls", "lab"))
                seen[split][uq] += 1
                if split == "train":
                    assert (cls, bool(lab)) == (want["train_labels"][uq], expected[uq]), uq
                else:
                    assert (cls, lab) == (uq, 0)
                assert Image.open(io.BytesIO(files[f"{key}.jpg"])).size == (8, 8)
    assert (seen["train"] == 1).all() and (seen["test"] == 1).all()


def test_train_folder_must_hold_1000_classes(tmp_path):
    for n in (999, 1001):
        root = tmp_path / str(n)
        names = WNIDS[:n] if n <= 1000 else [*WNIDS, "n99999999"]
        _folders(root, names, names)
        with pytest.raises(LayoutError) as err:
            read_dataset("imagenet1k", root)
        msg = str(err.value)
        assert f"{root / 'train'} has {n} class folders" in msg and "1000" in msg and "--root" in msg, msg


def test_val_folders_must_match_train(tmp_path):
    cases = {
        "missing": (WNIDS[:-1], [f"1 missing ({WNIDS[-1]})"]),
        "extra": ([*WNIDS, "n99999999"], ["1 not in train (n99999999)"]),
        "both": ([*WNIDS[7:], "n99999998", "n99999999"], ["7 missing (", ", ...)", "2 not in train (n99999998, n9"]),
    }
    for case, (val, parts) in cases.items():
        root = tmp_path / case
        _folders(root, WNIDS, val)
        with pytest.raises(LayoutError) as err:
            read_dataset("imagenet1k", root)
        msg = str(err.value)
        assert f"{root / 'val'}'s class folders differ from {root / 'train'}'s" in msg and "val/<wnid>/" in msg, msg
        assert all(p in msg for p in parts), msg
    flat = tmp_path / "flat"  # the val download before sorting: files, no class folders
    _folders(flat, WNIDS, [])
    (flat / "val" / "ILSVRC2012_val_00000001.JPEG").write_bytes(_jpeg(0))
    with pytest.raises(LayoutError, match=r"has no class folders: sort the val images into val/<wnid>/"):
        read_dataset("imagenet1k", flat)
    novalfolder = tmp_path / "noval"
    _folders(novalfolder, WNIDS, [])
    (novalfolder / "val").rmdir()
    with pytest.raises(LayoutError, match="ImageNet val folder"):
        read_dataset("imagenet1k", novalfolder)


def test_cli_refuses_with_message_and_lists_dataset(tmp_path, capsys):
    root = tmp_path / "ilsvrc"
    _folders(root, WNIDS[:10], WNIDS[:10])
    assert cli.main(["make-shards", "--dataset", "imagenet1k", "--root", str(root), "--out", str(tmp_path / "o")]) == 2
    assert f"make-shards: error: {root / 'train'} has 10 class folders" in capsys.readouterr().err
    assert "imagenet1k" in DATASETS
    with pytest.raises(SystemExit):
        cli.main(["make-shards", "--help"])
    assert "imagenet1k" in capsys.readouterr().out
    with pytest.raises(LayoutError, match="imagenet1k"):
        canonical_name("imagenet2k")


def test_config_is_imagenet100s_generic_setting():
    cfg = load_config(REPO / "configs" / "imagenet1k.yaml")
    assert cfg.name == "imagenet1k"
    assert dataclasses.replace(cfg, name="imagenet100") == load_config(REPO / "configs" / "imagenet100.yaml")
    header = (REPO / "configs" / "imagenet1k.yaml").read_text().split("\nname:")[0]
    assert "infosieve make-shards --dataset imagenet1k" in header
    assert "infosieve train --config configs/imagenet1k.yaml" in header
