"""Where a run's novel clusters sit in the implicit category tree (paper §3: code prefixes are tree nodes).

A set of codes sits at its majority prefix: the longest prefix that more than half of its codes start with. A novel
cluster's place is the majority prefix of its pool images' codes; its nearest known classes are those whose own
majority prefix (of their labelled images) shares the most leading digits with it; among those that share as many,
the ones with the larger share of their images under the cluster's prefix come first. `infosieve report` shows the place
beside each novel cluster, `infosieve tree` prints it and stores it in tree.json under `novel_clusters`.
"""

from __future__ import annotations

import numpy as np

from .discovery import cluster_name
from .metrics import NO_LABEL

NEAREST_KNOWN = 3  # known classes named beside a novel cluster


def majority_prefix(codes: list[str], depth: int) -> str:
    """The longest prefix (at most `depth` digits) that more than half of `codes` start with ("" for none)."""
    prefix = ""
    while len(prefix) < depth:
        longer = [prefix + digit for digit in "01"]
        hits = [sum(code.startswith(p) for code in codes) for p in longer]
        best = int(np.argmax(hits))
        if 2 * hits[best] <= len(codes):
            break
        prefix = longer[best]
    return prefix


def shared_digits(a: str, b: str) -> int:
    """How many leading digits `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def place_clusters(
    codes: dict[int, str],
    targets: dict[int, int],
    clustering: dict,
    class_names: list[str],
    n_clusters: int,
    given: dict[int, str],
    depth: int,
) -> list[dict]:
    """Each novel cluster with pool images, largest first: {"cluster", "name", "size", "prefix", "nearest_known",
    "shared_digits"}. `codes`, `targets`: by uq, of the train samples (the labelled ones place the known classes);
    `clustering`: {"uq", "targets", "preds", "n_old"} of the unlabelled train samples (the pool's target is NO_LABEL);
    `given`: RUN/names.json's names."""
    n_old = int(clustering["n_old"])
    known_codes = {c: [codes[u] for u, t in targets.items() if t == c] for c in range(n_old)}
    known = {c: majority_prefix(members, depth) for c, members in known_codes.items()}
    pool = np.asarray(clustering["targets"]) == NO_LABEL
    uq, preds = np.asarray(clustering["uq"])[pool], np.asarray(clustering["preds"])[pool]
    places = []
    for k in range(n_old, n_clusters):
        members = [codes[u] for u in uq[preds == k].tolist() if u in codes]
        if not members:
            continue
        prefix = majority_prefix(members, depth)
        shared = {c: shared_digits(prefix, p) for c, p in known.items()}
        # ties (common in a shallow tree) go to the class with the larger share of its images under the prefix
        under = {c: sum(code.startswith(prefix) for code in v) / max(len(v), 1) for c, v in known_codes.items()}
        nearest = sorted(shared, key=lambda c: (-shared[c], -under[c], c))[:NEAREST_KNOWN]
        places.append(
            {
                "cluster": k,
                "name": cluster_name(k, class_names, n_old, given),
                "size": len(members),
                "prefix": prefix,
                "nearest_known": [class_names[c] for c in nearest],
                "shared_digits": shared[nearest[0]] if nearest else 0,
            }
        )
    return sorted(places, key=lambda p: (-p["size"], p["cluster"]))


def place_text(place: dict) -> str:
    """One line: "Blue Jay (novel-7): 23 pool images, prefix 0110; nearest known: A, B (2 shared digits)"."""
    own = f"novel-{place['cluster']}"
    name = place["name"] if place["name"] == own else f"{place['name']} ({own})"
    nearest = ", ".join(place["nearest_known"]) or "none"
    return (
        f"{name}: {place['size']} pool images, prefix {place['prefix'] or '(root)'}; nearest known: {nearest} "
        f"({place['shared_digits']} shared digits)"
    )
