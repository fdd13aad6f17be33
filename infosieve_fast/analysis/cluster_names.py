"""Names you give a run's novel clusters: `infosieve name --run RUN novel-7="Blue Jay"` writes them to RUN/names.json
({"novel-7": "Blue Jay"}); `predict`, `report`, `tree` and `export` read them from there.

A name is checked before anything is written: the cluster must be one of the run's novel clusters, and a name must be
usable as a folder name on every common file system (`export` makes `labelled/<name>/`; file_names.py) and taken by
no other cluster or known class. Reading names.json checks every name again with the same rule: a run folder from
elsewhere, or a hand-edited names.json, is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..common.file_names import name_problem
from ..common.files import write_json

NAMES = "names.json"


def read_names(run: str | Path) -> dict[int, str]:
    """{cluster: name} of RUN/names.json; {} when no cluster has been named."""
    path = Path(run) / NAMES
    if not path.is_file():
        return {}
    names = {}
    for key, name in json.loads(path.read_text()).items():
        number = key.removeprefix("novel-")
        if not (key.startswith("novel-") and number.isdecimal() and isinstance(name, str)):
            raise ValueError(f"{path}: {key!r}: {name!r} is not novel-K: NAME; name the clusters with `infosieve name`")
        problem = name_problem(name)
        if problem:
            raise ValueError(
                f"{path}: novel-{number}={name!r} cannot be a folder name ({problem}); rename it with "
                f"`infosieve name --run {path.parent} novel-{number}=NAME`"
            )
        names[int(number)] = name
    return names


def checkpoint_names(run: str | Path, checkpoint: str) -> dict[int, str]:
    """The names that hold for the clusters of the run's `checkpoint` ("last" or "best"): RUN/names.json names the
    final clustering's clusters (the last checkpoint's, RUN/clustering.npz); the best checkpoint's clustering is
    computed again and its cluster numbers are its own, so none of them carries a name."""
    return read_names(run) if checkpoint == "last" else {}


def parse_assignment(text: str) -> tuple[str, str]:
    """`novel-7=Blue Jay` -> ("novel-7", "Blue Jay"); the name stripped of surrounding spaces."""
    cluster, sep, name = text.partition("=")
    if not sep:
        raise ValueError(f'{text!r} is not CLUSTER=NAME: write e.g. novel-7="Blue Jay"')
    return cluster.strip(), name.strip()


def check_name(cluster: str, name: str) -> None:
    """A name `export` can make a folder of on every common file system (file_names.py)."""
    if not name:
        raise ValueError(f'{cluster}= has an empty name: give it one, e.g. {cluster}="Blue Jay"')
    problem = name_problem(name)
    if problem:
        raise ValueError(
            f"{cluster}={name!r}: a name becomes the folder labelled/<name>/ on export, and {problem}: choose another"
        )


def assign_names(run: str | Path, assignments: list[str], class_names: list[str], n_clusters: int) -> dict[int, str]:
    """RUN/names.json updated with `assignments` (`novel-<k>=NAME` strings), checked first (nothing is written when
    any is wrong); returns every name the run now has."""
    n_old = len(class_names)
    valid = {f"novel-{k}": k for k in range(n_old, n_clusters)}
    names = read_names(run)
    for cluster, name in map(parse_assignment, assignments):
        if cluster not in valid:
            listed = f"novel-{n_old} to novel-{n_clusters - 1}" if valid else "none (every cluster is a known class)"
            raise ValueError(f"{run} has no cluster {cluster!r}: its novel clusters are {listed}")
        check_name(cluster, name)
        k = valid[cluster]
        taken = {f"novel-{c}": f"novel-{c}" for c in valid.values() if c != k}  # another cluster's own name
        taken |= {n: f"novel-{c}" for c, n in names.items() if c != k} | {n: "a known class" for n in class_names}
        if name in taken:
            raise ValueError(f"{cluster}={name!r}: that name is taken by {taken[name]}: names must differ")
        names[k] = name
    write_json(Path(run) / NAMES, {f"novel-{k}": names[k] for k in sorted(names)})
    return names
