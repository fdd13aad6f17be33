"""Tests for infosieve_fast.evaluation.metrics (docs/reference.md §6).

Hand-made cases carry their answers worked out in comments; property tests compare against a slow, loop-by-loop
transcription of the reference pseudo-code written here independently of the module.
"""

import json
import math

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from infosieve_fast.evaluation.metrics import (
    PROTOCOLS,
    cluster_acc,
    evaluate_split,
    split_cluster_acc_v1,
    split_cluster_acc_v2,
    split_cluster_acc_v2b,
)

# ----------------------------------------------------------------------------------------------------------------------
# slow oracle: the reference pseudo-code, loops and dicts, as GCD/SimGCD write it


def slow_confusion(y_true, y_pred):
    D = max(max(y_pred), max(y_true)) + 1
    w = np.zeros((D, D), dtype=int)
    for i in range(len(y_pred)):
        w[y_pred[i], y_true[i]] += 1
    return w


def slow_cluster_acc(y_true, y_pred):
    w = slow_confusion(y_true, y_pred)
    r, c = linear_sum_assignment(w.max() - w)
    return sum(w[i, j] for i, j in zip(r, c, strict=True)) * 1.0 / len(y_pred)


def slow_v1(y_true, y_pred, mask):
    old_t = [t for t, m in zip(y_true, mask, strict=True) if m]
    old_p = [p for p, m in zip(y_pred, mask, strict=True) if m]
    new_t = [t for t, m in zip(y_true, mask, strict=True) if not m]
    new_p = [p for p, m in zip(y_pred, mask, strict=True) if not m]
    weight = sum(mask) / len(mask)
    old = slow_cluster_acc(old_t, old_p)
    new = slow_cluster_acc(new_t, new_p)
    return weight * old + (1 - weight) * new, old, new


def _slow_v2_common(y_true, y_pred, mask):
    w = slow_confusion(y_true, y_pred)
    r, c = linear_sum_assignment(w.max() - w)
    ind_map = {j: i for i, j in zip(r, c, strict=True)}  # true class -> cluster
    old_classes = {t for t, m in zip(y_true, mask, strict=True) if m}
    new_classes = {t for t, m in zip(y_true, mask, strict=True) if not m}
    total = sum(w[i, j] for i, j in zip(r, c, strict=True)) * 1.0 / len(y_pred)
    return w, ind_map, old_classes, new_classes, total


def slow_v2(y_true, y_pred, mask):
    w, ind_map, old_classes, new_classes, total = _slow_v2_common(y_true, y_pred, mask)
    old_acc, old_n = 0, 0
    for t in old_classes:
        old_acc += w[ind_map[t], t]
        old_n += sum(w[:, t])
    new_acc, new_n = 0, 0
    for t in new_classes:
        new_acc += w[ind_map[t], t]
        new_n += sum(w[:, t])
    return total, old_acc / old_n, new_acc / new_n


def slow_v2b(y_true, y_pred, mask):
    w, ind_map, old_classes, new_classes, _ = _slow_v2_common(y_true, y_pred, mask)
    old_list = [w[ind_map[t], t] / sum(w[:, t]) for t in old_classes]
    new_list = [w[ind_map[t], t] / sum(w[:, t]) for t in new_classes]
    both = old_list + new_list
    return sum(both) / len(both), sum(old_list) / len(old_list), sum(new_list) / len(new_list)


SLOW = {"v1": slow_v1, "v2": slow_v2, "v2b": slow_v2b}
FAST = {"v1": split_cluster_acc_v1, "v2": split_cluster_acc_v2, "v2b": split_cluster_acc_v2b}


