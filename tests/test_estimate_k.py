"""estimate-k: the search recovers K on separated blobs and on real CUB-100 features; its choice rule and smoothing
on hand-built score curves, with the answer raised above the known classes or a warning where it would leave no
cluster for new categories; a pool too small for the silhouette; the CLI and its errors."""

import json
import re

import numpy as np
import pytest
import torch

from infosieve_fast import cli
from infosieve_fast.data.splits import gcd_split
from infosieve_fast.evaluation.estimate_k import (
    BAND,
    BANDWIDTH,
    SUBSAMPLE,
    choose_k,
    describe_choice,
    estimate_k,
    k_warning,
    load_features,
    pooled_error,
    smoothed,
)
from infosieve_fast.evaluation.novelty import Z_NEW, pool_novelty

SAID = r"K=(\d+): labelled accuracy (0\.\d{4}|1\.0000) ± (0\.\d{4})"


def _blobs(k: int, per: int, dim: int = 32, seed: int = 0):
    """k Gaussian blobs of unit spread whose centres lie ~11 spreads apart: one k-means run at the true K scores
    about 0.98 on them, so the score has one clear peak (at 16 dimensions and 4 spreads apart, k-means' local minima
    flatten it from K = 9 to 16)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, dim)) * 8
    y = np.repeat(np.arange(k), per)
    return centres[y] + rng.normal(size=(len(y), dim)), y


def test_separated_blobs_give_their_number_within_one():
    """The score peaks sharply at the true 12; the smoothing (4.5 K wide for 6 known classes) moves the peak of its
    curve towards the side where the score falls more slowly (more clusters), and the answer, read off that curve, is
    13 (12 with the smoothing 3 K wide and the band of 3 errors that this rule replaced)."""
    x, y = _blobs(12, 30)
    labelled, _ = gcd_split(y, list(range(6)), 0.5, 0)
    said = []
    res = estimate_k(x, y, labelled, 6, rule="score", k_max=30, progress=said.append)
    assert res["k"] in (12, 13) and res["k_by_argmax"] in (12, 13, 14)
    curve = {int(k): v for k, v in res["criteria"]["labelled_accuracy"].items()}
    errors = {int(k): v for k, v in res["criteria"]["labelled_accuracy_standard_error"].items()}
    smooth = {int(k): v for k, v in res["criteria"]["labelled_accuracy_smoothed"].items()}
    # the range: the K whose smoothed score lies within BAND pooled standard errors (the root mean square of the K's
    # standard errors) of the best; every K in it was scored, and the answer is its lower third
    noise = float(np.sqrt(np.mean(np.square(list(errors.values())))))
    assert res["pooled_standard_error"] == pytest.approx(noise, abs=1e-6)
    within = sorted(k for k, v in smooth.items() if v >= max(smooth.values()) - BAND * noise)
    assert res["k_range"] == [within[0], within[-1]] and within == list(range(within[0], within[-1] + 1))
    assert within[0] < 12 < within[-1] and within[(len(within) - 1) // 3] == res["k"]
    assert curve[12] > 0.95 and max(curve.values()) == curve[12]  # the score itself peaks at the true K
    assert set(smooth) == set(curve) and {6, 30} <= set(curve)
    assert str(res["k"]) in res["criteria"]["unlabelled_silhouette"]
    told = {int(k): (float(v), float(e)) for k, v, e in (re.fullmatch(SAID, line).groups() for line in said)}
    assert len(said) == len(told) and set(told) == set(curve)  # each K said once, at 4 decimals
    assert all(abs(told[k][0] - curve[k]) <= 5.1e-5 and abs(told[k][1] - errors[k]) <= 5.1e-5 for k in curve)
    assert res["search"]["subsample"] == SUBSAMPLE and res["search"]["smoothing_width"] == pytest.approx(6 * BANDWIDTH)


def test_real_cub100_features_within_15_percent(realdata, tmp_path, capsys):
    """The issue's check: EfficientNet-Lite0 features of the 100 CUB species, the first 50 known."""
    out = tmp_path / "k.json"
    path = realdata / "features" / "cub100_efflite0_224_feats.npz"
    argv = ["--features", str(path), "--known-classes", "50", "--rule", "score", "--json", str(out)]
    assert cli.main(["estimate-k", *argv]) == 0
    res, said = json.loads(out.read_text()), capsys.readouterr()
    assert res == json.loads(said.out)
    assert 85 <= res["k"] <= 115, res["k"]
    (low, high), best = res["k_range"], res["k_by_argmax"]
    assert (f"K = {res['k']}: plausible K {low}-{high}, within {BAND:g} pooled standard errors of the best smoothed "
            f"score (K = {best}); the lower third is chosen") in said.err  # fmt: skip
    assert res["search"]["k_min"] == 50 and res["search"]["k_max"] == 200


