"""How close `infosieve estimate-k`'s answer is to the true number of classes across scales: bench_estimate_k.py's
runner (the whole set, then resamples that each drop `--drop` of the images) on several sets of classes, each from
several features files (the same images at two sizes, say).

`--sets`: each a comma list of class ranges LO-HI (renumbered from 0 in that order; the first half known, half of
their images labelled with GCD's split, seed 0), or `all` (every class of the file). On cub100's features ranges
must avoid species 40-59, kept for final checks; `all` holds them (100 species need every one): it measures, and
no choice may be made on it. docs/kmeans.md has the command, the table and which sets chose the rule.

Prints JSON: per features file and set, the true K, the rows of bench_estimate_k.py (K, range, argmax per sample),
each sample's relative error K / true K - 1, the largest of those, and the spread of K over the resamples.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks import smoke
from benchmarks.bench_estimate_k import class_range, load_ranges, refuse_reserved, stability
from benchmarks.harness import Stopwatch
from benchmarks.tools.provenance import emit_json


def class_set(text: str) -> list[tuple[int, int]] | None:
    """`all` -> None (every class); else the ranges of a comma list such as `0-39,60-69`."""
    return None if text == "all" else [class_range(part) for part in text.split(",")]


def load_set(path: str, ranges: list[tuple[int, int]] | None) -> tuple[np.ndarray, np.ndarray]:
    if ranges is not None:
        refuse_reserved(path, ranges)
        return load_ranges(path, ranges)
    with np.load(path) as data:
        return data["F"].astype(np.float32), data["y"].astype(np.int64)


def measure(path: str, name: str, ranges, args) -> dict:
    feats, y = load_set(path, ranges)
    true_k = len(np.unique(y))
    found = stability(
        feats, y, true_k // 2, resamples=args.resamples, drop=args.drop, seeds=args.seeds, workers=args.workers
    )
    errors = [round(row["k"] / true_k - 1, 4) for row in found["rows"]]
    return {
        "features": path.rsplit("/", 1)[-1],
        "classes": name,
        "true_k": true_k,
        "known": true_k // 2,
        "k": [row["k"] for row in found["rows"]],
        "relative_error": errors,
        "largest_relative_error": max(errors, key=abs),
        **found,
    }


def add_sample_arguments(ap: argparse.ArgumentParser, sets_help: str) -> None:
    """The features files, the class sets and the resamples that this benchmark and bench_k_neighbours.py measure."""
    ap.add_argument("--features", nargs="+", required=True, help=".npz files with F [N, D] and y [N]")
    ap.add_argument("--sets", nargs="+", required=True, help=sets_help)
    ap.add_argument("--resamples", type=int, default=3)
    ap.add_argument("--drop", type=float, default=0.02, help="share of the images each resample drops")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sample_arguments(ap, "class sets: comma lists of LO-HI ranges, or all")
    ap.add_argument("--seeds", type=int, default=4, help="k-means runs per K (estimate-k's --seeds)")
    ap.add_argument("--workers", type=int, default=1, help="samples estimated at once, one process each")
    ap.add_argument("--json", help="also write the result here (after every set)")
    args = smoke.shrink(ap.parse_args(argv), sets=["0-5"], resamples=1, seeds=2)
    sets = {name: class_set(name) for name in args.sets}
    clock = Stopwatch()
    results = []
    jobs = [(path, name, ranges) for path in args.features for name, ranges in sets.items()]
    for i, (path, name, ranges) in enumerate(jobs):
        results.append(measure(path, name, ranges, args))
        summary = {"within_10_percent": all(abs(e) <= 0.1 for r in results for e in r["relative_error"])}
        last = i == len(jobs) - 1
        emit_json({**summary, "results": results, "seconds": round(clock.seconds(), 1)}, args.json, echo=last)


if __name__ == "__main__":
    main()
