"""Whether estimate-k's "nothing new" test (`infosieve_fast/evaluation/novelty.py`) tells a pool of only known
classes from a pool with novel ones, on random sets of species of a features `.npz` (`F`, `y`).

Each draw r (0..`--draws`-1) takes `--known` + the largest `--novel` species at random from `--classes LO-HI`
(`RandomState(r)`): the first `--known` are known, half of their images labelled (GCD's split, seed r); the pool is
their other half plus every image of the first n novel species, for each n of `--novel` (0: a pool of only known
species). For each pool and each `--quantiles` value it records the test's z; the pool is said to hold something
new when z >= `Z_NEW`. `--features` takes several files (the same images at two sizes, say), each measured alike.

The threshold was chosen on cub100 species 0-19 (`--classes 0-19`); species 40-59 are kept for final checks and
refused here. docs/kmeans.md has the commands and the results.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks import smoke
from benchmarks.bench_estimate_k import class_range, load_classes, refuse_reserved
from benchmarks.harness import Stopwatch
from benchmarks.tools.provenance import emit_json
from infosieve_fast.data.splits import gcd_split
from infosieve_fast.evaluation.estimate_k import checked_inputs
from infosieve_fast.evaluation.novelty import Z_NEW, pool_novelty


def pool_z(feats, y, species: np.ndarray, known: int, novel: int, seed: int, quantile: float) -> float:
    """The test's z for the known species `species[:known]` (half labelled, GCD split `seed`) and a pool of their
    other half plus the images of `species[known:known + novel]`."""
    used = species[: known + novel]
    keep = np.isin(y, used)
    relabel = np.full(y.max() + 1, -1)
    relabel[used] = np.arange(len(used))
    targets = relabel[y[keep]]
    labelled = np.asarray(gcd_split(targets, list(range(known)), 0.5, seed)[0], bool)
    x, targets, labelled = checked_inputs(feats[keep], targets, labelled, known, "cpu")
    return pool_novelty(x, targets, labelled, known, quantile)["z"]


def measure(path: str, lo: int, hi: int, args) -> dict:
    """Per number of novel species and quantile: every draw's z, their range and the share said to hold something
    new."""
    feats, y = load_classes(path, lo, hi)
    n_species = hi - lo + 1
    if args.known + max(args.novel) > n_species:
        raise SystemExit(
            f"--known {args.known} + --novel {max(args.novel)}: more than the {n_species} species of --classes"
        )
    draws = [np.random.RandomState(r).permutation(n_species) for r in range(args.draws)]
    table = {}
    for novel in args.novel:
        for q in args.quantiles:
            zs = [pool_z(feats, y, species, args.known, novel, r, q) for r, species in enumerate(draws)]
            table[f"novel {novel}, quantile {q:g}"] = {
                "novel": novel,
                "quantile": q,
                "z": zs,
                "z_min": min(zs),
                "z_max": max(zs),
                "said_new": sum(z >= Z_NEW for z in zs) / len(zs),
            }
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", nargs="+", required=True, help=".npz files with F [N, D] and y [N]")
    ap.add_argument("--classes", type=class_range, required=True, help="LO-HI: the species drawn from")
    ap.add_argument("--known", type=int, default=10, help="known species per draw")
    ap.add_argument("--novel", type=lambda s: [int(v) for v in s.split(",")], default=[0, 1], help="e.g. 0,1,5")
    ap.add_argument("--quantiles", type=lambda s: [float(v) for v in s.split(",")], default=[0.8], help="e.g. 0.8,0.9")
    ap.add_argument("--draws", type=int, default=10, help="random sets of species (and GCD split seeds)")
    ap.add_argument("--json", help="also write the result here")
    args = smoke.shrink(ap.parse_args(argv), classes=(0, 5), known=3, novel=[0, 1], draws=2)
    lo, hi = args.classes
    clock = Stopwatch()
    results = {}
    for path in args.features:
        refuse_reserved(path, [(lo, hi)])
        results[path.rsplit("/", 1)[-1]] = measure(path, lo, hi, args)
    emit_json(
        {
            "classes": f"{lo}-{hi}",
            "known": args.known,
            "draws": args.draws,
            "z_new": Z_NEW,
            "results": results,
            "seconds": round(clock.seconds(), 1),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