def test_bad_inputs_are_named(tmp_path, capsys):
    x, y = _blobs(4, 10)
    with pytest.raises(ValueError, match="k_max=3 must exceed the 3 known classes"):
        estimate_k(x, y, y < 2, 3, rule="score", k_max=3)
    with pytest.raises(ValueError, match="labelled and unlabelled"):
        estimate_k(x, y, np.ones(len(y), bool), 2)
    np.savez(tmp_path / "f.npz", F=x)
    with pytest.raises(ValueError, match=r"lacks \['y'\]"):
        load_features(str(tmp_path / "f.npz"), 2)
    np.savez(tmp_path / "g.npz", F=x, y=y)
    with pytest.raises(ValueError, match="--known-classes must lie in 1..3"):
        load_features(str(tmp_path / "g.npz"), 4)
    assert cli.main(["estimate-k"]) == 2
    assert "exactly one of --run" in capsys.readouterr().err


def test_the_search_scores_every_k_around_the_plausible_range_and_answers_its_lower_third():
    """A score table by hand, no smoothing (width 0), standard error 0.02 / BAND at every K: K scoring within BAND
    errors of the best (0.90 at K = 12), 0.88 or more, is plausible. The grid scored 4, 12 and 20. Round 1: only 12 is
    plausible, so 10-14 are scored; round 2: 10, 11, 12 and 13 are, so 8-15; round 3: 8 (0.885) joins, so 6 and 7;
    7 scores 0.86: done. Plausible: 8, 10, 11, 12, 13 (9 scores 0.87); the answer is the lower third, index
    (5 - 1) // 3 = 1: K = 10."""
    table = {4: 0.70, 6: 0.80, 7: 0.86, 8: 0.885, 9: 0.87, 10: 0.881, 11: 0.89, 12: 0.90, 13: 0.885, 14: 0.87}
    table |= {15: 0.86, 16: 0.85, 20: 0.80}
    scores = {k: table[k] for k in (4, 12, 20)}
    errors = dict.fromkeys(scores, 0.02 / BAND)
    asked = []

    def score(k):
        asked.append(k)
        scores[k], errors[k] = table[k], 0.02 / BAND

    found = choose_k(scores, errors, score, 4, 20, 0.0)
    assert sorted(asked) == [6, 7, 8, 9, 10, 11, 13, 14, 15]
    assert (found["k"], found["k_range"], found["k_by_argmax"]) == (10, [8, 13], 12)
    assert found["noise"] == pytest.approx(0.02 / BAND) and found["curve"] == scores


def test_a_wide_smoothing_scores_the_range_every_third_of_its_width():
    """Width 15 (50 known classes): the range is filled every 5th K from k_min = 50, two steps beyond it each side,
    and nothing between; the answer is one of the K scored."""
    table = {k: 0.9 - 0.002 * abs(k - 100) for k in range(50, 201)}
    scores = {k: table[k] for k in range(50, 201, 10)}
    errors = dict.fromkeys(scores, 0.005)

    def score(k):
        scores[k], errors[k] = table[k], 0.005

    found = choose_k(scores, errors, score, 50, 200, 15.0)
    low, high = found["k_range"]
    assert all(k % 5 == 0 for k in scores) and found["k"] in scores and low < found["k"] < high
    assert {k for k in range(50, 201, 5) if low - 10 <= k <= high + 10} <= set(scores)


