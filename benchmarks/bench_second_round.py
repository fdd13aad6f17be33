"""Whether estimate-k says "nothing new" in the discovery loop's second round (issue 43), on a features `.npz`.

Each draw r takes `--known` + `--novel` species at random from `--classes LO-HI` (`RandomState(r)`); the first
`--known` are known, half of their images labelled (GCD's split, seed r), and the pool is their other half and every
image of the novel species, as in the issue's loop (5 known, 5 novel). Round 1 clusters the pool with the labelled
images anchored (semi-supervised k-means, K = known + novel, the configs' balanced `reference` mode). Each novel
cluster is named by its majority species, one cluster per species (the larger wins), as
benchmarks/bench_discovery_loop.py names them, and, as `infosieve export` does, a named cluster's pool images join
the labelled images under that name whatever their species. Round 2 asks estimate-k (its `--rule` and its novelty test)
for K with the known classes and the named ones, on the labelled images and the pool left: the known species'
images that round 1 put in known clusters, and the leftovers (images round 1 put in unnamed clusters or in another
species' cluster). The pool holds something new only where a novel species was not named. Each draw also asks
estimate-k on a pool made only of known species (the known species' other half, nothing else).

The features are a fixed backbone's (cub100's EfficientNet-Lite0), not those of a model trained in round 1 as in the
issue's loop. Species 40-59 of cub100 are refused (kept for final checks). docs/kmeans.md has the command and the
result.
"""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np
import torch

from benchmarks import smoke
from benchmarks.bench_estimate_k import class_range, load_classes, refuse_reserved
from benchmarks.harness import Stopwatch
from benchmarks.tools.provenance import emit_json
from infosieve_fast.data.splits import gcd_split
from infosieve_fast.evaluation.estimate_k import RULES, estimate_k
from infosieve_fast.kmeans import semi_supervised_kmeans

UNLABELLED = -1  # the target of a pool image: estimate-k reads the labelled images' targets only


