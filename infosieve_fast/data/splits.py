"""GCD splits: which classes are known, which of their images are labelled (docs/reference.md §7).

`labelled_subset` and `gcd_split` are the core recipe. Below them: the class lists of the eight datasets exactly as the
reference code uses them (SSB lists with the novel classes in the order Hard + Medium + Easy, the ImageNet-100 class
choice, the Herbarium19 `Old` list in its lexicographic-folder indices), kept as package data in `classes/*.txt`,
ImageNet-1k's split (GCD's: the first 500 of the 1000 sorted classes known, the same recipe) and the counts of
docs/reference.md §7's table, so that a dataset read from its native layout can be checked against them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import numpy as np

from ..common.labels import NO_LABEL


def labelled_subset(n: int, prop: float = 0.5, seed: int = 0) -> np.ndarray:
    """The reference's `subsample_instances`: `RandomState(seed).permutation(n)[:int(prop * n)]`."""
    return np.random.RandomState(seed).permutation(n)[: int(prop * n)]


def gcd_split(
    targets: Sequence[int] | np.ndarray,
    known_classes: Sequence[int],
    prop: float = 0.5,
    seed: int = 0,
    *,
    novel_classes: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(labelled mask, remapped targets) of a train set, in the dataset's native order.

    Labelled = `prop` of the known-class images chosen by `labelled_subset` over the known-class images in native
    order. Targets are remapped known classes first (in `known_classes` order), then the rest in ascending order, or
    in `novel_classes` order when it is given (the SSB datasets: Hard + Medium + Easy); a target in neither list is an
    error then.
    """
    targets = np.asarray(targets)
    known = list(known_classes)
    if len(set(known)) != len(known):
        raise ValueError(f"known_classes has duplicates: {known}")
    present = set(targets.tolist())
    missing = sorted(set(known) - present)
    if missing:
        raise ValueError(  # every place a user names the known classes: this function serves them all
            f"known classes {missing} have no images in the train set: check --known-classes (make-shards), "
            "data.intake.known_classes (training on foreign shards) or data.digits.known_classes"
        )
    if novel_classes is None:
        novel = sorted(present - set(known))
    else:
        novel = list(novel_classes)
        if len(set(novel)) != len(novel) or set(novel) & set(known):
            raise ValueError("novel_classes must be distinct and disjoint from known_classes")
        stray = sorted(present - set(known) - set(novel))
        if stray:
            raise ValueError(f"classes {stray[:10]} are neither known nor novel: the class lists do not fit this data")
    remap = {c: i for i, c in enumerate(known + novel)}
    known_idx = np.flatnonzero(np.isin(targets, known))
    labelled = np.zeros(len(targets), dtype=bool)
    labelled[known_idx[labelled_subset(len(known_idx), prop, seed)]] = True
    return labelled, np.array([remap[t] for t in targets.tolist()], dtype=np.int64)


def holdout_mask(labels: Sequence[int] | np.ndarray, share: float, seed: int = 0) -> np.ndarray:
    """The labelled images held out for evaluation (bool [N]): per class in ascending class order, the first
    `int(share * n_c)` of `RandomState(seed)`'s permutation of its n_c images (one generator for every class), but
    never the class's last image, so every class keeps a labelled one. Images whose label is `NO_LABEL` are never
    held out."""
    labels = np.asarray(labels)
    if not 0.0 <= share < 1.0:
        raise ValueError(f"the held-out share must lie in [0, 1), got {share}: e.g. --holdout 0.1")
    held = np.zeros(len(labels), bool)
    rng = np.random.RandomState(seed)
    for c in np.unique(labels[labels != NO_LABEL]):
        members = np.flatnonzero(labels == c)
        take = min(int(share * len(members)), len(members) - 1)
        held[members[rng.permutation(len(members))[:take]]] = True
    return held


def discovery_split(labels: Sequence[int] | np.ndarray, holdout: float = 0.0, seed: int = 0) -> tuple[np.ndarray, ...]:
    """(labelled mask, targets, held-out mask) of your own images: `labels` are class ids for the labelled images
    and `NO_LABEL` for the pool. Every labelled image is labelled except the `holdout_mask` share, whose labels are
    withheld from training and kept as targets for evaluation; the pool keeps `NO_LABEL` as its target."""
    labels = np.asarray(labels, np.int64)
    held = holdout_mask(labels, holdout, seed)
    return (labels != NO_LABEL) & ~held, labels.copy(), held


def discovery_counts(labels: np.ndarray, held: np.ndarray) -> dict[str, int]:
    """Counts of a discovery train set: labelled (used as such), held out, unlabelled (the pool), classes."""
    pool = np.asarray(labels) == NO_LABEL
    return {
        "train": int(len(labels)),
        "labelled": int((~pool & ~held).sum()),
        "held_out": int(held.sum()),
        "unlabelled": int(pool.sum()),
        "known_classes_present": int(len(np.unique(labels[~pool]))),
        "test": 0,
    }


def split_counts(labelled: np.ndarray, targets: np.ndarray, n_old: int, n_test: int | None = None) -> dict[str, int]:
    """Counts of a GCD train split (remapped targets): labelled, unlabelled, known/novel images and classes."""
    labelled, targets = np.asarray(labelled, bool), np.asarray(targets)
    known = targets < n_old
    out = {
        "train": int(len(targets)),
        "labelled": int(labelled.sum()),
        "unlabelled": int((~labelled).sum()),
        "unlabelled_known": int((~labelled & known).sum()),
        "unlabelled_novel": int((~labelled & ~known).sum()),
        "known_classes_present": int(len(np.unique(targets[known]))),
        "novel_classes_present": int(len(np.unique(targets[~known]))),
    }
    if n_test is not None:
        out["test"] = int(n_test)
    return out


def _class_table(name: str) -> tuple[int, ...]:
    """A class list of `classes/<name>.txt` (package data): 0-based native class ids, one per line, in file order."""
    text = (resources.files(__package__) / "classes" / f"{name}.txt").read_text(encoding="utf-8")
    return tuple(int(line) for line in text.split())


# Class lists in the order the reference code uses (docs/reference.md §7), transcribed from it into `classes/*.txt`;
# `tests/test_data_splits.py` pins their content.
CUB_KNOWN = _class_table("cub_known")
CUB_NOVEL = _class_table("cub_novel")
SCARS_KNOWN = _class_table("scars_known")
SCARS_NOVEL = _class_table("scars_novel")
AIRCRAFT_KNOWN = _class_table("aircraft_known")
AIRCRAFT_NOVEL = _class_table("aircraft_novel")
IMAGENET100_CLASSES = _class_table("imagenet100_classes")
HERBARIUM19_OLD = _class_table("herbarium19_old")


def imagenet100_choice(seed: int = 0) -> list[int]:
    """The reference's ImageNet-100 classes: `np.random.seed(0); sort(choice(1000, 100, replace=False))`."""
    return np.sort(np.random.RandomState(seed).choice(range(1000), size=(100,), replace=False)).tolist()


def herbarium19_new(old: Sequence[int] = HERBARIUM19_OLD, n_classes: int = 683) -> list[int]:
    """Herbarium19 `New`: the sorted complement of `Old` in range(683)."""
    return sorted(set(range(n_classes)) - set(old))


@dataclass(frozen=True)
class ClassSplit:
    """Known and novel native class ids, in remapping order (known first)."""

    known: tuple[int, ...]
    novel: tuple[int, ...]

    @property
    def order(self) -> list[int]:
        return list(self.known) + list(self.novel)


def class_split(dataset: str) -> ClassSplit:
    """The reference's known/novel native class ids of one of the eight datasets, or of ImageNet-1k (GCD's split:
    the first 500 of the 1000 sorted wnid classes known)."""
    if dataset == "cifar10":
        return ClassSplit(tuple(range(5)), tuple(range(5, 10)))
    if dataset == "cifar100":
        return ClassSplit(tuple(range(80)), tuple(range(80, 100)))
    if dataset == "imagenet100":  # ids in the remapped 0..99 space of the 100 chosen classes
        return ClassSplit(tuple(range(50)), tuple(range(50, 100)))
    if dataset == "imagenet1k":  # ids = positions in the 1000 sorted wnid folders; GCD's `range(500)`
        return ClassSplit(tuple(range(500)), tuple(range(500, 1000)))
    if dataset == "cub":
        return ClassSplit(CUB_KNOWN, CUB_NOVEL)
    if dataset == "scars":
        return ClassSplit(SCARS_KNOWN, SCARS_NOVEL)
    if dataset == "aircraft":
        return ClassSplit(AIRCRAFT_KNOWN, AIRCRAFT_NOVEL)
    if dataset == "pets":
        return ClassSplit(tuple(range(19)), tuple(range(19, 37)))
    if dataset == "herbarium19":
        return ClassSplit(HERBARIUM19_OLD, tuple(herbarium19_new()))
    raise KeyError(f"no reference class split for dataset {dataset!r}")


# docs/reference.md §7's table, for the full official datasets. `approx`: the table gives ≈ values (relative tolerance);
# `train` is the official train-set size, used to tell the full dataset from a partial copy.
# ImageNet-1k has no entry, so its counts are not checked: the labelled count is half of the images of the first 500
# sorted wnid classes, which the totals (1,281,167 train, 50,000 val) do not determine (train classes hold 732 to
# 1,300 images each).
EXPECTED_COUNTS: dict[str, dict] = {
    "cifar10": {"train": 50_000, "labelled": 12_500, "unlabelled": 37_500, "test": 10_000, "approx": 0.0},
    "cifar100": {"train": 50_000, "labelled": 20_000, "unlabelled": 30_000, "test": 10_000, "approx": 0.0},
    "imagenet100": {"train_min": 100_000, "labelled": 31_900, "unlabelled": 95_300, "test": 5_000, "approx": 0.01},
    "cub": {"train": 5_994, "labelled": 1_498, "unlabelled": 4_496, "test": 5_794, "approx": 0.0},
    "scars": {"train": 8_144, "labelled": 2_000, "unlabelled": 6_100, "test": 8_041, "approx": 0.03},
    "aircraft": {"train": 6_667, "labelled": 1_670, "unlabelled": 5_000, "test": 3_333, "approx": 0.01},
    "pets": {"train": 3_680, "labelled": 942, "unlabelled": 2_738, "test": 3_669, "approx": 0.0},
    "herbarium19": {"train": 34_225, "labelled": 8_900, "unlabelled": 25_400, "approx": 0.01},
}


def check_counts(dataset: str, counts: dict[str, int]) -> list[str]:
    """Differences between `counts` and docs/reference.md §7's table; [] when they agree or when no check applies.

    The check applies only to the full official dataset (its train size, where the table implies one); a partial copy
    (a test tree, a subset) is not compared. ImageNet-100's train size is only known approximately: it is compared when
    it holds over 100,000 images.
    """
    exp = EXPECTED_COUNTS.get(dataset)
    if exp is None:
        return []
    if "train" in exp and counts.get("train") != exp["train"]:
        return []
    if counts.get("train", 0) < exp.get("train_min", 0):
        return []
    tol = exp["approx"]
    problems = []
    for key in ("labelled", "unlabelled", "test"):
        if key not in exp or key not in counts:
            continue
        want, got = exp[key], counts[key]
        if abs(got - want) > tol * want:
            problems.append(f"{dataset}: {key} = {got:,}, docs/reference.md §7 says {'≈' if tol else ''}{want:,}")
    return problems
