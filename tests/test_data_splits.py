"""GCD splits and the native-layout readers, each on a small tree built here in the official layout from real images."""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from infosieve_fast.data import splits
from infosieve_fast.data.splits import check_counts, class_split, gcd_split, split_counts
from infosieve_fast.data.writing.layouts import LayoutError, read_dataset


def _cifar_images(realdata: Path, n: int) -> tuple[list[Path], list[int]]:
    """n real CIFAR-10 test JPEGs, round-robin over the classes, with their labels."""
    classes = sorted(p.name for p in (realdata / "cifar10_test" / "test").iterdir())
    files = [sorted((realdata / "cifar10_test" / "test" / c).iterdir()) for c in classes]
    out = [(files[i % 10][i // 10], i % 10) for i in range(n)]
    return [p for p, _ in out], [y for _, y in out]


def _cub_images(realdata: Path, n: int) -> list[Path]:
    return sorted((realdata / "cub100" / "images").glob("*/*.jpg"))[:n]


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(src, dst)


def _expected_labelled(native_labels: np.ndarray, known: list[int]) -> np.ndarray:
    """docs/reference.md §7: RandomState(0).permutation(n)[:n//2] over the known-class subset in native order."""
    known_idx = np.flatnonzero(np.isin(native_labels, known))
    mask = np.zeros(len(native_labels), bool)
    mask[known_idx[np.random.RandomState(0).permutation(len(known_idx))[: len(known_idx) // 2]]] = True
    return mask


def _check_split(raw) -> None:
    labelled, targets = gcd_split(raw.train_labels, raw.known, novel_classes=raw.novel)
    np.testing.assert_array_equal(labelled, _expected_labelled(raw.train_labels, raw.known))
    order = raw.known + raw.novel
    np.testing.assert_array_equal(targets, [order.index(c) for c in raw.train_labels])
    assert not labelled[targets >= len(raw.known)].any()


# ---- class lists and the split recipe --------------------------------------------------------------------------


def test_class_lists_partition_and_pin():
    for name, n in [
        ("cub", 200),
        ("scars", 196),
        ("aircraft", 100),
        ("herbarium19", 683),
        ("cifar10", 10),
        ("cifar100", 100),
        ("pets", 37),
        ("imagenet100", 100),
        ("imagenet1k", 1000),
    ]:
        cs = class_split(name)
        assert sorted(cs.order) == list(range(n)), name
    assert class_split("imagenet1k").known == tuple(range(500))  # GCD: range(500) of the sorted wnid folders
    assert (len(splits.CUB_KNOWN), len(splits.SCARS_KNOWN), len(splits.AIRCRAFT_KNOWN)) == (100, 98, 50)
    assert len(splits.HERBARIUM19_OLD) == 341 and splits.herbarium19_new() == sorted(
        set(range(683)) - set(splits.HERBARIUM19_OLD)
    )
    assert splits.imagenet100_choice() == list(splits.IMAGENET100_CLASSES)
    assert splits.CUB_KNOWN[:5] == (150, 70, 34, 178, 199) and splits.CUB_NOVEL[:4] == (29, 110, 3, 8)
    assert splits.AIRCRAFT_NOVEL[:8] == (6, 7, 8, 9, 12, 13, 31, 32)  # Hard first, not sorted
    # pin the exact lists, in the published order (docs/reference.md §7)
    blob = repr(
        [
            splits.CUB_KNOWN,
            splits.CUB_NOVEL,
            splits.SCARS_KNOWN,
            splits.SCARS_NOVEL,
            splits.AIRCRAFT_KNOWN,
            splits.AIRCRAFT_NOVEL,
            splits.IMAGENET100_CLASSES,
            splits.HERBARIUM19_OLD,
        ]
    )
    assert hashlib.sha256(blob.encode()).hexdigest()[:16] == PINNED_LISTS_SHA


PINNED_LISTS_SHA = "027727f9507c4aee"


def test_gcd_split_novel_order_and_counts():
    rng = np.random.RandomState(5)
    y = rng.randint(0, 6, size=200)
    labelled, t = gcd_split(y, [4, 1], novel_classes=[5, 0, 3, 2])
    order = [4, 1, 5, 0, 3, 2]
    np.testing.assert_array_equal(t, [order.index(c) for c in y])
    np.testing.assert_array_equal(labelled, _expected_labelled(y, [4, 1]))
    assert labelled.sum() == int(0.5 * np.isin(y, [4, 1]).sum())
    with pytest.raises(ValueError, match="neither known nor novel"):
        gcd_split(y, [4, 1], novel_classes=[5, 0, 3])
    c = split_counts(labelled, t, 2, n_test=7)
    assert c["labelled"] + c["unlabelled"] == 200 and c["test"] == 7
    assert c["unlabelled_known"] == np.isin(y, [4, 1]).sum() - c["labelled"]


def test_check_counts_against_reference_table():
    # the full CIFAR-10 train set: labelled 12,500 / unlabelled 37,500 (docs/reference.md §7)
    y = np.repeat(np.arange(10), 5000)
    labelled, t = gcd_split(y, range(5))
    counts = split_counts(labelled, t, 5, n_test=10_000)
    assert (counts["labelled"], counts["unlabelled"]) == (12_500, 37_500)
    assert check_counts("cifar10", counts) == []
    assert check_counts("cifar10", counts | {"labelled": 12_000}) != []
    assert check_counts("cifar10", counts | {"train": 500}) == []  # a partial copy is not compared
    # CUB: 5,994 train images, ~30 per class -> 1,498 labelled (docs/reference.md §7 [EST])
    assert check_counts("cub", {"train": 5994, "labelled": 1498, "unlabelled": 4496, "test": 5794}) == []
    # ImageNet-1k: the totals do not fix the first 500 classes' image count, so nothing is compared
    assert "imagenet1k" not in splits.EXPECTED_COUNTS
    assert check_counts("imagenet1k", {"train": 1_281_167, "labelled": 1, "unlabelled": 1, "test": 50_000}) == []


# ---- native-layout readers -------------------------------------------------------------------------------------


def _cifar_pickles(realdata: Path, folder: Path, files: dict[str, int], n_classes: int, label_key: str) -> dict:
    from PIL import Image

    folder.mkdir(parents=True)
    paths, _ = _cifar_images(realdata, sum(files.values()))
    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    out, k = {}, 0
    for fname, n in files.items():
        labels = [(k + i) % n_classes for i in range(n)]
        data = np.stack([a.transpose(2, 0, 1).reshape(-1) for a in arrays[k : k + n]])
        with open(folder / fname, "wb") as f:
            pickle.dump({b"data": data, label_key.encode(): labels, b"batch_label": b"x"}, f)
        out[fname] = (arrays[k : k + n], labels)
        k += n
    return out


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
def test_cifar_layout(realdata, tmp_path, dataset):
    if dataset == "cifar10":
        folder, key = tmp_path / "cifar-10-batches-py", "labels"
        files = {f"data_batch_{i}": 12 for i in range(1, 6)} | {"test_batch": 10}
        written = _cifar_pickles(realdata, folder, files, 10, key)
        with open(folder / "batches.meta", "wb") as f:
            pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f)
        train_files = [f"data_batch_{i}" for i in range(1, 6)]
    else:
        folder, key = tmp_path / "cifar-100-python", "fine_labels"
        written = _cifar_pickles(realdata, folder, {"train": 200, "test": 20}, 100, key)
        with open(folder / "meta", "wb") as f:
            pickle.dump({b"fine_label_names": [f"c{i}".encode() for i in range(100)]}, f)
        train_files = ["train"]
    raw = read_dataset(dataset, tmp_path)
    arrays = [a for f in train_files for a in written[f][0]]
    labels = [y for f in train_files for y in written[f][1]]
    assert len(raw.train) == len(arrays)
    for got, want in zip(raw.train, arrays, strict=True):
        np.testing.assert_array_equal(got, want)  # torchvision order: batches 1..5 concatenated
    np.testing.assert_array_equal(raw.train_labels, labels)
    test_key = "test_batch" if dataset == "cifar10" else "test"
    np.testing.assert_array_equal(raw.test_labels, written[test_key][1])
    assert raw.known == list(range(5 if dataset == "cifar10" else 80))
    assert raw.class_names[3] == "c3"
    _check_split(raw)


def test_imagenet100_layout(realdata, tmp_path):
    wnids = [f"n{i:08d}" for i in range(1000)]
    for w in wnids:
        (tmp_path / "train" / w).mkdir(parents=True)
    (tmp_path / "val").mkdir()
    chosen = splits.imagenet100_choice()
    imgs = _cub_images(realdata, 300)
    for j, c in enumerate(chosen):
        for k in range(2):
            _link(imgs[2 * j + k], tmp_path / "train" / wnids[c] / f"{wnids[c]}_{k}.JPEG")
        _link(imgs[200 + j], tmp_path / "val" / wnids[c] / f"ILSVRC2012_val_{j:08d}.JPEG")
    _link(imgs[0], tmp_path / "train" / wnids[2] / "not_chosen.JPEG")  # class 2 is not among the 100
    raw = read_dataset("imagenet100", tmp_path)
    assert raw.class_names == [wnids[c] for c in chosen]
    assert len(raw.train) == 200 and len(raw.test) == 100
    np.testing.assert_array_equal(raw.train_labels, np.repeat(np.arange(100), 2))
    assert raw.train_names[:2] == [f"train/{wnids[1]}/{wnids[1]}_0.JPEG", f"train/{wnids[1]}/{wnids[1]}_1.JPEG"]
    assert raw.known == list(range(50))
    _check_split(raw)
    os.rmdir(tmp_path / "train" / wnids[999])
    with pytest.raises(LayoutError, match="1000"):
        read_dataset("imagenet100", tmp_path)


def test_cub_layout(realdata, tmp_path):
    base = tmp_path / "CUB_200_2011"
    imgs = _cub_images(realdata, 600)
    lines, labels, split, rel = [], [], [], []
    for i in range(600):  # 3 images per class, interleaved classes: native order != class order
        cls = (i * 7) % 200 + 1
        path = f"{cls:03d}.Bird_{cls}/Bird_{cls}_{i:04d}.jpg"
        _link(imgs[i], base / "images" / path)
        lines.append(f"{i + 1} {path}")
        labels.append(f"{i + 1} {cls}")
        split.append(f"{i + 1} {int(i % 3 != 0)}")
        rel.append(path)
    (base / "images.txt").write_text("\n".join(lines) + "\n")
    (base / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (base / "train_test_split.txt").write_text("\n".join(split) + "\n")
    (base / "classes.txt").write_text("".join(f"{c} {c:03d}.Bird_{c}\n" for c in range(1, 201)))
    raw = read_dataset("cub", tmp_path)
    train = [i for i in range(600) if i % 3 != 0]
    assert raw.train_names == [rel[i] for i in train]
    np.testing.assert_array_equal(raw.train_labels, [(i * 7) % 200 for i in train])  # 1-based -> 0-based
    assert len(raw.test) == 200 and raw.class_names[0] == "001.Bird_1"
    assert raw.known == list(splits.CUB_KNOWN) and raw.novel == list(splits.CUB_NOVEL)
    _check_split(raw)


def test_cubfiles_layout_on_cub100(realdata):
    raw = read_dataset("cubfiles", realdata / "cub100")
    assert len(raw.train) == 5902 and len(raw.class_names) == 100 and not raw.test
    assert raw.known == list(range(50))
    assert raw.train_names[0] == "Black_footed_Albatross/0000.jpg" and raw.train_labels[0] == 0
    labelled, targets = gcd_split(raw.train_labels, raw.known)
    c = split_counts(labelled, targets, 50)
    assert (c["labelled"], c["unlabelled"]) == (int(0.5 * np.isin(raw.train_labels, range(50)).sum()), 5902 - 1474)
    with pytest.raises(LayoutError, match="cubfiles"):
        read_dataset("cub", realdata / "cub100")


def _savemat_annotations(path: Path, rows: list[dict]) -> None:
    from scipy.io import savemat

    fields = list(rows[0])
    arr = np.zeros((1, len(rows)), dtype=[(f, "O") for f in fields])
    for i, r in enumerate(rows):
        for f in fields:
            v = r[f]
            arr[0, i][f] = np.array([v]) if isinstance(v, str) else np.array([[v]], dtype=np.uint16)
    savemat(str(path), {"annotations": arr})


def test_scars_devkit_layout(realdata, tmp_path):
    from scipy.io import savemat

    imgs = _cub_images(realdata, 392)
    (tmp_path / "devkit").mkdir()
    rows = {"train": [], "test": []}
    for i in range(392):
        split = "train" if i % 2 == 0 else "test"
        k = len(rows[split]) + 1
        cls = (i // 2 * 5) % 196 + 1
        fname = f"{k:05d}.jpg"
        _link(imgs[i], tmp_path / f"cars_{split}" / fname)
        rows[split].append({"bbox_x1": 1, "bbox_y1": 1, "bbox_x2": 9, "bbox_y2": 9, "class": cls, "fname": fname})
    _savemat_annotations(tmp_path / "devkit" / "cars_train_annos.mat", rows["train"])
    _savemat_annotations(tmp_path / "cars_test_annos_withlabels.mat", rows["test"])
    names = np.empty((1, 196), dtype=object)
    for i in range(196):
        names[0, i] = f"Car {i + 1}"
    savemat(str(tmp_path / "devkit" / "cars_meta.mat"), {"class_names": names})
    raw = read_dataset("scars", tmp_path)
    assert raw.train_names[:2] == ["cars_train/00001.jpg", "cars_train/00002.jpg"]
    np.testing.assert_array_equal(raw.train_labels, [r["class"] - 1 for r in rows["train"]])
    np.testing.assert_array_equal(raw.test_labels, [r["class"] - 1 for r in rows["test"]])
    assert raw.class_names[0] == "Car 1" and raw.known == list(splits.SCARS_KNOWN)
    assert os.path.samefile(raw.train[1], imgs[2])
    _check_split(raw)


def test_aircraft_layout(realdata, tmp_path):
    data = tmp_path / "fgvc-aircraft-2013b" / "data"
    imgs = _cub_images(realdata, 300)
    variants = [f"V-{i:03d}" if i % 3 else f"Boeing 7{i:02d}" for i in range(100)]  # names with spaces
    tv, te = [], []
    for i in range(300):
        img_id = f"{1000000 + i * 13:07d}"
        _link(imgs[i], data / "images" / f"{img_id}.jpg")
        v = variants[(i * 37) % 100]
        (te if i % 3 == 2 else tv).append(f"{img_id} {v}")
    (data / "images_variant_trainval.txt").write_text("\n".join(tv) + "\n")
    (data / "images_variant_test.txt").write_text("\n".join(te) + "\n")
    raw = read_dataset("aircraft", tmp_path)
    classes = sorted(variants)
    assert raw.class_names == classes and len(raw.train) == 200 and len(raw.test) == 100
    np.testing.assert_array_equal(raw.train_labels, [classes.index(line.split(" ", 1)[1]) for line in tv])
    assert raw.known == list(splits.AIRCRAFT_KNOWN)
    _check_split(raw)


def test_pets_layout(realdata, tmp_path):
    imgs = _cub_images(realdata, 111)
    breeds = [f"Breed{i:02d}" if i < 12 else f"breed_{i:02d}" for i in range(37)]
    lines = {"trainval": [], "test": []}
    for i in range(111):
        cls = (i * 11) % 37
        stem = f"{breeds[cls]}_{100 + i}"
        _link(imgs[i], tmp_path / "images" / f"{stem}.jpg")
        lines["test" if i % 3 == 0 else "trainval"].append(f"{stem} {cls + 1} {1 + (cls >= 12)} {cls + 1}")
    (tmp_path / "annotations").mkdir()
    for k, v in lines.items():
        (tmp_path / "annotations" / f"{k}.txt").write_text("\n".join(v) + "\n")
    raw = read_dataset("pets", tmp_path)
    np.testing.assert_array_equal(raw.train_labels, [int(line.split()[1]) - 1 for line in lines["trainval"]])
    assert raw.train_names[0] == f"images/{lines['trainval'][0].split()[0]}.jpg"
    assert raw.class_names[13] == "breed_13" and raw.known == list(range(19))
    _check_split(raw)


def test_herbarium19_layout(realdata, tmp_path):
    imgs = _cub_images(realdata, 700)
    for c in range(683):  # folder names are numbers: ImageFolder's index is their lexicographic order
        _link(imgs[c], tmp_path / "small-train" / str(c) / f"{c}_a.jpg")
        _link(imgs[c], tmp_path / "small-validation" / str(c) / f"{c}_v.jpg")
    _link(imgs[683], tmp_path / "small-train" / "5" / "5_b.jpg")
    raw = read_dataset("herbarium19", tmp_path)
    lex = sorted(str(c) for c in range(683))
    assert raw.class_names == lex and raw.class_names[:4] == ["0", "1", "10", "100"]
    assert raw.train_names[:2] == ["small-train/0/0_a.jpg", "small-train/1/1_a.jpg"]
    np.testing.assert_array_equal(raw.train_labels[:3], [0, 1, 2])
    assert list(raw.train_labels).count(lex.index("5")) == 2
    assert raw.known == list(splits.HERBARIUM19_OLD) and len(raw.novel) == 342
    np.testing.assert_array_equal(raw.test_labels, np.arange(683))
    _check_split(raw)


def test_imagefolder_layout(realdata, tmp_path):
    raw = read_dataset("imagefolder", realdata / "cifar10_test" / "test")
    assert len(raw.train) == 10_000 and raw.class_names[0] == "airplane" and not raw.test
    np.testing.assert_array_equal(raw.train_labels, np.repeat(np.arange(10), 1000))
    assert raw.known == list(range(5))
    paths, labels = _cifar_images(realdata, 40)
    for i, (p, y) in enumerate(zip(paths, labels, strict=True)):
        _link(p, tmp_path / ("test" if i % 4 == 0 else "train") / f"k{y}" / p.name)
    raw = read_dataset("imagefolder", tmp_path, known_classes=[7, 2])
    assert len(raw.train) == 30 and len(raw.test) == 10
    assert raw.known == [7, 2] and raw.novel == [0, 1, 3, 4, 5, 6, 8, 9]
    _check_split(raw)
