"""Readers for the native on-disk layouts of the official dataset downloads (docs/reference.md §7).

Each reader returns a `RawDataset`: the train and test samples in the dataset's native order (the order the reference
loaders produce, which fixes which images `labelled_subset` picks), native class ids, and the known/novel class lists
in remapping order. Nothing is decoded here; make-shards (`encode.py`) decodes and resizes.

| name          | layout (under --root)                                                                             |
|---------------|---------------------------------------------------------------------------------------------------|
| cifar10       | `cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}` (python pickles), or that folder   |
| cifar100      | `cifar-100-python/{train,test,meta}` (fine labels), or that folder                                 |
| imagenet100   | `train/<wnid>/*.JPEG` (all 1000 class folders) and `val/<wnid>/*.JPEG` (val sorted into folders)   |
| imagenet1k    | the same ILSVRC-2012 layout; val must hold the same 1000 `<wnid>` folders as train                 |
| cub           | `CUB_200_2011/{images.txt,image_class_labels.txt,train_test_split.txt,classes.txt,images/}`        |
| scars         | `devkit/cars_{train,meta}_annos.mat`, `cars_test_annos_withlabels.mat`, `cars_{train,test}/`;     |
|               | or the combined `cars_annos.mat` + `car_ims/`                                                     |
| aircraft      | `fgvc-aircraft-2013b/data/{images_variant_trainval.txt,images_variant_test.txt,images/}`           |
| pets          | `annotations/{trainval,test}.txt`, `images/*.jpg`                                                  |
| herbarium19   | `small-train/<class>/...`, `small-validation/<class>/...`                                          |
| imagefolder   | `<class>/...` (train only) or `train/<class>/...` + `test/` or `val/`; known = --known-classes      |
| cubfiles      | CUB-style id files (either separator, 0- or 1-based ids), all images train; known = --known-classes |
| discovery     | your own images: `labelled/<class>/...` (the known classes) + `unlabelled/...` (a pool, no labels) |
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..shard_format import DISCOVERY
from ..splits import class_split, imagenet100_choice
from .cifar_pickle import read_batch
from .layout_common import (
    LayoutError,
    RawDataset,
    class_dirs,
    first_existing,
    image_folder,
    need,
    read_id_file,
    relative_paths,
)
from .layout_discovery import read_discovery

DATASETS = (
    "cifar10",
    "cifar100",
    "imagenet100",
    "imagenet1k",
    "cub",
    "scars",
    "aircraft",
    "pets",
    "herbarium19",
    "imagefolder",
    "cubfiles",
    "discovery",
)
ALIASES = {
    "imagenet_100": "imagenet100",
    "imagenet_1k": "imagenet1k",
    "imagenet-1k": "imagenet1k",
    "herbarium_19": "herbarium19",
    "stanford_cars": "scars",
    "cub200": "cub",
}
GENERIC = ("imagefolder", "cubfiles")


def canonical_name(dataset: str) -> str:
    name = ALIASES.get(dataset.lower(), dataset.lower())
    if name not in DATASETS:
        raise LayoutError(f"unknown dataset {dataset!r}: choose one of {', '.join(DATASETS)}")
    return name


def read_dataset(dataset: str, root: str | Path, known_classes: list[int] | None = None) -> RawDataset:
    """Read `dataset` from `root` in its native layout; `known_classes` overrides the reference's known classes."""
    name = canonical_name(dataset)
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise LayoutError(f"--root {root} is not a folder")
    if name == DISCOVERY and known_classes is not None:
        raise LayoutError(
            "--dataset discovery takes the known classes from the folders under labelled/: drop --known-classes"
        )
    raw = _READERS[name](root)
    if name in GENERIC:
        _set_generic_known(raw, known_classes)
    elif known_classes is not None:
        raw.known = list(known_classes)
        raw.novel = sorted(set(range(len(raw.class_names))) - set(raw.known))
        raw.notes.append("known classes given with --known-classes: this departs from the reference split")
    bad = [c for c in raw.known if not 0 <= c < len(raw.class_names)]
    if bad:
        raise LayoutError(f"known classes {bad} are outside 0..{len(raw.class_names) - 1}")
    return raw


