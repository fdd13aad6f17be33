"""What every dataset layout reader shares: the `RawDataset` it returns, `LayoutError`, and the file-walking helpers
(torchvision's ImageFolder order, CUB-style id files)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..shard_format import IMAGE_SUFFIXES


class LayoutError(ValueError):
    """The folder does not hold the dataset in the expected layout."""


@dataclass
class RawDataset:
    """A dataset as read from disk: sources are file paths or HxWx3 uint8 arrays (CIFAR)."""

    dataset: str
    root: Path
    class_names: list[str]  # native class id -> name
    known: list[int]  # native ids, remapping order
    novel: list[int]
    train: list  # str path or np.ndarray per sample, native order
    train_labels: np.ndarray  # native class ids
    train_names: list[str]  # what to call each sample in reports (path relative to root, or file[index])
    test: list = field(default_factory=list)
    test_labels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    test_names: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def need(path: Path, what: str) -> Path:
    """`path`, which must exist (`what` names it in the error)."""
    if not path.exists():
        raise LayoutError(f"{what}: {path} not found")
    return path


def first_existing(candidates: list[Path], what: str) -> Path:
    """The first of `candidates` that exists."""
    for c in candidates:
        if c.exists():
            return c
    raise LayoutError(f"{what}: none of {', '.join(str(c) for c in candidates)} exists")


def image_folder(directory: Path, classes: list[str]) -> tuple[list[str], list[int]]:
    """torchvision `make_dataset` order: classes in the given order, files by sorted os.walk, known extensions."""
    paths, labels = [], []
    for idx, name in enumerate(classes):
        target = directory / name
        if not target.is_dir():
            continue
        for dirpath, _, fnames in sorted(os.walk(target, followlinks=True)):
            for fname in sorted(fnames):
                if fname.lower().endswith(IMAGE_SUFFIXES):
                    paths.append(os.path.join(dirpath, fname))
                    labels.append(idx)
    return paths, labels


def class_dirs(directory: Path) -> list[str]:
    """ImageFolder's class order: sorted (lexicographic) sub-folder names."""
    return sorted(e.name for e in os.scandir(directory) if e.is_dir())


def relative_paths(paths: list[str], root: Path) -> list[str]:
    return [os.path.relpath(p, root) for p in paths]


def read_id_file(path: Path) -> list[tuple[str, str]]:
    """Lines 'id rest' or 'id, rest' (CUB's files and the CUB-style variant with ', ')."""
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = re.split(r",?\s+", line, maxsplit=1)
        if len(parts) != 2:
            raise LayoutError(f"{path}: cannot parse line {line!r}")
        rows.append((parts[0], parts[1]))
    return rows