def test_smoothing_keeps_a_line_and_shrinks_a_lone_spike():
    """Local-linear smoothing reproduces a straight line exactly, even on unevenly spaced K. A spike of 0.4 at K = 10 on
    a flat 0.5 over K = 5..15 (width 1, a design symmetric about 10): the fitted line is flat there, so the value is
    the Gaussian-weighted mean, 0.5 + 0.4 / (1 + 2 (e^-1/2 + e^-2 + e^-9/2 + e^-8 + e^-25/2)) = 0.65958."""
    line = {k: 0.2 + 0.01 * k for k in (3, 4, 7, 8, 9, 15, 22)}
    assert smoothed(line, 2.5) == pytest.approx(line, abs=1e-12)
    spike = dict.fromkeys(range(5, 16), 0.5) | {10: 0.9}
    assert smoothed(spike, 1.0)[10] == pytest.approx(0.659577, abs=1e-6)
    assert smoothed(spike, 0.0) == spike
    assert pooled_error({1: 0.03, 2: 0.04}) == pytest.approx(np.sqrt((0.03**2 + 0.04**2) / 2))


def _never(k):
    pytest.fail(f"K={k} was scored again: every K of the range was scored already")


def test_the_rule_on_a_parabola_by_hand():
    """10 known classes, every K of 10..80 scored 0.9 - 0.00035 (K - 40)^2, standard error 0.01 everywhere. Local-
    linear smoothing with Gaussian weights of width s shifts a parabola by the constant -0.00035 s^2 where the weights
    fit inside the K scored (here s = BANDWIDTH x 10, 7.5 K: the shift is 0.0197, 0.0192 at K = 30 and 50), so the
    plausible K are those with 0.00035 (K - 40)^2 <= BAND x 0.01 = 0.04: |K - 40| <= 10.7, K = 30..50 (21 of them),
    and the answer is the lower third, index (21 - 1) // 3 = 6: K = 36. Without smoothing the same K are plausible;
    with the previous band, 3 errors, |K - 40| <= 9.3: 31..49 and K = 37."""
    assert (BANDWIDTH, BAND) == (0.75, 4.0)
    parabola = {k: 0.9 - 0.00035 * (k - 40) ** 2 for k in range(10, 81)}
    found = choose_k(dict(parabola), dict.fromkeys(parabola, 0.01), _never, 10, 80, BANDWIDTH * 10)
    assert (found["k"], found["k_range"], found["k_by_argmax"]) == (36, [30, 50], 40)
    assert found["curve"][40] - parabola[40] == pytest.approx(-0.00035 * 7.5**2, abs=1e-5)
    raw = choose_k(dict(parabola), dict.fromkeys(parabola, 0.01), _never, 10, 80, 0.0)
    assert (raw["k"], raw["k_range"]) == (36, [30, 50])
    previous_band = choose_k(dict(parabola), dict.fromkeys(parabola, 0.01 * 3 / BAND), _never, 10, 80, 0.0)
    assert (previous_band["k"], previous_band["k_range"]) == (37, [31, 49])


def test_a_lone_high_k_does_not_decide_once_smoothed():
    """A tent peaking at K = 25 (0.9, falling 0.01 per K) over 10..40, with a noisy 0.95 at K = 12; standard error
    0.005, so the band is 0.015. Unsmoothed, the spike alone is plausible and chosen; smoothed (width 3), the spike's
    0.95 is averaged with its neighbours' 0.77s and falls out of reach, and the tent, symmetric about 25, gives a
    plausible range symmetric about 25, all of it scored, answered by its lower third."""
    tent = {k: 0.9 - 0.01 * abs(k - 25) for k in range(10, 41)} | {12: 0.95}
    raw = choose_k(dict(tent), dict.fromkeys(tent, 0.005), _never, 10, 40, 0.0)
    assert (raw["k"], raw["k_range"]) == (12, [12, 12])
    found = choose_k(dict(tent), dict.fromkeys(tent, 0.005), _never, 10, 40, 3.0)
    low, high = found["k_range"]
    assert 25 - low == high - 25 > 0 and found["k"] == low + (high - low) // 3 and found["k_by_argmax"] == 25
    assert found["curve"][12] < found["curve"][25] - 0.01


