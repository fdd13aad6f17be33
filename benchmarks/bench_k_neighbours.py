"""How close the neighbours count of the number of categories (`estimate-k --rule neighbours`,
infosieve_fast/evaluation/neighbour_count.py) is to the true number, on sets of classes from features files, each
whole and on resamples that each drop `--drop` of the images.

`--sets`: each a comma list of class ranges LO-HI (renumbered from 0 in that order), or `all` (every class of the
file), optionally with `:KNOWN`, the number of known classes (default: half, rounded down); half of the known
classes' images are labelled with GCD's split, seed 0. On cub100's features ranges must avoid species 40-59, kept for
final checks; `all` holds them: it measures, and nothing may be chosen on it. docs/kmeans.md has the commands.

`--uneven LO-HI` labels each known class in its own share instead (a person's own folders, a loop's later round).
`--long-tail LO-HI` first keeps of each class only a share of its images, drawn log-uniformly from LO to HI, so that
class sizes differ (new classes then are as large as the known ones only on average, as in a long-tailed set).
`--shuffle-classes N` renumbers each set's classes by N random orders (seeds 0..N-1) before the first KNOWN are taken
as known, so that the known classes are drawn at random from the set rather than as its first block (cub100's species
are in CUB's order, related ones side by side: three buntings, five sparrows).
`--points-per-class P` counts uniform subsamples of P images per class of the set (`--subsamples` of them, their
counts averaged), as the count's own subsamples of 20,000 points leave of a set of many classes (20 per class of
ImageNet-1k's 1,000).

Prints JSON: per variant (each of `--neighbours` with each of `--prior`: how many labelled images' worth of the
share pooled over the known classes each class's own expected share of labelled neighbours is drawn towards, and each
of `--wide-neighbours`: on how many neighbours the new images' mixing is read), features file and set, the true K,
the known classes, the count on each sample (the whole set, then the resamples) with its relative error, the largest
error, the spread over the samples; and a summary per variant: the share of the answers within 10% of the true K,
the mean and the largest error, the share whose `k_range` holds the true K and the range's mean width (a share of the
true K), and how the count before the mixing allowance (`k_count`) and `k_if_mixed` (the count had every new image
mixed as much as the known classes do), rounded, would do as the answer.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks import smoke
from benchmarks.bench_estimate_k import drop_resamples
from benchmarks.bench_estimate_k_scales import add_sample_arguments, class_set, load_set
from benchmarks.harness import Stopwatch
from benchmarks.tools.provenance import emit_json
from infosieve_fast.data.splits import gcd_split
from infosieve_fast.evaluation.neighbour_count import (
    MAX_POINTS,
    NEIGHBOURS,
    PRIOR_IMAGES,
    SUBSAMPLES,
    WIDE_NEIGHBOURS,
    count_by_neighbours,
)


def share_range(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition("-")
    if not 0 < float(lo) <= float(hi) <= 1:
        raise argparse.ArgumentTypeError(f"{text}: LO-HI with 0 < LO <= HI <= 1, say 0.1-0.9")
    return float(lo), float(hi)


def parse_set(text: str) -> tuple[str, list[tuple[int, int]] | None, int | None]:
    """`RANGES[:KNOWN]` -> (the text, the ranges or None for `all`, the known classes or None for half)."""
    ranges, _, known = text.partition(":")
    return text, class_set(ranges), int(known) if known else None


def labelled_mask(y: np.ndarray, known: int, uneven: tuple[float, float] | None) -> np.ndarray:
    """GCD's split (half of the known classes' images, seed 0), or with `uneven` (LO, HI) each known class labelled in
    its own share, drawn uniformly from LO to HI (`RandomState(0)`), of its images (at least 2)."""
    if uneven is None:
        return np.asarray(gcd_split(y, list(range(known)), 0.5, 0)[0], bool)
    rng = np.random.RandomState(0)
    labelled = np.zeros(len(y), bool)
    for c, share in enumerate(rng.uniform(*uneven, size=known)):
        rows = np.flatnonzero(y == c)
        labelled[rng.choice(rows, max(2, round(share * len(rows))), replace=False)] = True
    return labelled


def long_tail_rows(y: np.ndarray, shares: tuple[float, float]) -> np.ndarray:
    """The rows kept when each class keeps a share of its images (at least 4) drawn log-uniformly from `shares`
    (`RandomState(1)`), the first of each class's images in the file's order."""
    rng = np.random.RandomState(1)
    share = np.exp(rng.uniform(*np.log(shares), size=y.max() + 1))
    return np.concatenate([np.flatnonzero(y == c)[: max(4, round(share[c] * (y == c).sum()))] for c in np.unique(y)])


def measure(
    variant: tuple[int, float, int], order: int | None, path: str, name: str, ranges, known: int | None, args
) -> dict:
    neighbours, prior, wide = variant
    feats, y = load_set(path, ranges)
    if args.long_tail is not None:
        kept = long_tail_rows(y, args.long_tail)
        feats, y = feats[kept], y[kept]
    true_k = len(np.unique(y))
    if order is not None:  # the known classes drawn at random from the set, not its first ones
        y = np.random.RandomState(order).permutation(true_k)[y]
    known = true_k // 2 if known is None else known
    labelled = labelled_mask(y, known, args.uneven)
    max_points = MAX_POINTS if args.points_per_class is None else args.points_per_class * true_k
    rows = []
    for sample, keep in drop_resamples(len(y), args.resamples, args.drop).items():
        x = torch.as_tensor(feats[keep], dtype=torch.float32)
        x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
        found = count_by_neighbours(
            x,
            y[keep],
            labelled[keep],
            known,
            neighbours=neighbours,
            wide_neighbours=wide,
            prior_images=prior,
            max_points=max_points,
            subsamples=args.subsamples,
        )
        rows.append({"sample": sample, **found, "relative_error": round(found["k"] / true_k - 1, 4)})
    ks = [row["k"] for row in rows]
    return {
        "variant": variant_name(variant) + ("" if order is None else ", classes shuffled"),
        "class_order_seed": order,
        "features": path.rsplit("/", 1)[-1],
        "classes": name,
        "true_k": true_k,
        "known": known,
        "k": ks,
        "largest_relative_error": max((row["relative_error"] for row in rows), key=abs),
        "k_spread": max(ks) - min(ks),
        "rows": rows,
    }


def variant_name(variant: tuple[int, float, int]) -> str:
    return f"{variant[0]} neighbours, prior {variant[1]:g} images, mixing on {variant[2]}"


def summary(results: list[dict]) -> dict:
    """Per variant: `summary_of` its results."""
    variants = dict.fromkeys(r["variant"] for r in results)
    return {v: summary_of([r for r in results if r["variant"] == v]) for v in variants}


def summary_of(results: list[dict]) -> dict:
    answers = [(row, result["true_k"]) for result in results for row in result["rows"]]
    errors = [row["relative_error"] for row, _ in answers]
    counted, if_mixed = (rounded_errors(answers, key) for key in ("k_count", "k_if_mixed"))
    return {
        "answers": len(errors),
        "within_10_percent": share_within_10_percent(errors),
        "mean_absolute_error": round(float(np.mean(np.abs(errors))), 4),
        "largest_relative_error": max(errors, key=abs),
        "range_holds_true_k": round(
            float(np.mean([row["k_range"][0] <= k <= row["k_range"][1] for row, k in answers])), 4
        ),
        "range_width": round(float(np.mean([(row["k_range"][1] - row["k_range"][0]) / k for row, k in answers])), 4),
        "k_count_within_10_percent": share_within_10_percent(counted),
        "k_count_mean_relative_error": round(float(np.mean(counted)), 4),
        "k_if_mixed_within_10_percent": share_within_10_percent(if_mixed),
        "k_if_mixed_mean_relative_error": round(float(np.mean(if_mixed)), 4),
    }


def rounded_errors(answers: list[tuple[dict, int]], key: str) -> list[float]:
    """The relative errors of each row's `key`, rounded to a K, as an answer would be."""
    return [round(row[key]) / true_k - 1 for row, true_k in answers]


