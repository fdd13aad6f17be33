"""How estimate-k's rule was chosen (issue 43): the score of every K on sets of classes, then each candidate rule's
answer read off those scores, against the true number of classes.

For each features file and each set `LO-HI:KNOWN` (the first KNOWN classes of LO..HI known, half of their images
labelled with GCD's split, seed 0), on the whole set and on `--resamples` resamples that each drop `--drop` of the
images: the labelled accuracy (estimate-k's score: `--seeds` k-means runs, each on its own 90% subsample) at every
K from KNOWN to estimate-k's k_max, every (KNOWN // 10)th K. Each rule (smoothing width as a share of the known
classes, band in pooled standard errors, position in the sorted plausible K; raised above the known classes as
estimate-k does) then answers from those scores alone, as estimate-k's search would from the K it scores. The rules
are ranked by their mean distance from the true K; each row also gives the largest distance, the share of answers
within 10% and the spread of K over each set's resamples.

The choice was made on cub100 species 0-39 (species 40-59 are refused here; 60-99 were kept for the measurement
after it). `--curves JSON` ranks the rules on the scores an earlier run wrote (its `curves`) instead of scoring again:
how wider smoothings were compared on the same scores. docs/kmeans.md has the commands and the result.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from benchmarks import smoke
from benchmarks.bench_estimate_k import class_range, drop_resamples, load_classes, refuse_reserved
from benchmarks.harness import Stopwatch
from benchmarks.tools.provenance import emit_json
from infosieve_fast.data.splits import gcd_split
from infosieve_fast.evaluation.estimate_k import (
    checked_inputs,
    labelled_accuracy,
    plausible_ks,
    pooled_error,
    search_top,
    smoothed,
)

WIDTHS = (0.3, 0.5, 0.75, 1.0, 1.25, 1.5)
BANDS = (2.0, 3.0, 4.0, 5.0, 6.0)
POSITIONS = (1 / 4, 0.3, 1 / 3, 0.4, 0.5)  # index floor((n - 1) x position) of the n sorted plausible K


def class_set(text: str) -> tuple[int, int, int]:
    """`LO-HI:KNOWN` -> (LO, HI, KNOWN)."""
    span, _, known = text.partition(":")
    return (*class_range(span), int(known))


def score_curve(feats, y, labelled, known: int, seeds: int) -> dict[int, tuple[float, float]]:
    """(mean, standard error) of the labelled accuracy at every (known // 10)th K of estimate-k's range."""
    x, y, lab = checked_inputs(feats, y, labelled, known, "cpu")
    k_max = search_top(len(x), known, None)
    step = max(1, known // 10)
    return {
        k: labelled_accuracy(x, y, lab, k, n_seeds=seeds, max_iter=10, seed=0, subsample=0.9)
        for k in range(known, k_max + 1, step)
    }


def rule_answer(curve: dict[int, tuple[float, float]], known: int, width: float, band: float, position: float) -> int:
    """The K a rule gives from a score curve: the plausible K's entry at `position`, raised above the known classes
    where it is their number and a larger K is plausible (estimate_k.choose_k's rule with these settings)."""
    smooth = smoothed({k: m for k, (m, _) in curve.items()}, width * known)
    plausible = plausible_ks(smooth, pooled_error({k: e for k, (_, e) in curve.items()}), band)
    k = plausible[int((len(plausible) - 1) * position + 1e-9)]
    above = [p for p in plausible if p > known]
    return above[0] if k == known and above else k


def peaks(curves: list[dict]) -> dict[str, dict[str, list[int]]]:
    """Per curve and smoothing width, the K where each sample's smoothed score is highest: where the score itself
    points, whatever a rule reads off around it."""
    return {
        c["name"]: {str(w): [smoothed_peak(s, w * c["known"]) for s in c["samples"].values()] for w in WIDTHS}
        for c in curves
    }


def smoothed_peak(curve: dict[int, tuple[float, float]], width: float) -> int:
    smooth = smoothed({k: m for k, (m, _) in curve.items()}, width)
    return max(smooth, key=lambda k: (smooth[k], -k))


def rank_rules(curves: list[dict]) -> list[dict]:
    """Every rule's answers on every curve, and its errors, ranked by the mean distance from the true K."""
    rows = []
    for width in WIDTHS:
        for band in BANDS:
            for position in POSITIONS:
                answers, errors, spreads = {}, [], []
                for c in curves:
                    ks = [rule_answer(s, c["known"], width, band, position) for s in c["samples"].values()]
                    answers[c["name"]] = ks
                    errors += [abs(k / c["true_k"] - 1) for k in ks]
                    spreads.append(max(ks[1:] or ks) - min(ks[1:] or ks))
                rows.append(
                    {
                        "width": width,
                        "band": band,
                        "position": round(position, 4),
                        "mean_relative_error": round(float(np.mean(errors)), 4),
                        "largest_relative_error": round(max(errors), 4),
                        "within_10_percent": round(float(np.mean(np.array(errors) <= 0.1 + 1e-9)), 4),
                        "largest_resample_spread": max(spreads),
                        "mean_resample_spread": round(float(np.mean(spreads)), 3),
                        "answers": answers,
                    }
                )
    return sorted(rows, key=lambda r: (r["mean_relative_error"], r["largest_resample_spread"]))


def read_curves(path: str) -> list[dict]:
    """The `curves` of an earlier run's JSON, with each K back to an integer and each score to a (mean, error) pair."""
    with open(path) as f:
        curves = json.load(f)["curves"]
    for c in curves:
        c["samples"] = {s: {int(k): tuple(v) for k, v in curve.items()} for s, curve in c["samples"].items()}
    return curves


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", nargs="+", help=".npz files with F [N, D] and y [N]")
    ap.add_argument("--sets", nargs="+", type=class_set, help="LO-HI:KNOWN, e.g. 0-19:10")
    ap.add_argument("--curves", help="rank the rules on the curves of an earlier run's JSON (no --features, --sets)")
    ap.add_argument("--resamples", type=int, default=3)
    ap.add_argument("--drop", type=float, default=0.02, help="share of the images each resample drops")
    ap.add_argument("--seeds", type=int, default=4, help="k-means runs per K (estimate-k's --seeds)")
    ap.add_argument("--json", help="also write the result here (the curves after every set)")
    args = ap.parse_args(argv)
    if args.curves:
        if args.features or args.sets:
            ap.error("--curves ranks an earlier run's curves: give no --features or --sets with it")
        curves = read_curves(args.curves)
        result = {"curves_from": args.curves, "rules": rank_rules(curves), "peaks": peaks(curves)}
        emit_json(result, args.json, echo=False)
        print_ranking(result["rules"])
        return
    if not (args.features and args.sets):
        ap.error("give --features and --sets (or --curves)")
    args = smoke.shrink(args, sets=[(0, 5, 3)], resamples=1, seeds=2)
    torch.set_num_threads(1)
    clock = Stopwatch()
    curves = []
    for path in args.features:
        for lo, hi, known in args.sets:
            refuse_reserved(path, [(lo, hi)])
            feats, y = load_classes(path, lo, hi)
            labelled = np.asarray(gcd_split(y, list(range(known)), 0.5, 0)[0], bool)
            samples = drop_resamples(len(y), args.resamples, args.drop)
            name = f"{path.rsplit('/', 1)[-1]} {lo}-{hi}:{known}"
            scored = {s: score_curve(feats[i], y[i], labelled[i], known, args.seeds) for s, i in samples.items()}
            curves.append({"name": name, "true_k": hi - lo + 1, "known": known, "samples": scored})
            result = {"rules": rank_rules(curves), "peaks": peaks(curves), "curves": curves}
            result["seconds"] = round(clock.seconds(), 1)
            emit_json(result, args.json, echo=False)
    print_ranking(result["rules"])


def print_ranking(rules: list[dict]) -> None:
    print("\n".join(f"{r['width']} {r['band']} {r['position']}: {r['mean_relative_error']}" for r in rules))


if __name__ == "__main__":
    main()