def _result(found: dict, k_min: int) -> dict:
    """`found` (choose_k's answer) as estimate_k returns it, for describe_choice and k_warning."""
    return {**found, "rule": "score", "k_by_score": found["k"], "search": {"k_min": k_min}}


def test_a_lower_third_at_the_known_classes_is_raised_to_the_smallest_plausible_k_above_them():
    """3 known classes, every K of 3..12 scored by hand, no smoothing, standard error 0.02 / BAND: 3 (0.90), 5 (0.885)
    and 6 (0.881) score within BAND errors (0.02) of the best, 4 (0.87) does not. The lower third, index
    (3 - 1) // 3 = 0, is K = 3, no cluster for a new category; the smallest plausible K above 3 is 5 (4 is not
    plausible)."""
    table = {3: 0.90, 4: 0.87, 5: 0.885, 6: 0.881} | {k: 0.86 - 0.01 * k for k in range(7, 13)}
    found = choose_k(dict(table), dict.fromkeys(table, 0.02 / BAND), _never, 3, 12, 0.0)
    assert (found["k"], found["k_lower_third"], found["k_range"], found["k_by_argmax"]) == (5, 3, [3, 6], 3)
    assert describe_choice(_result(found, 3)) == (
        f"plausible K 3-6, within {BAND:g} pooled standard errors of the best smoothed score (K = 3); the lower third, "
        "K = 3, would leave no cluster for new categories, so the smallest plausible K above the 3 known classes is "
        "chosen"
    )
    assert k_warning(_result(found, 3)) is None
    # the same curve searched from 2: the lower third of 3, 5, 6 is 3, above k_min, and is the answer unchanged
    lower = choose_k(dict(table) | {2: 0.5}, dict.fromkeys([2, *table], 0.02 / BAND), _never, 2, 12, 0.0)
    assert (lower["k"], lower["k_lower_third"]) == (3, 3)
    assert describe_choice(_result(lower, 2)).endswith("(K = 3); the lower third is chosen")


def test_only_the_known_classes_plausible_keeps_k_and_warns():
    """K = 4 scores 0.95, every larger K 0.90 or less (error 0.01, band 0.03): only the 4 known classes are plausible,
    no larger K to raise the answer to, so it stays 4 and the warning says no cluster is left and how to set K."""
    table = {4: 0.95} | {k: 0.90 - 0.02 * (k - 5) for k in range(5, 17)}
    found = choose_k(dict(table), dict.fromkeys(table, 0.01), _never, 4, 16, 0.0)
    assert (found["k"], found["k_lower_third"], found["k_range"]) == (4, 4, [4, 4])
    assert describe_choice(_result(found, 4)).endswith("the lower third is chosen")
    assert k_warning(_result(found, 4)) == (
        "K = 4 is the number of known classes, so no cluster is left for new categories (no larger K scores as "
        "well): if the unlabelled images hold new categories, set kmeans.n_clusters to the number you expect, above 4"
    )


