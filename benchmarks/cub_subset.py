"""A CUB-style folder holding the first species of another (realdata/cub100): what the benchmarks on real birds train
or stream from, at a chosen size."""

from __future__ import annotations

from pathlib import Path


def write_cub_subset(src: Path, classes: int, dst: Path) -> Path:
    """`dst` as a CUB-style folder with the first `classes` species of `src` (id files filtered, images linked)."""
    if not (src / "images.txt").is_file():
        raise FileNotFoundError(f"{src} is not a CUB-style folder (no images.txt): point INFOSIEVE_REALDATA at it")
    dst.mkdir(parents=True, exist_ok=True)
    labels = dict(line.split(", ") for line in (src / "image_class_labels.txt").read_text().splitlines())
    keep = {i for i, c in labels.items() if int(c) < classes}
    for name in ("images.txt", "image_class_labels.txt"):
        lines = [x for x in (src / name).read_text().splitlines() if x.split(", ")[0] in keep]
        (dst / name).write_text("\n".join(lines) + "\n")
    lines = [x for x in (src / "classes.txt").read_text().splitlines() if int(x.split(", ")[0]) < classes]
    (dst / "classes.txt").write_text("\n".join(lines) + "\n")
    if not (dst / "images").exists():
        (dst / "images").symlink_to(src / "images")
    return dst
