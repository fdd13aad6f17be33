"""Your own images (`--dataset discovery`): `labelled/<class>/...` (the known classes) + `unlabelled/...` (a pool with
no labels, the images to sort)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ...common.labels import NO_LABEL
from ...common.wording import counted
from ..shard_format import DISCOVERY, IMAGE_SUFFIXES
from .layout_common import LayoutError, RawDataset, class_dirs, need, relative_paths

DISCOVERY_LAYOUT = (
    "labelled/<class>/<image> (the known classes, one folder each) and unlabelled/<image> (the pool to sort, any "
    "sub-folders)"
)


def _walk_images(directory: Path) -> tuple[list[str], list[str]]:
    """(image files, other files) under `directory`, in sorted os.walk order (links followed, each folder once: a
    link back up the tree would list its images again at every level)."""
    walked, seen = [], set()
    for dirpath, dirnames, fnames in os.walk(directory, followlinks=True):
        dirnames.sort()  # the first of two paths to one folder is the one listed
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:
            dirnames.clear()
            continue
        seen.add((st.st_dev, st.st_ino))
        walked.append((dirpath, fnames))
    images, others = [], []
    for dirpath, fnames in sorted(walked):
        for fname in sorted(fnames):
            (images if fname.lower().endswith(IMAGE_SUFFIXES) else others).append(os.path.join(dirpath, fname))
    return images, others


def _refuse_linked_twice(paths: list[str], root: Path) -> None:
    """A LayoutError when links make two of `paths` one file: it would be read twice, maybe under two labels."""
    first: dict[str, str] = {}
    for p in paths:
        seen = first.setdefault(os.path.realpath(p), p)
        if seen != p:
            raise LayoutError(
                f"{_few([seen, p], root)} are one file (reached through a link): "
                "each image must appear once; remove the link or the copy"
            )


def _shown(name: str) -> str:
    """`name` as a message shows it: quoted and escaped when it holds a newline or another unprintable character."""
    return name if name.isprintable() else repr(name)


def _few(paths: list[str], root: Path, n: int = 3) -> str:
    shown = ", ".join(_shown(os.path.relpath(p, root)) for p in paths[:n])
    return shown + (", ..." if len(paths) > n else "")


def _labelled_images(labelled: Path, root: Path) -> tuple[list[str], list[str], list[int], list[str]]:
    """(class names, image paths, their class ids, other files) of `labelled/<class>/...`; class id = position in
    the sorted folder names (ImageFolder's order)."""
    classes = class_dirs(labelled)
    loose = [e.path for e in os.scandir(labelled) if e.is_file() and e.name.lower().endswith(IMAGE_SUFFIXES)]
    if loose:
        raise LayoutError(
            f"{len(loose)} image(s) lie directly in {labelled} ({_few(sorted(loose), root)}), outside a "
            "class folder: move each into labelled/<its class>/"
        )
    if not classes:
        raise LayoutError(f"{labelled} has no class folders: the layout is {DISCOVERY_LAYOUT}")
    paths, labels, others, empty = [], [], [], []
    for idx, name in enumerate(classes):
        images, rest = _walk_images(labelled / name)
        if not images:
            empty.append(name)
        paths += images
        labels += [idx] * len(images)
        others += rest
    if empty:
        raise LayoutError(
            f"{len(empty)} of the {len(classes)} class folders under {labelled} hold no images "
            f"({', '.join(map(_shown, empty[:5]))}{', ...' if len(empty) > 5 else ''}): add images of those classes "
            f"or remove the folders (images end in {', '.join(IMAGE_SUFFIXES)})"
        )
    return classes, paths, labels, others


def read_discovery(root: Path) -> RawDataset:
    """Your own images: every class folder of labelled/ is a known class (ids in sorted folder order), every image of
    unlabelled/ a pool image with no label (target NO_LABEL). Files that are not images (by extension) are left out
    and counted in a note."""
    labelled = need(root / "labelled", f"the labelled images; the layout is {DISCOVERY_LAYOUT}")
    unlabelled = need(root / "unlabelled", f"the unlabelled pool; the layout is {DISCOVERY_LAYOUT}")
    classes, paths, labels, others = _labelled_images(labelled, root)
    pool, rest = _walk_images(unlabelled)
    if not pool:
        raise LayoutError(
            f"{unlabelled} holds no images (files ending in {', '.join(IMAGE_SUFFIXES)}): put the "
            "images to sort there (to train on labelled images alone, use --dataset imagefolder)"
        )
    others += rest
    _refuse_linked_twice(paths + pool, root)
    notes = [
        f"discovery: {counted(len(classes), 'known class')} ({counted(len(paths), 'labelled image')}), "
        f"{counted(len(pool), 'unlabelled image')}; the number of novel classes is unknown (train with "
        "kmeans.n_clusters: auto or a number)"
    ]
    if others:
        notes.append(f"{len(others)} file(s) are not images by their extension and are left out: {_few(others, root)}")
    train = paths + pool
    train_labels = np.asarray(labels + [NO_LABEL] * len(pool), np.int64)
    names, known = relative_paths(train, root), list(range(len(classes)))
    return RawDataset(DISCOVERY, root, classes, known, [], train, train_labels, names, notes=notes)