def close(a, b):
    return math.isclose(a, b, rel_tol=0, abs_tol=1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# hand-made cases

# Case A: D > K, cluster ids 1 and 2 never predicted (class ids 1, 2 exist), clusters 3, 4 beyond the classes.
#   y_true = 0 0 0 0 | 1 1 1 | 2 2 2      Old = {0, 1} (first 7), New = {2}
#   y_pred = 3 3 3 0 | 4 4 3 | 0 0 4
#   D = max(4, 2) + 1 = 5; w[pred, true]: w[3,0]=3 w[0,0]=1 | w[4,1]=2 w[3,1]=1 | w[0,2]=2 w[4,2]=1
#   Each class's best cluster is distinct (0->3: 3, 1->4: 2, 2->0: 2), so the optimum 7 is unique on real classes.
#   cluster_acc = 7/10.
#   v2: All = 7/10; Old = (3+2)/(4+3) = 5/7; New = 2/3.
#   v2b: per class 3/4, 2/3, 2/3 -> Old = (3/4 + 2/3)/2 = 17/24; New = 2/3; All = (3/4 + 2/3 + 2/3)/3 = 25/36.
#   v1: Old subset best 0->3 (3) + 1->4 (2) = 5/7; New subset [2,2,2] vs [0,0,4] best 2->0 = 2/3;
#       All = 0.7 * 5/7 + 0.3 * 2/3 = 0.5 + 0.2 = 0.7.
A_TRUE = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
A_PRED = [3, 3, 3, 0, 4, 4, 3, 0, 0, 4]
A_MASK = [True] * 7 + [False] * 3


def test_case_a_cluster_acc():
    assert close(cluster_acc(A_TRUE, A_PRED), 7 / 10)


def test_case_a_v2():
    a = split_cluster_acc_v2(A_TRUE, A_PRED, A_MASK)
    assert close(a.all, 7 / 10) and close(a.old, 5 / 7) and close(a.new, 2 / 3)


def test_case_a_v2b():
    a = split_cluster_acc_v2b(A_TRUE, A_PRED, A_MASK)
    assert close(a.all, 25 / 36) and close(a.old, 17 / 24) and close(a.new, 2 / 3)


def test_case_a_v1():
    a = split_cluster_acc_v1(A_TRUE, A_PRED, A_MASK)
    assert close(a.all, 0.7) and close(a.old, 5 / 7) and close(a.new, 2 / 3)


# Case B: v1, v2 and v2b all differ. Everything is put in cluster 0.
#   y_true = 0 0 0 | 1 1, Old = {0}, New = {1}; y_pred = 0 0 0 0 0
#   v1: Old subset all class 0 in cluster 0 -> 1.0; New subset all class 1 in cluster 0, matched 0->1 -> 1.0;
#       All = 0.6 * 1 + 0.4 * 1 = 1.0 (each subset gets cluster 0 for itself).
#   v2: w = [[3, 2], [0, 0]]; best: 0->0 (3) + 1->1 (0) = 3 -> All = 3/5, Old = 3/3 = 1, New = 0/2 = 0.
#   v2b: per class 1, 0 -> Old 1, New 0, All = (1 + 0)/2 = 0.5.
B_TRUE = [0, 0, 0, 1, 1]
B_PRED = [0, 0, 0, 0, 0]
B_MASK = [True, True, True, False, False]


def test_case_b_protocols_differ():
    assert split_cluster_acc_v1(B_TRUE, B_PRED, B_MASK) == (1.0, 1.0, 1.0)
    v2 = split_cluster_acc_v2(B_TRUE, B_PRED, B_MASK)
    assert close(v2.all, 3 / 5) and v2.old == 1.0 and v2.new == 0.0
    assert tuple(split_cluster_acc_v2b(B_TRUE, B_PRED, B_MASK)) == (0.5, 1.0, 0.0)


# Case C: permuted-perfect clustering: cluster ids are a relabelling of the classes -> 1.0 everywhere.
#   y_true = 0 0 1 1 2 2 3, y_pred = 2 2 0 0 3 3 1 (0->2, 1->0, 2->3, 3->1), Old = {0, 1}.
C_TRUE = [0, 0, 1, 1, 2, 2, 3]
C_PRED = [2, 2, 0, 0, 3, 3, 1]
C_MASK = [True, True, True, True, False, False, False]


@pytest.mark.parametrize("protocol", ["v1", "v2", "v2b"])
def test_case_c_permuted_perfect(protocol):
    assert cluster_acc(C_TRUE, C_PRED) == 1.0
    assert evaluate_split(C_TRUE, C_PRED, C_MASK, protocol) == {"all": 1.0, "old": 1.0, "new": 1.0}


# Case D: fewer clusters than classes (D taken from y_true) and a split cluster.
#   y_true = 0 0 1 1 2 2, y_pred = 0 0 0 1 1 1, Old = {0, 1}, New = {2}
#   w[0,0]=2 w[0,1]=1 w[1,1]=1 w[1,2]=2; D = 3.
#   Best: 0->0 (2) + 2->1 (2) + 1->2 (0) = 4 (0->0 + 1->1 would give only 3) -> cluster_acc = v2 All = 4/6.
#   v2: Old = (2 + 0)/4 = 1/2, New = 2/2 = 1.  v2b: Old = (1 + 0)/2 = 1/2, New = 1, All = (1 + 0 + 1)/3 = 2/3.
D_TRUE = [0, 0, 1, 1, 2, 2]
D_PRED = [0, 0, 0, 1, 1, 1]
D_MASK = [True, True, True, True, False, False]


def test_case_d_fewer_clusters():
    assert close(cluster_acc(D_TRUE, D_PRED), 4 / 6)
    v2 = split_cluster_acc_v2(D_TRUE, D_PRED, D_MASK)
    assert close(v2.all, 4 / 6) and v2.old == 0.5 and v2.new == 1.0
    v2b = split_cluster_acc_v2b(D_TRUE, D_PRED, D_MASK)
    assert close(v2b.all, 2 / 3) and v2b.old == 0.5 and v2b.new == 1.0


# ----------------------------------------------------------------------------------------------------------------------
# empty subsets, input types, errors


@pytest.mark.parametrize("protocol", ["v1", "v2", "v2b"])
def test_empty_new_subset_is_zero_and_all_unaffected(protocol):
    # mask all True: only Old samples (case A's labels); New is defined as 0.0, All is the Old value.
    out = evaluate_split(A_TRUE, A_PRED, [True] * 10, protocol)
    assert out["new"] == 0.0
    assert close(out["all"], out["old"])
    if protocol != "v2b":
        assert close(out["all"], 7 / 10)  # the same single matching as cluster_acc
    json.dumps(out, allow_nan=False)


@pytest.mark.parametrize("protocol", ["v1", "v2", "v2b"])
def test_empty_old_subset_is_zero(protocol):
    out = evaluate_split(B_TRUE, B_PRED, [False] * 5, protocol)
    assert out["old"] == 0.0
    assert close(out["all"], out["new"])
    assert close(out["all"], {"v1": 3 / 5, "v2": 3 / 5, "v2b": 0.5}[protocol])


@pytest.mark.parametrize("protocol", ["v1", "v2", "v2b"])
def test_empty_input(protocol):
    assert cluster_acc([], []) == 0.0
    assert evaluate_split(np.array([], dtype=int), np.array([], dtype=int), np.array([], dtype=bool), protocol) == {
        "all": 0.0,
        "old": 0.0,
        "new": 0.0,
    }


def test_torch_inputs_match_numpy(device):
    rng = np.random.default_rng(7)
    t = rng.integers(0, 6, 200)
    p = rng.integers(0, 9, 200)
    m = t < 3
    for name, fn in FAST.items():
        want = fn(t, p, m)
        got = fn(torch.from_numpy(t).to(device), torch.from_numpy(p).to(device), torch.from_numpy(m).to(device))
        assert got == want, name
    # int32 / 0-1 int mask / integer-valued floats are accepted as the reference's astype(int) would
    assert split_cluster_acc_v2(t.astype(np.int32), p.astype(float), m.astype(np.uint8)) == split_cluster_acc_v2(
        t, p, m
    )


def test_results_are_python_floats():
    out = evaluate_split(np.array(A_TRUE), np.array(A_PRED), np.array(A_MASK), "v2b")
    assert all(type(v) is float for v in out.values())
    assert type(cluster_acc(np.array(A_TRUE), np.array(A_PRED))) is float


def test_length_mismatch_errors():
    with pytest.raises(ValueError, match="y_true and y_pred"):
        cluster_acc([0, 1, 2], [0, 1])
    with pytest.raises(ValueError, match="y_true and y_pred"):
        split_cluster_acc_v2([0, 1, 2], [0, 1], [True, True, False])
    with pytest.raises(ValueError, match="mask"):
        split_cluster_acc_v1([0, 1, 2], [0, 1, 2], [True, False])


def test_bad_values_error():
    with pytest.raises(ValueError, match="y_pred.*non-negative"):
        cluster_acc([0, 1], [0, -1])
    with pytest.raises(ValueError, match="y_true.*integer"):
        cluster_acc([0.5, 1.0], [0, 1])
    with pytest.raises(ValueError, match="1-D"):
        cluster_acc(np.zeros((2, 2), dtype=int), np.zeros((2, 2), dtype=int))
    with pytest.raises(ValueError, match="mask"):
        split_cluster_acc_v2([0, 1], [0, 1], [0, 2])


def test_unknown_protocol_names_valid_ones():
    with pytest.raises(ValueError, match=r"'v3'.*v1, v2, v2b"):
        evaluate_split(A_TRUE, A_PRED, A_MASK, "v3")
    assert set(PROTOCOLS) == {"v1", "v2", "v2b"}


def test_default_protocol_is_v2():
    assert evaluate_split(B_TRUE, B_PRED, B_MASK) == split_cluster_acc_v2(B_TRUE, B_PRED, B_MASK)._asdict()


# ----------------------------------------------------------------------------------------------------------------------
# property tests against the slow oracle


def _random_case(seed):
    """Random labels with both subsets non-empty. Mixes D > K, D < K, sparse/unused cluster ids and class ids,
    and (sometimes) a mask that is not a function of the class, which the reference also accepts."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 300))
    k = int(rng.integers(2, 25))
    d = int(rng.integers(1, 40))
    y_true = rng.integers(0, k, n)
    if seed % 4 == 0:  # some class ids never occur
        y_true = rng.choice(rng.choice(k, size=max(2, k // 2), replace=False), n)
    if seed % 3 == 0:  # clusters concentrated on a few ids (many clusters never used)
        y_pred = rng.choice(rng.choice(d, size=max(1, d // 3), replace=True), n)
    else:
        y_pred = rng.integers(0, d, n)
    if seed % 2 == 0:  # noisy copy of the truth, so matchings are not all ties
        keep = rng.random(n) < 0.6
        y_pred = np.where(keep, (y_true * 7 + 3) % (max(k, d) + 2), y_pred)
    if seed % 5 == 4:
        mask = rng.random(n) < 0.5
    else:
        n_old = int(rng.integers(1, k))
        mask = y_true < n_old
    mask[0], mask[-1] = True, False  # both subsets non-empty (the reference gives NaN otherwise)
    return y_true, y_pred, mask


@pytest.mark.parametrize("seed", range(60))
def test_matches_slow_reference(seed):
    y_true, y_pred, mask = _random_case(seed)
    lt, lp, lm = y_true.tolist(), y_pred.tolist(), mask.tolist()
    assert math.isclose(cluster_acc(y_true, y_pred), slow_cluster_acc(lt, lp), abs_tol=1e-12)
    for name in ("v1", "v2", "v2b"):
        got = FAST[name](y_true, y_pred, mask)
        want = SLOW[name](lt, lp, lm)
        for g, w_, part in zip(got, want, ("all", "old", "new"), strict=True):
            assert math.isclose(g, w_, abs_tol=1e-12), (name, part, g, w_)
        assert evaluate_split(y_true, y_pred, mask, name) == got._asdict()


@pytest.mark.parametrize("seed", range(20))
def test_invariants(seed):
    y_true, y_pred, mask = _random_case(1000 + seed)
    v1, v2, v2b = (FAST[n](y_true, y_pred, mask) for n in ("v1", "v2", "v2b"))
    for acc in (v1, v2, v2b):
        assert all(0.0 <= x <= 1.0 for x in acc)
    # separate matchings can only do better than one joint matching
    assert v1.all >= v2.all - 1e-12
    assert math.isclose(v2.all, cluster_acc(y_true, y_pred), abs_tol=1e-12)
    # v2 All is the sample-weighted mix of Old and New when the mask is a function of the class
    if not np.intersect1d(y_true[mask], y_true[~mask]).size:
        w_old = mask.mean()
        assert math.isclose(v2.all, w_old * v2.old + (1 - w_old) * v2.new, abs_tol=1e-12)
    # the matched total does not depend on how the clusters are named
    rng = np.random.default_rng(seed)
    perm = rng.permutation(int(y_pred.max()) + 1 + 5)
    assert math.isclose(cluster_acc(y_true, perm[y_pred]), cluster_acc(y_true, y_pred), abs_tol=1e-12)
