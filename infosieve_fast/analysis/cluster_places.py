"""Where a run's novel clusters sit: beside the known classes nearest them in the feature space, and, where the codes
carry the classes (`code_separation.py`), in the implicit category tree (paper §3: code prefixes are tree nodes).

A novel cluster's nearest known classes are those whose k-means centres lie nearest its own (Euclidean, in the
L2-normalised features SS-k-means clusters; known class c is cluster c): what the model actually uses to sort an
image. Always shown. The tree place only where the codes carry the classes: a set of codes sits at its majority prefix,
the longest prefix that more than half of its codes start with; a novel cluster's place is the majority prefix of its
pool images' codes, and the known classes nearest it in the tree are those whose own majority prefix (of their
labelled images) shares the most leading digits with it; among those that share as many, the ones with the larger
share of their images under the cluster's prefix come first. `infosieve report` shows the place beside each novel
cluster, `infosieve tree` prints it and stores it in tree.json under `novel_clusters`.
"""

from __future__ import annotations

import numpy as np
import torch

from ..common.labels import NO_LABEL
from ..evaluation.discovery import cluster_name

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


def nearest_by_centres(centers, k: int, n_old: int) -> tuple[list[int], list[float]]:
    """The `NEAREST_KNOWN` known classes (clusters 0..n_old-1) whose centres lie nearest centre `k`, nearest first
    (ties by index), and their distances."""
    c = torch.as_tensor(centers).detach().to("cpu", torch.float64)
    dist = (c[:n_old] - c[k]).norm(dim=1).tolist()
    nearest = sorted(range(n_old), key=lambda j: (dist[j], j))[:NEAREST_KNOWN]
    return nearest, [dist[j] for j in nearest]


def tree_place(codes: list[str], known_codes: dict[int, list[str]], depth: int) -> tuple[str, list[int], int]:
    """(the majority prefix of `codes`, the known classes nearest it in the tree, the digits the nearest shares)."""
    known = {c: majority_prefix(members, depth) for c, members in known_codes.items()}
    prefix = majority_prefix(codes, depth)
    shared = {c: shared_digits(prefix, p) for c, p in known.items()}
    # ties (common in a shallow tree) go to the class with the larger share of its images under the prefix
    under = {c: sum(code.startswith(prefix) for code in v) / max(len(v), 1) for c, v in known_codes.items()}
    nearest = sorted(shared, key=lambda c: (-shared[c], -under[c], c))[:NEAREST_KNOWN]
    return prefix, nearest, shared[nearest[0]] if nearest else 0


def place_clusters(
    codes: dict[int, str],
    targets: dict[int, int],
    clustering: dict,
    class_names: list[str],
    centers,
    given: dict[int, str],
    depth: int,
    carries: bool,
) -> list[dict]:
    """Each novel cluster with pool images, largest first: {"cluster", "name", "size", "nearest_known" (by centre
    distance), "centre_distances"} and, where `carries` (the codes carry the classes), {"prefix",
    "tree_nearest_known", "shared_digits"}. `codes`, `targets`: by uq, of the train samples (the labelled ones place
    the known classes in the tree); `clustering`: {"uq", "targets", "preds", "n_old"} of the unlabelled train samples
    (the pool's target is NO_LABEL); `centers` [K, D]: the clustering's centres; `given`: RUN/names.json's names."""
    n_old = int(clustering["n_old"])
    # `codes` is empty for a method that learns none (`carries` False): only the feature-space hints
    known_codes = {c: [codes[u] for u, t in targets.items() if t == c] for c in range(n_old)} if carries else {}
    pool = np.asarray(clustering["targets"]) == NO_LABEL
    uq, preds = np.asarray(clustering["uq"])[pool], np.asarray(clustering["preds"])[pool]
    places = []
    for k in range(n_old, len(centers)):
        members = uq[preds == k].tolist()
        if not members:
            continue
        nearest, distances = nearest_by_centres(centers, k, n_old)
        place = {
            "cluster": k,
            "name": cluster_name(k, class_names, n_old, given),
            "size": len(members),
            "nearest_known": [class_names[c] for c in nearest],
            "centre_distances": [round(d, 4) for d in distances],
        }
        member_codes = [codes[u] for u in members if u in codes]
        if carries and member_codes:
            prefix, in_tree, shared = tree_place(member_codes, known_codes, depth)
            place |= {
                "prefix": prefix,
                "tree_nearest_known": [class_names[c] for c in in_tree],
                "shared_digits": shared,
            }
        places.append(place)
    return sorted(places, key=lambda p: (-p["size"], p["cluster"]))


def place_text(place: dict) -> str:
    """One line: "Blue Jay (novel-7): 23 pool images; nearest known (feature centres): A 0.41, B 0.52" and, where the
    codes carry the classes, "; prefix 0110, nearest in the tree: A, C (2 shared digits)"."""
    own = f"novel-{place['cluster']}"
    name = place["name"] if place["name"] == own else f"{place['name']} ({own})"
    nearest = ", ".join(f"{c} {d:.2f}" for c, d in zip(place["nearest_known"], place["centre_distances"], strict=True))
    text = f"{name}: {place['size']} pool images; nearest known (feature centres): {nearest or 'none'}"
    if "prefix" not in place:
        return text
    in_tree = ", ".join(place["tree_nearest_known"]) or "none"
    return (
        f"{text}; prefix {place['prefix'] or '(root)'}, nearest in the tree: {in_tree} "
        f"({place['shared_digits']} shared digits)"
    )
