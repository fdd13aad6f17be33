"""`infosieve export --run RUN --out DIR`: the run's discovery folder written again with its named clusters as known
classes, for the next round (`make-shards --dataset discovery` then `train` read them as labelled).

DIR gets the layout make-shards read (data/writing/layout_discovery.py): every image of `labelled/<class>/` as it
was, each pool image of a named cluster (RUN/names.json, by the final clustering RUN/clustering.npz) under
`labelled/<name>/` at its path below `unlabelled/`, and every other pool image (of an unnamed cluster, or left out of
the clustering as unreadable) under `unlabelled/` where it was. Files are hard-linked where the file system allows,
copied where not; the user's folder is only read. Files that are not images (by extension) are not written, as
make-shards leaves them out too. DIR must be new or empty.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from .cluster_names import read_names
from .metrics import NO_LABEL
from .run_reader import CLUSTERING, read_clustering


def placed_files(names: list[str], clustering: dict, given: dict[int, str]) -> dict[str, str]:
    """{source path: path in DIR} (relative to the two folders) of every train image, `names` by uq."""
    pool = np.asarray(clustering["targets"]) == NO_LABEL
    cluster_of = dict(zip(np.asarray(clustering["uq"])[pool].tolist(), np.asarray(clustering["preds"])[pool].tolist(),
                          strict=True))  # fmt: skip
    placed = {}
    for uq, name in enumerate(names):
        k = cluster_of.get(uq)
        if name.startswith("unlabelled/") and k in given:
            placed[name] = f"labelled/{given[k]}/{name.removeprefix('unlabelled/')}"
        else:
            placed[name] = name
    return placed


def link_or_copy(source: Path, target: Path) -> None:
    """`target` as a hard link to `source` (the file the link points to, for a symbolic link), else a copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source.resolve(), target)
    except OSError:  # another file system, or links not permitted
        shutil.copy2(source, target)


def export_run(run: str | Path, out: str | Path) -> dict:
    """Write the next round's discovery folder into `out` (see the module doc); returns what went where."""
    from .checkpoint import load_checkpoint
    from .config import from_saved
    from .run_images import run_images

    run, out = Path(run), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} is not an empty folder: export writes a new discovery folder there")
    given = read_names(run)
    if not given:
        raise ValueError(f"{run} has no named cluster: name one first (infosieve name --run {run} novel-K=NAME)")
    clustering = read_clustering(run)
    if clustering is None:
        raise FileNotFoundError(f"{run / CLUSTERING} not found: the run has not finished (its final clustering)")
    state = load_checkpoint(run)
    images = run_images(run, from_saved(state["config"]).data.shards)
    placed = placed_files(images.names, clustering, given)
    for source, target in placed.items():
        link_or_copy(images.root / source, out / target)
    moved = {name: sum(t.startswith(f"labelled/{name}/") for t in placed.values()) for name in given.values()}
    return {
        "out": str(out),
        "labelled": sum(t.startswith("labelled/") for t in placed.values()),
        "named": moved,
        "unlabelled": sum(t.startswith("unlabelled/") for t in placed.values()),
    }
