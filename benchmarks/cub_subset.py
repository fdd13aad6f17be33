"""A CUB-style folder holding a range of species of another (realdata/cub100): what the benchmarks on real birds
train or stream from, at a chosen size."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks.tools.provenance import ROOT

REALDATA = Path(os.environ.get("INFOSIEVE_REALDATA", ROOT.parent / "shared" / "realdata"))


def write_cub_subset(src: Path, classes: int, dst: Path, first: int = 0) -> Path:
    """`dst` as a CUB-style folder with `classes` species of `src` from id `first` on (ids renumbered from 0, so the
    first half of the range is known under the GCD split; id files filtered, images linked)."""
    if not (src / "images.txt").is_file():
        raise FileNotFoundError(f"{src} is not a CUB-style folder (no images.txt): point INFOSIEVE_REALDATA at it")
    names = dict(line.split(", ", 1) for line in (src / "classes.txt").read_text().splitlines())
    if first < 0 or first + classes > len(names):
        raise ValueError(f"species {first}..{first + classes - 1} do not exist: {src} holds {len(names)} (0..)")
    dst.mkdir(parents=True, exist_ok=True)
    labels = dict(line.split(", ") for line in (src / "image_class_labels.txt").read_text().splitlines())
    keep = {i: int(c) - first for i, c in labels.items() if first <= int(c) < first + classes}
    images = [x for x in (src / "images.txt").read_text().splitlines() if x.split(", ")[0] in keep]
    (dst / "images.txt").write_text("\n".join(images) + "\n")
    (dst / "image_class_labels.txt").write_text("".join(f"{i}, {c}\n" for i, c in keep.items()))
    (dst / "classes.txt").write_text("".join(f"{c}, {names[str(first + c)]}\n" for c in range(classes)))
    if not (dst / "images").exists():
        (dst / "images").symlink_to(src / "images")
    return dst


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--classes", type=int, default=20, help="how many species (the first half known)")
    parser.add_argument("--first-class", type=int, default=0, help="the cub100 id of the first species")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (images are linked, not copied)")
    args = parser.parse_args(argv)
    dst = write_cub_subset(REALDATA / "cub100", args.classes, args.out, first=args.first_class)
    print(dst)
    return dst


if __name__ == "__main__":
    main()
