"""What the codes hold (`infosieve_fast.evaluation.code_metrics`): hand-computed prefixes, purity, NMI and code lengths,
and the measures as `train.eval_every`, `infosieve eval` and `infosieve tree` report them."""

import json
import math

import pytest
import torch

from infosieve_fast import cli
from infosieve_fast.evaluation.code_metrics import code_lengths, code_measures, nmi, prefix_ids, purity
from infosieve_fast.evaluation.tree import code_strings

# the rows of test_tree.py: codes "10", "0010", "" (row 0 is cut at index 2, row 2 at index 0)
CODE_RAW = torch.tensor([[0.9, -0.8, 0.7, 0.6], [-0.5, -0.9, 0.1, -0.2], [0.3, 0.3, -0.3, 0.3]])
MASK = torch.tensor([[1.0, 0.9, 0.2, 0.9], [0.8, 0.7, 0.6, 0.5], [0.1, 1.0, 1.0, 1.0]])


def test_code_lengths_stop_at_the_first_switched_off_digit():
    assert code_lengths(MASK).tolist() == [2, 4, 0]
    assert code_lengths(MASK, threshold=0.75).tolist() == [2, 1, 0]  # row 1: 0.7 < 0.75 at index 1


def test_prefix_ids_are_the_tree_nodes_at_each_depth():
    # codes "10", "0010", "": depth 1 -> "1", "0", "" (3 nodes); depth 0 -> the root only
    assert prefix_ids(CODE_RAW, MASK, 0).tolist() == [0, 0, 0]
    for depth in (1, 2, 3, 4, 9):
        ids = prefix_ids(CODE_RAW, MASK, depth).tolist()
        assert len(set(ids)) == 3 and ids[0] != ids[1] != ids[2] != ids[0]
    # a prefix and a longer code that starts with it are different nodes: "1" (cut) vs "10..." (not cut)
    raw = torch.tensor([[1.0, -1.0], [1.0, 1.0], [1.0, 1.0], [-1.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    assert prefix_ids(raw, mask, 1).tolist() == [1, 1, 1, 0]  # "1", "1", "1", "0": sorted by key, "0" first
    ids = prefix_ids(raw, mask, 2).tolist()  # "1", "11", "11", "01"
    assert ids[1] == ids[2] and len({ids[0], ids[1], ids[3]}) == 3


def test_prefix_ids_match_code_strings_on_random_codes():
    g = torch.Generator().manual_seed(0)
    raw, mask = torch.randn(200, 12, generator=g), torch.rand(200, 12, generator=g) + 0.45
    strings = code_strings(raw, mask)
    for depth in (0, 3, 8, 12, 20):
        ids = prefix_ids(raw, mask, depth).tolist()
        pairs = {(s[:depth], i) for s, i in zip(strings, ids, strict=True)}
        assert len(pairs) == len({s[:depth] for s in strings}) == len(set(ids))  # the same partition


def test_purity_by_hand():
    # groups {0: a a b}, {1: c c}, {2: c}: majorities 2 + 2 + 1 of 6
    assert purity([0, 0, 0, 1, 1, 2], [7, 7, 3, 5, 5, 5]) == pytest.approx(5 / 6)
    assert purity([4, 4, 4], [1, 2, 3]) == pytest.approx(1 / 3)
    assert purity([], []) == 0.0


def test_nmi_by_hand():
    assert nmi([0, 0, 1, 1], [5, 5, 9, 9]) == pytest.approx(1.0)  # the same partition, other names
    assert nmi([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(0.0, abs=1e-12)  # independent
    assert nmi([3, 3, 3], [1, 1, 1]) == 1.0 and nmi([3, 3, 3], [1, 2, 2]) == 0.0  # single groups
    # groups {0,0,1,1} vs classes {0,0,0,1}: p(g) = (1/2, 1/2), p(y) = (3/4, 1/4), p(g,y) = (1/2, 0; 1/4, 1/4)
    mi = 0.5 * math.log(0.5 / (0.5 * 0.75)) + 0.25 * math.log(0.25 / (0.5 * 0.75)) + 0.25 * math.log(0.25 / 0.125)
    h_g, h_y = math.log(2), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert nmi([0, 0, 1, 1], [0, 0, 0, 1]) == pytest.approx(mi / ((h_g + h_y) / 2), rel=1e-12)


def test_code_measures_by_hand():
    # codes "10", "0010", "", "11" with classes 0, 1, 0, 0
    raw = torch.cat([CODE_RAW, torch.tensor([[1.0, 1.0, 1.0, 1.0]])])
    mask = torch.cat([MASK, torch.tensor([[1.0, 1.0, 0.0, 1.0]])])
    m = code_measures(raw, mask, torch.tensor([0, 1, 0, 0]), depths=(1, 2))
    # depth 1: "1" {0, 0}, "0" {1}, "" {0} -> 3 prefixes, all pure; depth 2: "10", "00", "", "11" -> 4, pure
    assert (m["prefixes_1"], m["purity_1"], m["prefixes_2"], m["purity_2"]) == (3, 1.0, 4, 1.0)
    assert m["nmi_1"] == pytest.approx(nmi([0, 1, 2, 0], [0, 1, 0, 0]))
    assert m["mean_length"] == pytest.approx((2 + 4 + 0 + 2) / 4)


def test_eval_every_eval_and_tree_report_the_code_measures(tmp_path, capsys):
    from infosieve_fast.training.run_folder import train
    from tests.test_engine import smoke_config

    run = tmp_path / "run"
    train(smoke_config("schedule.epochs=1", "train.eval_every=1"), run)
    logged = json.loads((run / "log.jsonl").read_text().splitlines()[-1])["eval_codes"]
    keys = {"all", "old", "new", "mean_length"}
    keys |= {f"{k}_{d}" for k in ("prefixes", "purity", "nmi") for d in (4, 8, 16)}
    assert set(logged) == keys
    assert logged["prefixes_4"] <= logged["prefixes_8"] <= logged["prefixes_16"]
    assert 0 <= logged["mean_length"] <= 40
    # recounted from the checkpoint's codes with the tree's own prefix strings (tree.code_strings), not prefix_ids
    from collections import Counter

    from infosieve_fast.analysis.run_reader import trainer_from_run
    from infosieve_fast.evaluation.code_metrics import code_features

    fs = code_features(trainer_from_run(run).evaluator)
    unl = ~fs.labelled
    strings = code_strings(fs.feats[unl, :40], fs.feats[unl, 40:])
    nodes = Counter((s[:4], int(y)) for s, y in zip(strings, fs.targets[unl].tolist(), strict=True))
    assert logged["prefixes_4"] == len({node for node, _ in nodes})
    majority = Counter()
    for (node, _), count in nodes.items():
        majority[node] = max(majority[node], count)
    assert logged["purity_4"] == pytest.approx(sum(majority.values()) / int(unl.sum()))
    capsys.readouterr()
    assert cli.main(["tree", "--run", str(run), "--depth", "2"]) == 0
    tree = json.loads((run / "tree.json").read_text())
    assert tree["measures"] == pytest.approx(logged)  # the same checkpoint, the same deterministic evaluation
    assert f"depth  8: {logged['prefixes_8']:>6} prefixes" in capsys.readouterr().out
    assert cli.main(["eval", "--run", str(run)]) == 0
    assert f"codes: SS-k-means All {logged['all']:.4f}" in capsys.readouterr().out
