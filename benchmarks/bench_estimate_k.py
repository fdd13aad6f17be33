"""How stable `infosieve estimate-k`'s answer is: the chosen K, its plausible range and the K by argmax on a set of
species, then on resamples of it that each drop a share of the images (`--drop`, 2%) at random.

The data is an `.npz` of features (`F`, `y`), cut to the classes `--classes LO-HI` (renumbered from 0; the first
`--known` known, half of their images labelled with GCD's split, seed 0). The default is cub100's held-out species
20-39 of the project's real test data (`features/cub100_efflite0_224_feats.npz`; species 40-59 are kept for final
checks: never pass them here); docs/kmeans.md has the command and the result. estimate-k's subsamples and smoothing
were tuned on species 0-19, 60-79 and 80-99 (`--classes`), never on 20-39.

Prints JSON: per sample (the whole set, then each resample) K, the range, the argmax, the K scored and the seconds;
then the spread of K over the resamples (largest minus smallest, and the largest distance from the whole set's K).
`--workers N` estimates N samples at once, one process each.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks import smoke
from benchmarks.harness import Stopwatch
from benchmarks.tools.provenance import emit_json
from infosieve_fast.common.worker_processes import forked_pool
from infosieve_fast.data.splits import gcd_split
from infosieve_fast.evaluation.estimate_k import estimate_k

RESERVED = (40, 59)  # cub100 species kept for final checks


def class_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi)


def refuse_reserved(path: str, ranges: list[tuple[int, int]]) -> None:
    """Stops when a range of classes of cub100's features reaches into the species kept for final checks."""
    if "cub100" in path and any(lo <= RESERVED[1] and hi >= RESERVED[0] for lo, hi in ranges):
        raise SystemExit("cub100 species 40-59 are kept for final checks: choose --classes outside them")


def load_classes(path: str, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels (renumbered 0..hi-lo) of the classes lo..hi of an `.npz` with `F` and `y`."""
    return load_ranges(path, [(lo, hi)])


def load_ranges(path: str, ranges: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels of the classes of `ranges` (each LO..HI) of an `.npz` with `F` and `y`, renumbered from 0
    in the order the ranges list them."""
    with np.load(path) as data:
        feats, y = data["F"].astype(np.float32), data["y"].astype(np.int64)
    classes = np.concatenate([np.arange(lo, hi + 1) for lo, hi in ranges])
    relabel = np.full(max(y.max(), classes.max()) + 1, -1)
    relabel[classes] = np.arange(len(classes))
    keep = relabel[y] >= 0
    return feats[keep], relabel[y[keep]]


def drop_resamples(n: int, resamples: int, drop: float) -> dict[str, np.ndarray]:
    """The rows of each sample: all `n`, then `resamples` random subsets that each drop a share `drop` (seed r)."""
    samples = {"all": np.arange(n)}
    for r in range(resamples):
        keep = np.random.RandomState(r).choice(n, round(n * (1 - drop)), replace=False)
        samples[f"drop {drop:g}, seed {r}"] = np.sort(keep)
    return samples


def stability(feats, y, known: int, *, resamples: int, drop: float, seeds: int, workers: int) -> dict:
    """estimate-k on all the rows and on each resample (`workers` at once): the rows, the spread of K over the
    resamples and its largest distance from the whole set's K."""
    labelled = np.asarray(gcd_split(y, list(range(known)), 0.5, 0)[0], bool)
    samples = drop_resamples(len(y), resamples, drop)
    jobs = [(feats[i], y[i], labelled[i], known, seeds) for i in samples.values()]
    with forked_pool(workers) as pool:
        found = pool.starmap(one_estimate, jobs)
    rows = [{"sample": name, **row} for name, row in zip(samples, found, strict=True)]
    ks = [row["k"] for row in rows[1:]]
    return {
        "rows": rows,
        "resample_k_spread": max(ks) - min(ks),
        "resample_k_max_shift": max(abs(k - rows[0]["k"]) for k in ks),
    }


def one_estimate(feats, y, labelled, known: int, n_seeds: int) -> dict:
    """estimate-k's answer on one sample (without the silhouette, which does not choose K)."""
    torch.set_num_threads(1)  # one sample per worker process
    res = estimate_k(feats, y, labelled, known, rule="score", n_seeds=n_seeds, silhouette=False)
    evaluated = sorted(map(int, res["criteria"]["labelled_accuracy"]))
    return {"n": len(y), **{k: res.get(k) for k in ("k", "k_range", "k_by_argmax", "seconds")}, "evaluated": evaluated}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True, help=".npz with F [N, D] and y [N]")
    ap.add_argument("--classes", type=class_range, default=(20, 39), help="LO-HI: the classes used (default 20-39)")
    ap.add_argument("--known", type=int, help="known classes, the first of the range (default: half of them)")
    ap.add_argument("--resamples", type=int, default=5)
    ap.add_argument("--drop", type=float, default=0.02, help="share of the images each resample drops")
    ap.add_argument("--seeds", type=int, default=4, help="k-means runs per K (estimate-k's --seeds)")
    ap.add_argument("--workers", type=int, default=1, help="samples estimated at once, one process each")
    ap.add_argument("--json", help="also write the result here")
    args = smoke.shrink(ap.parse_args(argv), classes=(0, 5), resamples=1, seeds=2)
    lo, hi = args.classes
    refuse_reserved(args.features, [(lo, hi)])
    feats, y = load_classes(args.features, lo, hi)
    known = args.known if args.known is not None else (hi - lo + 1) // 2
    clock = Stopwatch()
    found = stability(feats, y, known, resamples=args.resamples, drop=args.drop, seeds=args.seeds, workers=args.workers)
    emit_json(
        {
            "features": args.features.rsplit("/", 1)[-1],
            "classes": f"{lo}-{hi}",
            "true_k": hi - lo + 1,
            "known": known,
            "seeds_per_k": args.seeds,
            **found,
            "seconds": round(clock.seconds(), 1),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
