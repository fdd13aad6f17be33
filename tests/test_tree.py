import pytest
import torch

from infosieve_fast.evaluation.tree import build_tree, code_strings, format_tree


def test_code_strings_cut_at_the_first_switched_off_digit():
    code_raw = torch.tensor([[0.9, -0.8, 0.7, 0.6], [-0.5, -0.9, 0.1, -0.2], [0.3, 0.3, -0.3, 0.3]])
    mask = torch.tensor([[1.0, 0.9, 0.2, 0.9], [0.8, 0.7, 0.6, 0.5], [0.1, 1.0, 1.0, 1.0]])
    # row 0: digits 1,0 then the mask switches off at index 2 (a later "on" digit does not count)
    # row 1: every mask >= 0.5, all four digits; row 2: off at index 0, the empty code (the root)
    assert code_strings(code_raw, mask) == ["10", "0010", ""]


def test_tree_counts_prefixes_ends_and_purity():
    codes = ["10", "0010", "", "11", "101", "0"]
    targets = [1, 0, 2, 1, 1, 0]
    tree = build_tree(codes, targets, max_depth=2)
    assert (tree["prefix"], tree["n"], tree["ends"]) == ("", 6, 1)
    assert tree["classes"] == {0: 2, 1: 3, 2: 1} and tree["purity"] == pytest.approx(0.5)
    zero, one = tree["children"]
    assert (zero["prefix"], zero["n"], zero["ends"], zero["classes"]) == ("0", 2, 1, {0: 2})
    assert (one["prefix"], one["n"], one["ends"], one["classes"]) == ("1", 3, 0, {1: 3})
    # at max_depth every member ends there, whatever its full length
    assert [(c["prefix"], c["n"], c["ends"]) for c in one["children"]] == [("10", 2, 2), ("11", 1, 1)]
    assert [c["prefix"] for c in zero["children"]] == ["00"]
    assert zero["children"][0]["children"] == []
    text = format_tree(tree, class_names=["zero", "one", "two"])
    assert text.splitlines()[1] == "  0  n=2  ends=1  top=zero (1.00)"


def test_bad_inputs():
    with pytest.raises(ValueError, match="must both be"):
        code_strings(torch.zeros(3, 4), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="2 codes but 1 targets"):
        build_tree(["0", "1"], [0], max_depth=1)