def _set_generic_known(raw: RawDataset, known_classes: list[int] | None) -> None:
    """The known and novel classes of a generic layout: `known_classes`, by default the first half of the classes.
    No known class is refused: GCD needs labelled images (training would fail on its first epoch)."""
    n = len(raw.class_names)
    known = list(range(n // 2)) if known_classes is None else list(known_classes)
    if not known:
        given = (
            "--known-classes names none"
            if known_classes is not None
            else f"the default known classes, the first half of its {n} class(es), are none"
        )
        raise LayoutError(
            f"--dataset {raw.dataset} --root {raw.root}: {given}, and training needs at least one known (labelled) "
            "class: add class folders, or pass --known-classes with the known class ids (e.g. --known-classes 0)"
        )
    if known_classes is None:
        raw.notes.append(f"known classes default to the first half of the classes: 0..{n // 2 - 1}")
    raw.known, raw.novel = known, sorted(set(range(n)) - set(known))


def _folder_dataset(
    dataset: str, root: Path, classes: list[str], train_dir: Path, test_dir: Path | None, notes: list[str]
) -> RawDataset:
    """`classes` read as an ImageFolder from `train_dir` and `test_dir` (None: no test split): class id = position in
    `classes`. Known and novel classes: the reference's split (for the generic layouts `read_dataset` sets them)."""
    train, train_labels = image_folder(train_dir, classes)
    test, test_labels = image_folder(test_dir, classes) if test_dir else ([], [])
    split = None if dataset in GENERIC else class_split(dataset)
    known, novel = (list(split.known), list(split.novel)) if split else ([], [])
    train_part = (train, np.asarray(train_labels, np.int64), relative_paths(train, root))
    test_part = (test, np.asarray(test_labels, np.int64), relative_paths(test, root))
    return RawDataset(dataset, root, classes, known, novel, *train_part, *test_part, notes=notes)


# ---- CIFAR -----------------------------------------------------------------------------------------------------


def _cifar(root: Path, dataset: str) -> RawDataset:
    if dataset == "cifar10":
        folder = root if (root / "data_batch_1").exists() else root / "cifar-10-batches-py"
        train_files, test_files, meta, label_key, names_key = (
            [f"data_batch_{i}" for i in range(1, 6)],
            ["test_batch"],
            "batches.meta",
            "labels",
            "label_names",
        )
    else:
        folder = root if (root / "meta").exists() and (root / "train").is_file() else root / "cifar-100-python"
        train_files, test_files, meta, label_key, names_key = (
            ["train"],
            ["test"],
            "meta",
            "fine_labels",
            "fine_label_names",
        )

    def load(files: list[str]) -> tuple[list, np.ndarray, list[str]]:
        images, labels, names = [], [], []
        for fname in files:
            d = read_batch(need(folder / fname, f"{dataset} batch file"))
            data = np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
            images.extend(np.ascontiguousarray(x) for x in data)
            labels.extend(int(y) for y in d[label_key])
            names.extend(f"{fname}[{i}]" for i in range(len(data)))
        return images, np.asarray(labels, np.int64), names

    train, train_labels, train_names = load(train_files)
    test, test_labels, test_names = load(test_files)
    names = read_batch(need(folder / meta, "meta"))[names_key]
    class_names = [n.decode() if isinstance(n, bytes) else n for n in names]
    split = class_split(dataset)
    return RawDataset(
        dataset,
        root,
        class_names,
        list(split.known),
        list(split.novel),
        train,
        train_labels,
        train_names,
        test,
        test_labels,
        test_names,
    )


# ---- ImageNet (ILSVRC-2012 folders): ImageNet-100 and ImageNet-1k ---------------------------------------------

ILSVRC_CLASSES = 1000  # class folders of the ILSVRC-2012 train set; both ImageNet datasets index into their sorted list


def _ilsvrc(root: Path, why_all: str) -> tuple[Path, Path, list[str]]:
    """(train folder, val folder, the 1000 sorted wnids) of an ILSVRC-2012 tree `train/<wnid>/`, `val/<wnid>/`.

    Refuses a train folder without exactly 1000 class folders (`why_all` says why the dataset needs them all) and a
    val folder with no class folders (the flat val download, not yet sorted into class folders)."""
    train_dir = need(root / "train", "ImageNet train folder (train/<wnid>/...)")
    val_dir = need(root / "val", "ImageNet val folder sorted into class folders (val/<wnid>/...)")
    classes = class_dirs(train_dir)
    if len(classes) != ILSVRC_CLASSES:
        raise LayoutError(f"{train_dir} has {len(classes)} class folders: {why_all}")
    if not class_dirs(val_dir):
        raise LayoutError(f"{val_dir} has no class folders: sort the val images into val/<wnid>/ (e.g. valprep.sh)")
    return train_dir, val_dir, classes


def _imagenet100(root: Path) -> RawDataset:
    train_dir, val_dir, classes = _ilsvrc(
        root,
        "ImageNet-100's classes are chosen by index from the 1000 sorted ImageNet-1k folders, so all 1000 must be "
        "there",
    )
    chosen = [classes[i] for i in imagenet100_choice()]  # remapped id j = position in the sorted choice
    notes = ["ImageNet-100 classes: np.random.seed(0) choice of 100 of the 1000 sorted folders, remapped 0..99"]
    return _folder_dataset("imagenet100", root, chosen, train_dir, val_dir, notes)


def _imagenet1k(root: Path) -> RawDataset:
    train_dir, val_dir, classes = _ilsvrc(
        root,
        f"ImageNet-1k (ILSVRC-2012) has {ILSVRC_CLASSES}; point --root at the folder whose train/ holds all "
        f"{ILSVRC_CLASSES} <wnid> folders (for a subset of the classes use --dataset imagefolder)",
    )
    val_classes = class_dirs(val_dir)
    if val_classes != classes:
        diff = []
        for what, names in (
            ("missing", set(classes) - set(val_classes)),
            ("not in train", set(val_classes) - set(classes)),
        ):
            if names:
                few = sorted(names)[:5]
                diff.append(f"{len(names)} {what} ({', '.join(few)}{', ...' if len(names) > len(few) else ''})")
        raise LayoutError(
            f"{val_dir}'s class folders differ from {train_dir}'s ({'; '.join(diff)}): sort the 50,000 val images "
            f"into val/<wnid>/ with the train's {ILSVRC_CLASSES} wnids (e.g. valprep.sh)"
        )
    notes = ["ImageNet-1k classes: the 1000 sorted wnid folders, ids 0..999; known = 0..499, novel = 500..999"]
    return _folder_dataset("imagenet1k", root, classes, train_dir, val_dir, notes)


# ---- CUB and CUB-style files -----------------------------------------------------------------------------------


def _cub_tables(root: Path) -> tuple[Path, list[str], list[str], list[int], list[str], dict[str, int]]:
    """(folder, image ids, relative paths, 0-based class ids, class names, split flag by image id), images.txt order."""
    folder = first_existing([root / "CUB_200_2011", root], "CUB folder with images.txt")
    if not (folder / "images.txt").exists():
        folder = root
    images = read_id_file(need(folder / "images.txt", "CUB images.txt"))
    labels = dict(read_id_file(need(folder / "image_class_labels.txt", "CUB image_class_labels.txt")))
    missing = [i for i, _ in images if i not in labels]
    if missing:
        raise LayoutError(f"{folder}/image_class_labels.txt has no label for image ids {missing[:5]}")
    cls = [int(labels[i]) for i, _ in images]
    base = min(cls)  # official CUB ids start at 1; the CUB-style variant at 0
    cls = [c - base for c in cls]
    n = max(cls) + 1
    names = [str(c) for c in range(n)]
    if (folder / "classes.txt").exists():
        for cid, name in read_id_file(folder / "classes.txt"):
            if 0 <= int(cid) - base < n:
                names[int(cid) - base] = name
    split_file = folder / "train_test_split.txt"
    flags = {i: int(f) for i, f in read_id_file(split_file)} if split_file.exists() else {}
    return folder, [i for i, _ in images], [p for _, p in images], cls, names, flags


def _cub(root: Path) -> RawDataset:
    folder, ids, rel, cls, names, flags = _cub_tables(root)
    if len(names) != 200:
        raise LayoutError(
            f"{folder} has {len(names)} classes, CUB-200-2011 has 200: use --dataset cubfiles for subsets"
        )
    if not flags:
        raise LayoutError(f"{folder}/train_test_split.txt is missing: CUB's train/test split comes from it")
    img_dir = need(folder / "images", "CUB images folder")
    train_idx = [k for k, i in enumerate(ids) if flags[i] == 1]
    test_idx = [k for k, i in enumerate(ids) if flags[i] == 0]
    split = class_split("cub")

    def take(idx: list[int]) -> tuple[list[str], np.ndarray, list[str]]:
        return [str(img_dir / rel[k]) for k in idx], np.asarray([cls[k] for k in idx], np.int64), [rel[k] for k in idx]

    return RawDataset("cub", root, names, list(split.known), list(split.novel), *take(train_idx), *take(test_idx))


def _cubfiles(root: Path) -> RawDataset:
    folder, _, rel, cls, names, _ = _cub_tables(root)
    img_dir = need(folder / "images", "images folder")
    return RawDataset(
        "cubfiles",
        root,
        names,
        [],
        [],
        [str(img_dir / p) for p in rel],
        np.asarray(cls, np.int64),
        rel,
        notes=["cubfiles: every image is a train image (train_test_split.txt, if any, is not used); no test split"],
    )


# ---- Stanford Cars ---------------------------------------------------------------------------------------------


def _mat_annotations(path: Path) -> list:
    from scipy.io import loadmat

    return list(loadmat(str(path))["annotations"][0])


def _field(rec, name: str):
    value = rec[name]
    while isinstance(value, np.ndarray):
        value = value.reshape(-1)[0] if value.size else None
    return value.item() if isinstance(value, np.generic) else value


def _scars(root: Path) -> RawDataset:
    from scipy.io import loadmat

    split = class_split("scars")
    devkit = root / "devkit"
    if (devkit / "cars_train_annos.mat").exists():
        test_annos = first_existing(
            [root / "cars_test_annos_withlabels.mat", devkit / "cars_test_annos_withlabels.mat"],
            "Stanford Cars test labels (cars_test_annos_withlabels.mat)",
        )
        out = []
        for annos, img_dir in ((devkit / "cars_train_annos.mat", "cars_train"), (test_annos, "cars_test")):
            recs = _mat_annotations(annos)
            rel = [f"{img_dir}/{_field(r, 'fname')}" for r in recs]
            out.append(([str(root / p) for p in rel], np.asarray([int(_field(r, "class")) - 1 for r in recs]), rel))
        meta = devkit / "cars_meta.mat"
        (train, train_labels, train_names), (test, test_labels, test_names) = out
    elif (root / "cars_annos.mat").exists():
        meta = root / "cars_annos.mat"
        recs = _mat_annotations(meta)
        rel = [str(_field(r, "relative_im_path")) for r in recs]
        labels = np.asarray([int(_field(r, "class")) - 1 for r in recs])
        is_test = np.asarray([int(_field(r, "test")) for r in recs], bool)
        tr, te = np.flatnonzero(~is_test), np.flatnonzero(is_test)
        train, train_labels, train_names = [str(root / rel[i]) for i in tr], labels[tr], [rel[i] for i in tr]
        test, test_labels, test_names = [str(root / rel[i]) for i in te], labels[te], [rel[i] for i in te]
    else:
        raise LayoutError(f"{root}: neither devkit/cars_train_annos.mat nor cars_annos.mat found (Stanford Cars)")
    names = [str(i) for i in range(196)]
    if meta.exists():
        m = loadmat(str(meta))
        if "class_names" in m:
            names = [str(np.asarray(x).reshape(-1)[0]) for x in m["class_names"].reshape(-1)]
    return RawDataset(
        "scars",
        root,
        names,
        list(split.known),
        list(split.novel),
        train,
        train_labels.astype(np.int64),
        train_names,
        test,
        test_labels.astype(np.int64),
        test_names,
    )


# ---- FGVC-Aircraft ---------------------------------------------------------------------------------------------


def _aircraft(root: Path) -> RawDataset:
    data = first_existing([root / "fgvc-aircraft-2013b" / "data", root / "data", root], "FGVC-Aircraft data folder")
    if not (data / "images_variant_trainval.txt").exists():
        raise LayoutError(f"{data}/images_variant_trainval.txt not found (FGVC-Aircraft 2013b)")

    def parse(name: str) -> tuple[list[str], list[str]]:
        ids, variants = [], []
        for line in need(data / name, "FGVC-Aircraft list").read_text().splitlines():
            if line.strip():
                img_id, variant = line.split(" ", 1)
                ids.append(img_id)
                variants.append(variant.strip())
        return ids, variants

    tr_ids, tr_var = parse("images_variant_trainval.txt")
    te_ids, te_var = parse("images_variant_test.txt")
    # The reference indexes classes by np.unique of the names with their trailing '\n'; '\n' sorts before every
    # printable character, so that order equals the sorted stripped names.
    classes = sorted(set(tr_var))
    if set(te_var) - set(classes):
        raise LayoutError(f"test variants {sorted(set(te_var) - set(classes))[:5]} do not occur in trainval")
    index = {c: i for i, c in enumerate(classes)}
    split = class_split("aircraft")

    def take(ids: list[str], var: list[str]) -> tuple[list[str], np.ndarray, list[str]]:
        rel = [f"images/{i}.jpg" for i in ids]
        return [str(data / p) for p in rel], np.asarray([index[v] for v in var], np.int64), rel

    return RawDataset(
        "aircraft", root, classes, list(split.known), list(split.novel), *take(tr_ids, tr_var), *take(te_ids, te_var)
    )


# ---- Oxford-IIIT Pets ------------------------------------------------------------------------------------------


def _pets(root: Path) -> RawDataset:
    ann = need(root / "annotations", "Oxford-IIIT Pet annotations folder")
    names: dict[int, str] = {}

    def parse(fname: str) -> tuple[list[str], np.ndarray, list[str]]:
        rel, labels = [], []
        for line in need(ann / fname, "Pets list").read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            stem, class_id = line.split()[:2]
            rel.append(f"images/{stem}.jpg")
            labels.append(int(class_id) - 1)
            names.setdefault(int(class_id) - 1, stem.rsplit("_", 1)[0])
        return [str(root / p) for p in rel], np.asarray(labels, np.int64), rel

    train = parse("trainval.txt")
    test = parse("test.txt")
    split = class_split("pets")
    class_names = [names.get(i, str(i)) for i in range(37)]
    return RawDataset("pets", root, class_names, list(split.known), list(split.novel), *train, *test)


# ---- Herbarium 2019 --------------------------------------------------------------------------------------------


def _herbarium19(root: Path) -> RawDataset:
    train_dir = need(root / "small-train", "Herbarium19 small-train folder")
    val_dir = need(root / "small-validation", "Herbarium19 small-validation folder")
    classes = class_dirs(train_dir)  # ImageFolder: lexicographic folder order; the pickle's ids refer to it
    if len(classes) != 683:
        raise LayoutError(f"{train_dir} has {len(classes)} class folders, Herbarium19 has 683")
    notes = []
    val_classes = class_dirs(val_dir)
    if val_classes != classes:
        notes.append(
            f"small-validation has {len(val_classes)} class folders, not the train's 683: its images are labelled by "
            "folder name (the reference's own ImageFolder would shift the indices)"
        )
    return _folder_dataset("herbarium19", root, classes, train_dir, val_dir, notes)


# ---- generic ImageFolder ---------------------------------------------------------------------------------------


def _imagefolder(root: Path) -> RawDataset:
    if (root / "train").is_dir():
        train_dir = root / "train"
        test_dir = next((root / d for d in ("test", "val") if (root / d).is_dir()), None)
    else:
        train_dir, test_dir = root, None
    classes = class_dirs(train_dir)
    if not classes:
        raise LayoutError(f"{train_dir} has no class folders (expected <class>/<image> or train/<class>/<image>)")
    notes = [] if test_dir else ["imagefolder: no train/ + test/ (or val/) folders, so every image is a train image"]
    return _folder_dataset("imagefolder", root, classes, train_dir, test_dir, notes)


_READERS = {
    "cifar10": lambda r: _cifar(r, "cifar10"),
    "cifar100": lambda r: _cifar(r, "cifar100"),
    "imagenet100": _imagenet100,
    "imagenet1k": _imagenet1k,
    "cub": _cub,
    "scars": _scars,
    "aircraft": _aircraft,
    "pets": _pets,
    "herbarium19": _herbarium19,
    "imagefolder": _imagefolder,
    "cubfiles": _cubfiles,
    DISCOVERY: read_discovery,
}
