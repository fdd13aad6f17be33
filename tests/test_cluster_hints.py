"""The hints beside a novel cluster: its nearest known classes by centre distance (always), and its place in the code
tree only where the codes carry the classes (`code_separation.py`); the one line that says when they do not."""

from __future__ import annotations

import numpy as np
import pytest

from infosieve_fast.analysis.cluster_places import place_clusters, place_text
from infosieve_fast.common.labels import NO_LABEL
from infosieve_fast.evaluation.code_separation import CARRY, code_separation, prefix_purity, separation_text


def test_prefix_purity_is_the_majority_share_of_each_prefix():
    # by hand: prefix 0 holds classes 0, 0, 1 (majority 2), prefix 1 holds 1, 2 (majority 1): (2 + 1) / 5
    assert prefix_purity(np.asarray([0, 0, 0, 1, 1]), np.asarray([0, 0, 1, 1, 2])) == pytest.approx(3 / 5)


def test_one_code_for_every_image_does_not_carry_the_classes():
    """The issue's case: after one epoch every image had the same code (purity 0.20 for 5 classes)."""
    codes = {u: "0100110100101100" for u in range(50)}
    targets = {u: u % 5 for u in range(50)} | {50: NO_LABEL}
    sep = code_separation(codes, targets)
    assert sep["images"] == 50 and sep["purity"] == pytest.approx(0.2) and sep["chance"] == pytest.approx(0.2)
    assert not sep["carries"]
    text = separation_text(sep)
    assert "not separated the classes yet" in text and "0.20 pure" in text and "12 epochs" in text


def test_codes_that_split_the_classes_carry_them_and_chance_is_that_of_shuffled_labels():
    # two classes, two images each, each class under its own depth-8 prefix: purity 1. Chance by hand: of the 6 equally
    # likely arrangements of the labels 0, 0, 1, 1 over the two prefixes, 2 keep both prefixes pure (purity 1) and 4
    # mix them (purity 1/2): 2/3. 20 shuffles estimate it with standard deviation ~0.05.
    codes = {0: "00000000", 1: "00000000", 2: "11111111", 3: "11111111"}
    sep = code_separation(codes, {0: 0, 1: 0, 2: 1, 3: 1})
    assert sep["purity"] == 1 and sep["chance"] == pytest.approx(2 / 3, abs=0.15) and sep["carries"]
    assert "carry the classes" in separation_text(sep)
    # the digits after the 8th do not count: the same codes with tails that differ per image
    tails = {u: c + f"{u:02b}" for u, c in codes.items()}
    assert code_separation(tails, {0: 0, 1: 0, 2: 1, 3: 1})["purity"] == 1


def test_prefixes_of_one_image_each_do_not_carry_the_classes():
    """Purity 1 by size alone: chance is 1 too, so nothing is shown."""
    codes = {u: f"{u:08b}" for u in range(12)}
    sep = code_separation(codes, {u: u % 3 for u in range(12)})
    assert sep["purity"] == 1 and sep["chance"] == 1 and not sep["carries"]


def test_the_rule_sits_a_quarter_of_the_way_from_chance():
    """Two prefixes of 200 images, two classes of 200. Chance: under shuffled labels a prefix holds 100 +- 7 of a
    class (hypergeometric), so its majority is about 105.6 and chance about 0.53; a quarter of the way to 1 is about
    0.65. A split of 120/80 in each prefix (purity 0.60) is above chance but not that far; 140/60 (0.70) is."""
    assert CARRY == 0.25

    def split(major: int) -> dict:
        codes = {u: ("0" if u < 200 else "1") * 8 for u in range(400)}
        labels = {u: int((u % 200 < major) == (u < 200)) for u in range(400)}
        return code_separation(codes, labels)

    below, above = split(120), split(140)
    assert below["purity"] == pytest.approx(0.60) and above["purity"] == pytest.approx(0.70)
    assert below["chance"] == pytest.approx(0.53, abs=0.02) and above["chance"] == pytest.approx(0.53, abs=0.02)
    assert not below["carries"] and above["carries"]
    # one prefix for all: purity = chance = the larger class's share
    same = code_separation({u: "0" * 8 for u in range(40)}, {u: int(u < 10) for u in range(40)})
    assert same["purity"] == same["chance"] == 0.75 and not same["carries"]