def first_round(x: torch.Tensor, targets: np.ndarray, labelled: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Each pool image's round-1 cluster (labelled class c is cluster c), in the pool's row order."""
    lab = torch.from_numpy(labelled)
    res = semi_supervised_kmeans(
        x[~lab], x[lab], torch.from_numpy(targets[labelled]), k, balanced=True, balance="reference", seed=seed
    )
    return res.labels.numpy()[int(labelled.sum()) :]


def majority_names(clusters: np.ndarray, species: np.ndarray, n_old: int) -> dict[int, int]:
    """{novel cluster: the species most of its images are}, one cluster per species (the larger cluster wins), novel
    species only (a known species already has its class)."""
    votes = {}
    for k in np.unique(clusters[clusters >= n_old]).tolist():
        counts = Counter(species[clusters == k].tolist())
        votes[k] = (counts.most_common(1)[0][0], int((clusters == k).sum()))
    named: dict[int, int] = {}
    for k, (c, _) in sorted(votes.items(), key=lambda item: -item[1][1]):
        if c >= n_old and c not in named.values():
            named[k] = c
    return named


def second_round(x, targets, labelled, known: int, novel: int, seed: int, rule: str) -> dict:
    """Round 1, the naming and the export, then estimate-k on round 2's labelled images and pool."""
    pool = np.flatnonzero(~labelled)
    clusters = first_round(x, targets, labelled, known + novel, seed)
    named = majority_names(clusters, targets[pool], known)
    round2_class = {c: i for i, c in enumerate([*range(known), *named.values()])}
    targets2 = np.where(labelled, targets, UNLABELLED)
    for k, c in named.items():
        targets2[pool[clusters == k]] = round2_class[c]
    labelled2 = targets2 != UNLABELLED
    left = targets[~labelled2]
    found = estimate_k(x, targets2, labelled2, len(round2_class), rule=rule, silhouette=False)
    return {
        "known": len(round2_class),
        "named": len(named),
        "moved": int(labelled2.sum() - labelled.sum()),
        "moved_other_species": sum(int((targets[pool[clusters == k]] != c).sum()) for k, c in named.items()),
        "pool": len(left),
        "leftovers": int((left >= known).sum()),  # pool images of round 1's novel species, named or not
        "new_species_in_pool": len(set(left[left >= known].tolist()) - set(named.values())),
        **answer(found),
    }


def answer(found: dict) -> dict:
    rule_answer = f"k_by_{found['rule']}"
    return {k: found[k] for k in ("k", rule_answer, "k_range")} | {"novelty_z": found["novelty"]["z"]}


def only_known(x, targets, labelled, known: int, rule: str) -> dict:
    """estimate-k with a pool of only the known species' other half."""
    rows = targets < known
    found = estimate_k(x[torch.from_numpy(rows)], targets[rows], labelled[rows], known, rule=rule, silhouette=False)
    return {"known": known, "pool": int((rows & ~labelled).sum()), **answer(found)}


def measure(path: str, lo: int, hi: int, args) -> dict:
    feats, y = load_classes(path, lo, hi)
    x = torch.from_numpy(feats)
    x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    rows = []
    for r in range(args.draws):
        species = np.random.RandomState(r).permutation(hi - lo + 1)[: args.known + args.novel]
        keep = np.isin(y, species)
        relabel = np.full(y.max() + 1, -1)
        relabel[species] = np.arange(len(species))
        targets = relabel[y[keep]]
        labelled = np.asarray(gcd_split(targets, list(range(args.known)), 0.5, r)[0], bool)
        rows.append(
            {
                "draw": r,
                "species": (species + lo).tolist(),
                "second_round": second_round(
                    x[torch.from_numpy(keep)], targets, labelled, args.known, args.novel, r, args.rule
                ),
                "only_known": only_known(x[torch.from_numpy(keep)], targets, labelled, args.known, args.rule),
            }
        )
    return {
        "features": path.rsplit("/", 1)[-1],
        "classes": f"{lo}-{hi}",
        "rule": args.rule,
        "draws": rows,
        **summary(rows),
    }


def summary(rows: list[dict]) -> dict:
    """How often K was the known classes, where the pool held nothing new and where it did."""
    second = [row["second_round"] for row in rows]
    nothing_new = [s for s in second if s["new_species_in_pool"] == 0]
    return {
        "second_round_nothing_new": len(nothing_new),
        "second_round_k_is_known": sum(s["k"] == s["known"] for s in nothing_new),
        "second_round_with_new": len(second) - len(nothing_new),
        "second_round_with_new_k_above_known": sum(s["k"] > s["known"] for s in second if s["new_species_in_pool"]),
        "only_known_k_is_known": sum(row["only_known"]["k"] == row["only_known"]["known"] for row in rows),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", nargs="+", required=True, help=".npz files with F [N, D] and y [N]")
    ap.add_argument("--classes", type=class_range, default=(60, 99), help="LO-HI: species drawn from (60-99)")
    ap.add_argument("--known", type=int, default=5, help="known species a draw (5, as in the issue)")
    ap.add_argument("--novel", type=int, default=5, help="novel species a draw (5)")
    ap.add_argument("--draws", type=int, default=10)
    ap.add_argument("--rule", choices=RULES, default=RULES[0], help="estimate-k's --rule")
    ap.add_argument("--json", help="also write the result here (after every features file)")
    args = smoke.shrink(ap.parse_args(argv), classes=(0, 5), known=2, novel=2, draws=1)
    lo, hi = args.classes
    if args.known < 2 or args.novel < 1 or args.known + args.novel > hi - lo + 1:
        raise SystemExit(f"--known {args.known} (at least 2) + --novel {args.novel} (at least 1) must fit {lo}-{hi}")
    torch.set_num_threads(1)
    clock = Stopwatch()
    results = []
    for path in args.features:
        refuse_reserved(path, [(lo, hi)])
        results.append(measure(path, lo, hi, args))
        emit_json({"results": results, "seconds": round(clock.seconds(), 1)}, args.json, echo=path == args.features[-1])


if __name__ == "__main__":
    main()