def test_new_classes_that_look_like_known_ones_give_the_known_number_with_a_warning(tmp_path, capsys):
    """Two blobs 10 spreads apart; classes 2 and 3 are drawn from the same blobs as the known 0 and 1. The features
    hold 2 clusters, so K = 2 scores 1.0 and splitting a blob costs labelled accuracy: the answer is 2, and the
    command warns that no cluster is left for new categories."""
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(4), 30)
    np.savez(tmp_path / "f.npz", F=np.eye(2, 8)[y % 2] * 10 + rng.normal(size=(len(y), 8)), y=y)
    assert (
        cli.main(["estimate-k", "--features", str(tmp_path / "f.npz"), "--known-classes", "2", "--rule", "score"]) == 0
    )
    said = capsys.readouterr()
    res = json.loads(said.out)
    assert (res["k"], res["k_range"], res["k_lower_third"]) == (2, [2, 2], 2)
    assert res["criteria"]["labelled_accuracy"]["2"] == 1.0 and max(res["criteria"]["labelled_accuracy"].values()) == 1
    assert "\nWARNING: no new category was found: K = 2, the known classes" in said.err
    assert res["novelty"]["new"] is False and res["k_by_score"] == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_pool_of_only_known_classes_says_nothing_new(seed):
    """6 blobs, all 6 known, half of each labelled: the pool holds nothing new. The score alone answers 7 (the
    issue's case: a few extra clusters score as well, and the rule raises a lower third of 6 above the known
    classes); the pool's points lie as near the known classes as the labelled ones do, so K = 6."""
    x, y = _blobs(6, 40, seed=seed)
    labelled, _ = gcd_split(y, list(range(6)), 0.5, 0)
    res = estimate_k(x, y, labelled, 6, rule="score", k_max=24, silhouette=False)
    assert res["k"] == 6 and res["k_by_score"] > 6 and not res["novelty"]["new"]
    assert res["novelty"]["z"] < Z_NEW and describe_choice(res).endswith("nothing new, K = the known classes")
    assert k_warning(res).startswith("no new category was found: K = 6, the known classes")
    without_test = estimate_k(x, y, labelled, 6, rule="score", k_max=24, silhouette=False, novelty_test=False)
    assert without_test["k"] == res["k_by_score"]


def test_one_new_class_in_the_pool_is_seen():
    """The same 6 known blobs and a 7th, novel, in the pool: the pool lies farther from the known classes than the
    labelled points (z far above the threshold) and K = 7; with 12 blobs, 6 novel, K = 12 (the test above's)."""
    x, y = _blobs(7, 40)
    labelled, _ = gcd_split(y, list(range(6)), 0.5, 0)
    res = estimate_k(x, y, labelled, 6, rule="score", k_max=24, silhouette=False)
    assert res["novelty"]["new"] and res["novelty"]["z"] > 2 * Z_NEW and res["k"] == res["k_by_score"] == 7
    assert k_warning(res) is None