def share_within_10_percent(errors: list[float]) -> float:
    """Rounded first, as each row's error is: 44 for 40 is 10% off, not 10.000000000000009%."""
    return round(float(np.mean([abs(round(e, 4)) <= 0.1 for e in errors])), 4)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sample_arguments(ap, "class sets: RANGES[:KNOWN], RANGES a comma list or all")
    ap.add_argument(
        "--neighbours", type=int, nargs="+", default=[NEIGHBOURS], help="neighbours per image, each counted"
    )
    ap.add_argument(
        "--prior",
        type=float,
        nargs="+",
        default=[PRIOR_IMAGES],
        help="labelled images' worth of the pooled share each class's own is drawn towards (0: its own alone, inf: "
        "the pooled share for all), each counted",
    )
    ap.add_argument(
        "--long-tail",
        type=share_range,
        metavar="LO-HI",
        help="keep of each class a share of its images drawn log-uniformly from LO to HI (say 0.1-1)",
    )
    ap.add_argument(
        "--uneven",
        type=share_range,
        metavar="LO-HI",
        help="label each known class in its own share drawn from LO to HI (say 0.1-0.9) instead of GCD's half",
    )
    ap.add_argument(
        "--points-per-class",
        type=int,
        metavar="P",
        help="count uniform subsamples of P images per class of the set, as the count's own of a set of many classes",
    )
    ap.add_argument(
        "--subsamples", type=int, default=SUBSAMPLES, help="subsamples counted and averaged where a set is subsampled"
    )
    ap.add_argument(
        "--shuffle-classes",
        type=int,
        metavar="N",
        help="instead of the set's first classes, take the known ones at random: N random class orders (seeds 0..N-1)",
    )
    ap.add_argument(
        "--wide-neighbours",
        type=int,
        nargs="+",
        default=[WIDE_NEIGHBOURS],
        help="neighbours on which the new images' mixing is read, each counted",
    )
    ap.add_argument("--json", help="also write the result here (after every set)")
    args = smoke.shrink(ap.parse_args(argv), sets=["0-5"], resamples=1)
    clock = Stopwatch()
    results = []
    variants = [(n, prior, wide) for n in args.neighbours for prior in args.prior for wide in args.wide_neighbours]
    orders = [None] if args.shuffle_classes is None else list(range(args.shuffle_classes))
    jobs = [
        (v, order, path, *parse_set(text))
        for v in variants
        for order in orders
        for path in args.features
        for text in args.sets
    ]
    for i, job in enumerate(jobs):
        results.append(measure(*job, args))
        last = i == len(jobs) - 1
        emit_json(
            {"summary": summary(results), "results": results, "seconds": round(clock.seconds(), 1)},
            args.json,
            echo=last,
        )


if __name__ == "__main__":
    main()
