"""Estimate the number of categories K when it is unknown (`infosieve estimate-k`), by one of two rules.

The default, `rule="neighbours"`, counts the unlabelled images that lack the labelled neighbours the known classes'
images have, in classes of the known classes' mean size, allowing for the mixing the surely new ones show
(neighbour_count.py). `rule="score"` is GCD's search, below.
Both end with the novelty test ("nothing new", below). docs/kmeans.md measures both.

The score rule is GCD's (Vaze et al. 2022, `methods/estimate_k/estimate_k.py`). For a candidate K, k-means runs on
all the points, labelled and unlabelled, ignoring the labels. The score is the clustering accuracy (Hungarian) on the
labelled points. Too few clusters merge known classes; too many split them. GCD maximises the score over
[n_old, k_max] with a bounded Brent search.

Departures, each to make the answer less noisy. A single k-means run's labelled accuracy jumps by ±0.02 from seed to
seed, enough to send Brent's search astray (GCD reports 231 for CUB's 200), and the score can have two peaks of about
one height, of which Brent's search climbs whichever its first steps find. So:
- the score of K is the mean over `n_seeds` k-means runs, each with its own seed and its own random `SUBSAMPLE` (90%)
  of the points, scored on the labelled points it drew; each K is scored once and cached. The same run clusters the
  same subsample at every K, and its spread over the runs holds the data's noise beside the seeds': the answer must
  not hang on which images happen to be in the set;
- the scores are smoothed across K (local-linear regression with a Gaussian kernel `BANDWIDTH` x n_old wide: 7.5 K
  for 10 known classes); the noise of one K's score is the seeds' standard error pooled over the K scored;
- in place of Brent's search, K is scored on an even grid of `GRID_POINTS` values over [n_old, k_max], then every K
  from two below to two above the plausible range, again while that range grows (every third of the smoothing's
  width where that is over 3 K: every 12th K for 50 known classes);
- every K whose smoothed score lies within `BAND` (4) pooled standard errors of the best smoothed score is plausible
  (`k_range`: the smallest and largest), and the answer is the lower third of the plausible K (the one a third of
  the way up their sorted list, `k_lower_third`);
- where that lower third is the number of known classes itself, which leaves no cluster for a new category, and a
  larger K is plausible too, the answer is the smallest plausible K above the known classes: the unlabelled points
  are where new categories are looked for, and the score cannot tell those K apart. Where no larger K is plausible,
  the answer stays the known classes' number and `k_warning` says so;
- "nothing new" is an answer: the score cannot give it (with only known classes in the pool a few extra clusters
  score as well), so a second test asks whether the unlabelled points lie as near the known classes as the labelled
  ones do (`novelty.py`). Where they do, K is the number of known classes and the result says no new category was
  found (`novelty_test=False`: the score's answer alone, as before);
- where no K scores better than the known classes although the novelty test finds something new, clusters for
  the new categories do not raise the known classes' accuracy: the score cannot count them, the answer is a lower
  bound, and `k_warning` says so (CIFAR-10's EfficientNet-Lite0 features, docs/kmeans.md).

Why. On resamples of the same species the unsmoothed score's best K and the smallest K within one standard error of
it moved by up to 15 classes: the score is flat near its peak, and its change between resamples is larger than the
seeds' standard error. Subsamples, smoothing and the pooled error steady the curve. The position in the plausible
range, the band and the smoothing's width were then chosen (issue 43) on cub100 species 0-39 only (sets of 10 to 40
species, a third to three quarters of them known, EfficientNet-Lite0 features at 224 and 112 px, each set whole and
with three resamples dropping 2% of the images), for the smallest mean distance from the true K with the resamples'
spread no larger than the previous rule's (the lower quartile of a band of 2 errors, width 0.3, which answered low,
most of all on the weaker 112 px features): first width 0.5 and band 3, then, among wider smoothings ranked on the
same scores, width 0.75 and band 4. No rule tried was within 10% of the true K on every set: the score answers low
where few of the classes are known (the search's top, 4 x n_old, then cuts the plausible range short) or the
features are weak, and high where most are known.
docs/kmeans.md has the choice, the measurement across 10 to 100 species and on held-out species, and where it fails.
The rule's `k_range` is wide: it is the K the score cannot tell apart, not a confidence interval.

A second criterion is reported beside the first: the silhouette of the unlabelled points under the semi-supervised
k-means with K clusters, for the grid's K and the answer. It is computed on at most 4,000 points with a fixed seed,
for the K below that number of points only (the silhouette needs fewer clusters than points). It is not used to
choose K.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from sklearn.metrics import silhouette_score

from ..kmeans import semi_supervised_kmeans
from .metrics import cluster_acc
from .neighbour_count import count_by_neighbours
from .novelty import Z_NEW, pool_novelty

SILHOUETTE_SAMPLE = 4000
GRID_POINTS = 16  # K values scored evenly over the whole range before the search around the best
SUBSAMPLE = 0.9  # share of the points each k-means run clusters, a different random share per run
BANDWIDTH = 0.75  # the width of the smoothing across K, as a share of the known classes (7.5 K for 10 known)
BAND = 4.0  # plausible: a smoothed score within this many pooled standard errors of the best


def labelled_accuracy(
    feats: torch.Tensor,
    targets: np.ndarray,
    labelled: np.ndarray,
    k: int,
    *,
    n_seeds: int,
    max_iter: int,
    seed: int,
    labels_table: Callable[[torch.Tensor], torch.Tensor] | None = None,
    subsample: float = 1.0,
) -> tuple[float, float]:
    """(mean, standard error) over `n_seeds` k-means runs of the clustering accuracy on the labelled points.
    `labels_table`: maps the k-means labels of `feats`' rows to the rows of `targets` and `labelled`, when those are
    indexed otherwise (the trainer's tables by sample id, complete on every rank under torchrun, where `feats` holds
    this rank's share); None: the same rows. Only `targets[labelled]` is read. `subsample` < 1: each run clusters its
    own random share of the rows (drawn with `RandomState(seed + run)`) and is scored on the labelled rows drawn."""
    if not 0 < subsample <= 1:
        raise ValueError(f"subsample must lie in (0, 1], got {subsample}")
    if subsample < 1 and labels_table is not None:
        raise ValueError("subsample < 1 needs the rows of feats, targets and labelled to match: pass no labels_table")
    accs = []
    for s in range(n_seeds):
        rows = slice(None)
        if subsample < 1:
            rows = np.sort(np.random.RandomState(seed + s).choice(len(feats), round(len(feats) * subsample), False))
        res = semi_supervised_kmeans(feats[rows], None, None, k, n_init=1, max_iter=max_iter, seed=seed + s)
        labels = res.labels if labels_table is None else labels_table(res.labels)
        scored = labelled[rows]
        accs.append(cluster_acc(targets[rows][scored], labels.cpu().numpy()[scored]))
    return float(np.mean(accs)), float(np.std(accs, ddof=1) / np.sqrt(n_seeds)) if n_seeds > 1 else 0.0


def unlabelled_silhouette(
    feats: torch.Tensor, targets: np.ndarray, labelled: np.ndarray, k: int, *, max_iter: int, seed: int
) -> float:
    """Silhouette of the unlabelled points under semi-supervised k-means with k clusters (labelled points anchored)."""
    lab = torch.from_numpy(labelled).to(feats.device)
    res = semi_supervised_kmeans(
        feats[~lab], feats[lab], torch.from_numpy(targets[labelled]), k, n_init=1, max_iter=max_iter, seed=seed
    )
    pred = res.labels.cpu().numpy()[int(labelled.sum()) :]
    if len(np.unique(pred)) < 2:
        return -1.0  # one cluster: no second cluster to be nearer to
    x = feats[~lab].float().cpu().numpy()
    size = min(SILHOUETTE_SAMPLE, len(x))
    return float(silhouette_score(x, pred, sample_size=size, random_state=seed))


RULES = ("neighbours", "score")


def estimate_k(
    feats,
    targets,
    labelled,
    n_old: int,
    *,
    rule: str = "neighbours",
    k_max: int | None = None,
    n_seeds: int = 4,
    max_iter: int = 10,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
    silhouette: bool = True,
    subsample: float = SUBSAMPLE,
    bandwidth: float = BANDWIDTH,
    novelty_test: bool = True,
) -> dict:
    """Estimate K from features [N, D] (L2-normalised here), targets [N] (used on the labelled points only) and the
    labelled mask [N]. `rule`: "neighbours" counts the unlabelled images without labelled neighbours
    (neighbour_count.py; `seed` draws its subsample of large sets), "score" searches GCD's score over
    [n_old, k_max] (default: 4 x n_old, at most N // 2) with `n_seeds` k-means runs of `max_iter` iterations per K.
    Returns a JSON-ready dict: `k`, the `rule` and its `method`, `k_range`, `k_by_<rule>` (the rule's own answer),
    the `novelty` test, the seconds taken, and each rule's own account: the count (`count`) or the score's search
    (`search`, `k_lower_third`, `k_by_argmax`, the pooled standard error, both criteria's curves over the K scored,
    sorted: the labelled accuracy as scored and smoothed, the silhouette on the grid's K and the answer when
    `silhouette`). `subsample` 1 and `bandwidth` 0: every score run clusters all the points, and the scores are not
    smoothed. `novelty_test`: K is the number of known classes where the unlabelled points hold nothing new
    (`novelty.py`); False: the rule's own answer."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    x, y, lab = checked_inputs(feats, targets, labelled, n_old, device)
    start = time.perf_counter()
    if rule == "neighbours":
        found = neighbours_estimate(x, y, lab, n_old, seed)
    else:
        k_max = search_top(len(x), n_old, k_max)
        found = score_estimate(x, y, lab, n_old, k_max, n_seeds, max_iter, seed, progress, subsample, bandwidth)
    novelty = pool_novelty(x, y, lab, n_old) if novelty_test else None
    k = n_old if novelty is not None and not novelty["new"] else found[f"k_by_{rule}"]
    if rule == "score":
        found = with_criteria(
            found, k, x, y, lab, max_iter=max_iter, seed=seed, silhouette=silhouette, progress=progress
        )
    return {"k": k, "rule": rule, **found, "novelty": novelty, "seconds": round(time.perf_counter() - start, 2)}


def neighbours_estimate(x: torch.Tensor, y: np.ndarray, lab: np.ndarray, n_old: int, seed: int) -> dict:
    """The neighbours rule's part of estimate_k's result."""
    count = count_by_neighbours(x, y, lab, n_old, seed=seed)
    return {
        "method": f"the unlabelled images without labelled neighbours ({count['neighbours']} nearest), counted in "
        "classes of the known classes' mean size, with the mixing with the known classes that the surely new images "
        f"show ({count['wide_neighbours']} nearest)",
        "search": {"k_min": n_old, "neighbours": count["neighbours"], "seed": seed},
        "k_by_neighbours": count["k"],
        "k_range": count["k_range"],
        "count": count,
    }


def score_estimate(
    x: torch.Tensor,
    y: np.ndarray,
    lab: np.ndarray,
    n_old: int,
    k_max: int,
    n_seeds: int,
    max_iter: int,
    seed: int,
    progress: Callable[[str], None] | None,
    subsample: float,
    bandwidth: float,
) -> dict:
    """The score rule's part of estimate_k's result, with its raw `scores`, `errors`, smoothed `curve` and the `grid`
    of K, for `with_criteria` to finish once the answer is known."""
    scores: dict[int, float] = {}
    errors: dict[int, float] = {}

    def score(k: int) -> None:
        scores[k], errors[k] = labelled_accuracy(
            x, y, lab, k, n_seeds=n_seeds, max_iter=max_iter, seed=seed, subsample=subsample
        )
        if progress is not None:
            progress(f"K={k}: labelled accuracy {scores[k]:.4f} ± {errors[k]:.4f}")

    grid = sorted({int(k) for k in np.linspace(n_old, k_max, GRID_POINTS).round()})
    for k in grid:
        score(k)
    width = bandwidth * n_old
    found = choose_k(scores, errors, score, n_old, k_max, width)
    return {
        "method": "GCD's score (k-means on all points, Hungarian accuracy on the labelled ones) on subsamples, "
        "smoothed across K; a grid, then the plausible range",
        "search": {
            "k_min": n_old,
            "k_max": k_max,
            "n_seeds": n_seeds,
            "max_iter": max_iter,
            "seed": seed,
            "subsample": subsample,
            "smoothing_width": round(width, 6),
        },
        "k_by_score": found["k"],
        "k_range": found["k_range"],
        "k_lower_third": found["k_lower_third"],
        "k_by_argmax": found["k_by_argmax"],
        "pooled_standard_error": round(found["noise"], 6),
        "scores": scores,
        "errors": errors,
        "curve": found["curve"],
        "grid": grid,
    }


def with_criteria(found: dict, k: int, x, y, lab, *, max_iter: int, seed: int, silhouette: bool, progress) -> dict:
    """`found` (score_estimate's) with its curves as `criteria` and `k_by_silhouette`, the silhouette taken on the
    grid's K and the answer `k`."""
    found = dict(found)
    grid, scores, errors, curve = (found.pop(key) for key in ("grid", "scores", "errors", "curve"))
    shown = silhouette_ks(sorted({*grid, k}) if silhouette else [], int((~lab).sum()), progress)
    silhouettes = {k: unlabelled_silhouette(x, y, lab, k, max_iter=max_iter, seed=seed) for k in shown}
    found["criteria"] = criteria_curves(scores, errors, curve, silhouettes)
    found["k_by_silhouette"] = max(silhouettes, key=lambda k: silhouettes[k]) if silhouettes else None
    return found


def silhouette_ks(ks: list[int], n_unlabelled: int, progress: Callable[[str], None] | None) -> list[int]:
    """The K of `ks` whose silhouette can be computed: fewer than the unlabelled points it is computed on (at most
    `SILHOUETTE_SAMPLE`); the K left out are said through `progress`."""
    points = min(SILHOUETTE_SAMPLE, n_unlabelled)
    kept = [k for k in ks if k < points]
    if len(kept) < len(ks) and progress is not None:
        progress(f"silhouette skipped for K >= {points}: it needs fewer clusters than the {points} unlabelled points")
    return kept


def criteria_curves(scores: dict, errors: dict, smoothed: dict, silhouettes: dict) -> dict:
    """The result's `criteria`: each curve by K (as strings, ascending), rounded to 6 decimals."""
    return {
        "labelled_accuracy": {str(k): round(scores[k], 6) for k in sorted(scores)},
        "labelled_accuracy_standard_error": {str(k): round(errors[k], 6) for k in sorted(scores)},
        "labelled_accuracy_smoothed": {str(k): round(v, 6) for k, v in sorted(smoothed.items())},
        "unlabelled_silhouette": {str(k): round(v, 6) for k, v in silhouettes.items()},
    }


def range_reason(count: dict, low: int, high: int) -> str:
    """Why the neighbours count's range is `low`-`high`: the sizes' spread about the count, and where the classes mix,
    about the count that allows for it (neighbour_count.new_classes_if_mixed)."""
    sizes = "if the new classes' sizes vary as the known ones' do"
    if round(count["k_if_mixed"]) <= count["k"]:
        return f"K {low}-{high} {sizes}"
    return (
        f"K {low}-{high} {sizes}, and new images may pass for known ones as often as the known classes' images pass "
        f"for each other ({1 - count['labelled_purity']:.0%} of their labelled neighbours are of another class): K "
        f"{round(count['k_if_mixed'])} then"
    )


def mixing_reason(count: dict, known: int) -> str:
    """What the allowance for the new images' mixing (neighbour_count.mixing_read_off_new_images) added, where it
    moved K."""
    if round(count["k_unrounded"]) == round(count["k_count"]):
        return ""
    return (
        f"; the surely new images' {count['wide_neighbours']} nearest hold labelled images "
        f"{count['new_mixing_share']:.0%} as often as the known classes' images hold another known class's, and that "
        f"share of the mixing is allowed for: {count['k_unrounded'] - known:.1f} new classes"
    )


def describe_choice(result: dict) -> str:
    """The answer's line for the terminal: how the rule reached its K, and the range."""
    known = result["search"]["k_min"]
    if result["rule"] == "neighbours":
        count = result["count"]
        low, high = result["k_range"]
        said = (
            f"{count['novel_share']:.0%} of the unlabelled images (about {count['novel_images']:.0f}) lack the "
            f"labelled neighbours ({count['neighbours']} nearest) that the known classes' images have; at the known "
            f"classes' mean size, {count['class_size']:.0f} images, that is {count['k_count'] - known:.1f} new "
            f"classes{mixing_reason(count, known)}: K = {result['k_by_neighbours']} ({range_reason(count, low, high)})"
        )
    else:
        low, high = result["k_range"]
        third = result["k_lower_third"]
        rule = "the lower third is chosen"
        if result["k_by_score"] != third:
            rule = (
                f"the lower third, K = {third}, would leave no cluster for new categories, so the smallest "
                f"plausible K above the {known} known classes is chosen"
            )
        said = (
            f"plausible K {low}-{high}, within {BAND:g} pooled standard errors of the best smoothed score (K = "
            f"{result['k_by_argmax']}); {rule}"
        )
    if nothing_new(result):
        novelty, answer = result["novelty"], result[f"k_by_{result['rule']}"]
        said += (
            f"; that would be K = {answer}, but the unlabelled points lie as near the {known} known classes as the "
            f"labelled ones do ({novelty['beyond']:.0%} beyond the labelled points' {novelty['quantile']:.0%} "
            f"quantile, z = {novelty['z']:.1f} < {Z_NEW:g}): nothing new, K = the known classes"
        )
    return said


def nothing_new(result: dict) -> bool:
    """Whether the answer is the known classes because the unlabelled points hold nothing new (`novelty.py`)."""
    return result.get("novelty") is not None and not result["novelty"]["new"]


def k_warning(result: dict) -> str | None:
    """A warning when the answer cannot be taken as the number of categories, None otherwise:
    - it is the number of known classes, which leaves no cluster for new categories, because the unlabelled points
      look like the known classes, or because the rule finds no larger K (the score: none plausible; the count:
      fewer new images than half a known class);
    - the score rule's answer is above them and the novelty test finds something new, but no K scored better than
      the known classes (the score as scored, before smoothing, which can lift an edge of the curve): clusters for
      the new categories do not raise the known classes' accuracy, so the score cannot count them, and the answer
      (the smallest plausible K that leaves them a cluster) is a lower bound."""
    known, k = result["search"]["k_min"], result["k"]
    if k > known:
        if result["rule"] != "score" or not result.get("novelty") or nothing_new(result):
            return None
        scores = result["criteria"]["labelled_accuracy"]
        if max(scores.values()) > scores[str(known)]:
            return None
        return (
            f"no K scores better than the {known} known classes, yet the unlabelled images hold something new "
            f"(novelty z = {result['novelty']['z']:.1f}): clusters for the new categories do not raise the known "
            f"classes' accuracy in these features, so the score cannot count them; K = {k} is a lower bound, not a "
            "count: set kmeans.n_clusters to the number you expect, or estimate again with the neighbours rule "
            "(--rule neighbours) or on a trained run's features (infosieve estimate-k --run)"
        )
    if nothing_new(result):
        return (
            f"no new category was found: K = {known}, the known classes (the unlabelled images lie as near them as the "
            f"labelled ones do); if you expect new categories, set kmeans.n_clusters to the number you expect, above "
            f"{known}"
        )
    reason = {
        "score": "no larger K scores as well",
        "neighbours": "fewer unlabelled images lack labelled neighbours than half a known class holds",
    }[result["rule"]]
    return (
        f"K = {known} is the number of known classes, so no cluster is left for new categories ({reason}): if the "
        f"unlabelled images hold new categories, set kmeans.n_clusters to the number you expect, above {known}"
    )


def checked_inputs(feats, targets, labelled, n_old: int, device) -> tuple:
    """(features L2-normalised on `device`, targets, labelled mask) once the inputs agree with each other."""
    x = torch.as_tensor(np.asarray(feats), dtype=torch.float32, device=device)
    x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    y = np.asarray(targets).astype(np.int64)
    lab = np.asarray(labelled).astype(bool)
    if not (len(x) == len(y) == len(lab)):
        raise ValueError(f"features, targets and labelled differ in length: {len(x)}, {len(y)}, {len(lab)}")
    if not lab.any() or lab.all():
        raise ValueError("estimate-k needs labelled and unlabelled points: check the labelled mask")
    if n_old < 2:
        raise ValueError(
            f"estimating K needs at least 2 known classes, got {n_old}: with one, K = 1 puts every labelled point in "
            "one cluster and always scores best; give K as a number instead"
        )
    return x, y, lab


def search_top(n: int, n_old: int, k_max: int | None) -> int:
    """The score rule's largest K: `k_max`, or 4 x n_old and at most half the `n` points."""
    if k_max is None and n // 2 <= n_old:
        raise ValueError(
            f"{n} points are too few to estimate K: the search goes up to half the points, {n // 2}, which "
            f"is not above the {n_old} known classes; add images, or give K as a number"
        )
    k_max = min(4 * n_old, n // 2) if k_max is None else k_max
    if k_max <= n_old:
        raise ValueError(f"k_max={k_max} must exceed the {n_old} known classes: pass a larger --k-max")
    return k_max


def smoothed(scores: dict[int, float], width: float) -> dict[int, float]:
    """The scores smoothed across K, at every K scored: a straight line fitted by least squares with Gaussian weights
    of standard deviation `width` (in K) around each K, read at that K (local-linear regression: a line stays as it
    is, and the scored K need not be evenly spaced). `width` 0: the scores themselves."""
    if width <= 0:
        return dict(scores)
    ks = np.array(sorted(scores), dtype=np.float64)
    values = np.array([scores[int(k)] for k in ks])
    curve = {}
    for k in ks:
        d = ks - k
        w = np.exp(-0.5 * (d / width) ** 2)
        s0, s1, s2 = w.sum(), (w * d).sum(), (w * d * d).sum()
        t0, t1 = (w * values).sum(), (w * d * values).sum()
        det = s0 * s2 - s1 * s1
        curve[int(k)] = float((s2 * t0 - s1 * t1) / det) if det > 1e-9 * s0 * s2 else float(t0 / s0)
    return curve


def pooled_error(errors: dict[int, float]) -> float:
    """One K's standard error, pooled over the K scored (the root mean square): the seeds' noise hardly depends on K,
    and one K's estimate from a few seeds is itself noisy."""
    return float(np.sqrt(np.mean(np.square(list(errors.values())))))


def plausible_ks(curve: dict[int, float], noise: float, band: float = BAND) -> list[int]:
    """The K, sorted, whose (smoothed) score lies within `band` x `noise` of the best (another band than `BAND`: only
    to compare rules, benchmarks/bench_k_rule_choice.py)."""
    best = max(curve.values())
    return sorted(k for k, v in curve.items() if v >= best - band * noise)


def choose_k(
    scores: dict[int, float],
    errors: dict[int, float],
    score: Callable[[int], object],
    k_min: int,
    k_max: int,
    width: float,
) -> dict:
    """The answer from the K scored so far: scores the K from two steps below the smallest plausible K to two steps
    above the largest (`score(k)` fills `scores` and `errors`), again while the plausible range grows, then answers
    with the lower third of the plausible K (index (n - 1) // 3 of the n sorted). The step is a third of the
    smoothing's width, at least 1 (K = k_min, k_min + step, ...): a smooth curve needs no more. Returns `k`,
    `k_range`, `k_by_argmax` (of the smoothed curve), the smoothed `curve` and the pooled standard error `noise`;
    `k_lower_third`, the rule's answer before it is raised above `k_min` (module docstring)."""
    step = max(1, int(width // 3))
    while True:
        curve, noise = smoothed(scores, width), pooled_error(errors)
        plausible = plausible_ks(curve, noise)
        low, high = plausible[0] - 2 * step, plausible[-1] + 2 * step
        todo = [k for k in range(k_min, k_max + 1, step) if low <= k <= high and k not in scores]
        if not todo:
            break
        for k in todo:
            score(k)
    third = plausible[(len(plausible) - 1) // 3]
    above_known = [k for k in plausible if k > k_min]
    return {
        "k": above_known[0] if third == k_min and above_known else third,
        "k_lower_third": third,
        "k_range": [plausible[0], plausible[-1]],
        "k_by_argmax": max(curve, key=lambda k: (curve[k], -k)),
        "curve": curve,
        "noise": noise,
    }


def load_features(path: str, known_classes: int, prop: float = 0.5, seed: int = 0) -> tuple:
    """(F, y, labelled) from an `.npz` with `F` [N, D] and `y` [N]: classes 0..known_classes-1 are known and `prop`
    of their samples labelled with `RandomState(seed)` (the GCD split)."""
    from ..data.splits import gcd_split

    with np.load(path) as data:
        missing = {"F", "y"} - set(data.files)
        if missing:
            raise ValueError(f"{path} lacks {sorted(missing)}: a features file holds F [N, D] and y [N]")
        feats, y = data["F"], data["y"].astype(np.int64)
    if not 0 < known_classes < len(np.unique(y)):
        raise ValueError(f"--known-classes must lie in 1..{len(np.unique(y)) - 1} for {path}, got {known_classes}")
    labelled, _ = gcd_split(y, list(range(known_classes)), prop, seed)
    return feats, y, np.asarray(labelled, bool)