def test_a_pool_smaller_than_k_skips_the_silhouette_with_a_note():
    """3 known classes of 4 labelled points each and a pool of 4 (two new classes of 2): the search reaches K = 8
    (half the 16 points), but the silhouette of 4 pool points needs fewer than 4 clusters, so only K = 3 has one;
    the others are said to be skipped, and the answer follows the rule from its own curves."""
    rng = np.random.default_rng(0)
    y = np.array([0] * 4 + [1] * 4 + [2] * 4 + [3, 3, 4, 4])
    said = []
    feats = np.eye(8)[y] * 8 + rng.normal(size=(16, 8))
    res = estimate_k(feats, y, np.arange(16) < 12, 3, rule="score", progress=said.append)
    assert res["search"]["k_max"] == 8 and list(res["criteria"]["unlabelled_silhouette"]) == ["3"]
    assert res["k_by_silhouette"] == 3
    assert "silhouette skipped for K >= 4: it needs fewer clusters than the 4 unlabelled points" in said
    smooth = {int(k): v for k, v in res["criteria"]["labelled_accuracy_smoothed"].items()}
    plausible = sorted(k for k, v in smooth.items() if v >= max(smooth.values()) - BAND * res["pooled_standard_error"])
    third = plausible[(len(plausible) - 1) // 3]
    assert res["k_lower_third"] == third
    assert res["k"] == (min(k for k in plausible if k > 3) if third == 3 and plausible[-1] > 3 else third)


def test_too_few_known_classes_or_points_are_refused():
    x, y = _blobs(4, 10)
    with pytest.raises(ValueError, match="estimating K needs at least 2 known classes, got 1: .* give K as a number"):
        estimate_k(x, y, y < 1, 1)
    with pytest.raises(ValueError, match=r"^6 points are too few to estimate K: .* half the points, 3, which is not "):
        estimate_k(x[:6], np.arange(6) % 4, np.arange(6) < 2, 3, rule="score")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--features", "nope.npz", "--known-classes", "5"],
         "error: --features nope.npz: no such file; pass an .npz with F [N, D] and y [N]\n"),
        (["--run", "RUN", "--known-classes", "3"],
         "error: --known-classes goes with --features; a run knows its known classes: drop --known-classes\n"),
        (["--features", "f.npz", "--known-classes", "1"],
         "error: --known-classes 1: estimating K needs at least 2 known classes (with one, K = 1 always scores best): "
         "pass --known-classes 2 or more\n"),
    ],
)  # fmt: skip
def test_the_command_line_names_the_bad_argument(argv, said, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    x, y = _blobs(4, 10)
    np.savez(tmp_path / "f.npz", F=x, y=y)
    assert cli.main(["estimate-k", *argv]) == 2
    assert capsys.readouterr().err == said


def test_the_novelty_statistic_by_hand():
    """Labelled: class 0 at 0, 0.1, 0.2 and class 1 at 10, 10.1, 10.2 on a line (1-d, not normalised here). Leave-one-
    out distances to the own mean: 0.15, 0, 0.15 per class; the 0.8 quantile of (0.15, 0, 0.15, 0.15, 0, 0.15) is
    0.15. Pool: 0.1 and 10.1 (distance 0 from a mean) and 5 and 20 (4.9, 9.9): half beyond, excess 0.5 - 0.2 = 0.3
    in standard errors sqrt(0.8 x 0.2 / 4) = 0.2: z = 1.5."""
    x = torch.tensor([[0.0], [0.1], [0.2], [10.0], [10.1], [10.2], [0.1], [10.1], [5.0], [20.0]], dtype=torch.float64)
    targets = np.asarray([0, 0, 0, 1, 1, 1, -1, -1, -1, -1])
    res = pool_novelty(x, targets, targets >= 0, 2)
    assert res["beyond"] == 0.5 and res["z"] == pytest.approx(1.5) and not res["new"]


def test_no_k_scoring_above_the_known_classes_with_something_new_warns_that_k_is_a_lower_bound():
    """3 known blobs 10 apart; 3 novel blobs, each 3 spreads from a known one along a dimension of its own. The pool
    holds something new (the novelty test's z is far above its threshold), but k-means keeps each known class whole
    only at K = 3, so no K scores above it: the answer (the smallest plausible K above the known classes) is below the
    true 6, and the warning calls it a lower bound. The test above (one novel blob apart from the known ones, which
    scores best at 7) gets none."""
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(6), 40)
    shift = np.zeros((len(y), 16))
    shift[y >= 3, 5] = 3.0
    x = np.eye(3, 16)[y % 3] * 10 + shift + rng.normal(size=(len(y), 16))
    labelled, _ = gcd_split(y, [0, 1, 2], 0.5, 0)
    res = estimate_k(x, y, np.asarray(labelled, bool), 3, rule="score", silhouette=False)
    scores = res["criteria"]["labelled_accuracy"]
    assert res["novelty"]["new"] and res["novelty"]["z"] > 2 * Z_NEW and 3 < res["k"] < 6
    assert scores["3"] == max(scores.values()) == 1.0
    assert k_warning(res) == (
        f"no K scores better than the 3 known classes, yet the unlabelled images hold something new (novelty z = "
        f"{res['novelty']['z']:.1f}): clusters for the new categories do not raise the known classes' accuracy in "
        f"these features, so the score cannot count them; K = {res['k']} is a lower bound, not a count: set "
        "kmeans.n_clusters to the number you expect, or estimate again with the neighbours rule (--rule neighbours) "
        "or on a trained run's features (infosieve estimate-k --run)"
    )
    assert k_warning({**res, "novelty": None}) is None  # no novelty test: nothing says the pool holds more
    better = {**scores, "5": 1.0 + 1e-6}  # one K scoring above the known classes: the score can count them
    assert k_warning({**res, "criteria": {**res["criteria"], "labelled_accuracy": better}}) is None