def test_fewer_than_two_labelled_classes_say_so():
    sep = code_separation({0: "0", 1: "1"}, {0: 3, 1: NO_LABEL})
    assert sep["purity"] is None and not sep["carries"] and "two classes" in separation_text(sep)


CODES = {0: "000", 1: "001", 2: "110", 3: "111", 4: "011", 5: "011", 6: "010", 7: "10", 8: "010", 9: "100"}
TARGETS = {0: 0, 1: 0, 2: 1, 3: 1, 4: NO_LABEL, 5: NO_LABEL, 6: NO_LABEL, 7: NO_LABEL, 8: 2, 9: 2}
CLUSTERING = {"uq": np.arange(4, 8), "targets": np.full(4, NO_LABEL), "preds": np.asarray([3, 3, 3, 4]), "n_old": 3}
# gull, tern, owl, then the novel clusters 3, 4 and 5 (5 has no image)
CENTERS = np.asarray([[0, 0], [1, 0], [0, 3], [0.9, 0.2], [0, 2], [5, 5]], np.float32)


def test_nearest_known_by_centre_distance_always_and_the_tree_place_only_where_the_codes_carry():
    places = place_clusters(CODES, TARGETS, CLUSTERING, ["gull", "tern", "owl"], CENTERS, {4: "Blue Jay"}, 3, False)
    # by hand: cluster 3 at (0.9, 0.2) lies sqrt(0.05) = 0.2236 from tern, sqrt(0.85) = 0.9220 from gull and
    # sqrt(8.65) = 2.9411 from owl; cluster 4 at (0, 2) lies 1 from owl, 2 from gull, sqrt(5) = 2.2361 from tern
    assert places == [
        {"cluster": 3, "name": "novel-3", "size": 3, "nearest_known": ["tern", "gull", "owl"],
         "centre_distances": [0.2236, 0.922, 2.9411]},
        {"cluster": 4, "name": "Blue Jay", "size": 1, "nearest_known": ["owl", "gull", "tern"],
         "centre_distances": [1.0, 2.0, 2.2361]},
    ]  # fmt: skip
    assert place_text(places[1]) == "Blue Jay (novel-4): 1 pool images; nearest known (feature centres): owl 1.00, " \
        "gull 2.00, tern 2.24"  # fmt: skip
    carried = place_clusters(CODES, TARGETS, CLUSTERING, ["gull", "tern", "owl"], CENTERS, {4: "Blue Jay"}, 3, True)
    # the tree place by hand (majority prefixes): gull at "00", tern at "11", owl {010, 100} at "" (no majority).
    # Cluster 3 {011, 011, 010} sits at "011" (2 of 3): 1 digit shared with gull, 0 with tern and owl, none of whose
    # images is under "011" (tern first by index). Cluster 4 {10} sits at "10": 1 digit shared with tern, 0 with gull
    # and owl; half of owl's images are under "10", none of gull's, so owl comes before gull.
    assert [(p["prefix"], p["tree_nearest_known"], p["shared_digits"]) for p in carried] == [
        ("011", ["gull", "tern", "owl"], 1),
        ("10", ["tern", "owl", "gull"], 1),
    ]
    assert [{k: p[k] for k in places[0]} for p in carried] == places  # the feature hints are the same either way
    assert place_text(carried[0]).endswith("; prefix 011, nearest in the tree: gull, tern, owl (1 shared digits)")


def test_every_option_of_every_command_has_help_text():
    import argparse

    from infosieve_fast.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {'/'.join(a.option_strings) or a.dest}"
        for name, parser in sub.choices.items()
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()
    ]
    assert missing == []
    make_shards = sub.choices["make-shards"].format_help()
    assert "labelled/<class>/" in make_shards and "unlabelled/" in make_shards  # --root's own-images layout
