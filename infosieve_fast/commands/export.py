"""`infosieve export --run RUN --out DIR`: the run's discovery folder written again with its named clusters as known
classes, for the next round (`make-shards --dataset discovery` then `train` read them as labelled).

DIR gets the layout make-shards read (data/writing/layout_discovery.py): every image of `labelled/<class>/` as it
was, each pool image of a named cluster (RUN/names.json, by the final clustering RUN/clustering.npz) under
`labelled/<name>/` at its path below `unlabelled/`, and every other pool image (of an unnamed cluster, or left out of
the clustering as unreadable) under `unlabelled/` where it was. Files are hard-linked where the file system allows,
copied where not; the user's folder is only read. Files that are not images (by extension) are not written, as
make-shards leaves them out too. DIR must be new or empty.

Nothing escapes DIR and nothing is overwritten: the names come from RUN/names.json checked as `infosieve name` checks
them (file_names.py), a file is never written over another (a link or a copy to a path that exists is refused), and
the folder is written beside DIR under a temporary name and renamed to DIR only when complete, so a failed export
leaves no half-written DIR.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path

import numpy as np

from ..analysis.cluster_names import read_names
from ..common.labels import NO_LABEL
from ..training.run_files import CLUSTERING, read_clustering


def placed_files(names: list[str], clustering: dict, given: dict[int, str]) -> dict[str, str]:
    """{source path: path in DIR} (relative to the two folders) of every train image, `names` by uq."""
    pool = np.asarray(clustering["targets"]) == NO_LABEL
    cluster_of = dict(
        zip(np.asarray(clustering["uq"])[pool].tolist(), np.asarray(clustering["preds"])[pool].tolist(), strict=True)
    )
    placed = {}
    for uq, name in enumerate(names):
        k = cluster_of.get(uq)
        if name.startswith("unlabelled/") and k in given:
            placed[name] = f"labelled/{given[k]}/{name.removeprefix('unlabelled/')}"
        else:
            placed[name] = name
    return placed


def link_or_copy(source: Path, target: Path) -> None:
    """`target` as a hard link to `source` (the file the link points to, for a symbolic link), else a copy; a
    `target` that exists is never written over."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source.resolve(), target)
    except FileExistsError:
        raise FileExistsError(f"export: {target} would be written twice: two images map to one file") from None
    except OSError:  # another file system, or links not permitted: a copy, created only where nothing is
        with open(source, "rb") as src, open(target, "xb") as dst:
            shutil.copyfileobj(src, dst)
        shutil.copystat(source, target)


def write_beside(out: Path, write) -> None:
    """`write(folder)` into a new temporary folder beside `out`, then that folder renamed to `out` (new, or an empty
    folder, which the rename replaces); on any failure the temporary folder is removed and `out` is as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = out.parent / f".{out.name[:200]}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    folder.mkdir()  # exclusive, with the umask's mode (mkdtemp's own 0700 would hide the result from others)
    try:
        write(folder)
        try:
            os.rename(folder, out)
        except OSError as err:  # `out` gained files meanwhile: it is not replaced
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise FileExistsError(f"--out {out} is not an empty folder any more: export wrote nothing there") from None
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def export_run(run: str | Path, out: str | Path) -> dict:
    """Write the next round's discovery folder into `out` (see the module doc); returns what went where."""
    from ..analysis.run_images import run_images
    from ..config.settings import from_saved
    from ..training.checkpoint import load_checkpoint

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

    def write(folder: Path) -> None:
        for source, target in placed.items():
            link_or_copy(images.root / source, folder / target)

    write_beside(out, write)
    moved = {name: sum(t.startswith(f"labelled/{name}/") for t in placed.values()) for name in given.values()}
    return {
        "out": str(out),
        "labelled": sum(t.startswith("labelled/") for t in placed.values()),
        "named": moved,
        "unlabelled": sum(t.startswith("unlabelled/") for t in placed.values()),
    }
