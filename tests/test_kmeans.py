"""Semi-supervised k-means: parity with the reference transcription, invariants, hand-made cases, real features."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from benchmarks.published.kmeans import ReferenceSSKMeans
from infosieve_fast.kmeans import (
    _assign_capacity,
    _cluster_sums,
    _Problem,
    _TorchOps,
    faiss_available,
    semi_supervised_kmeans,
)
from infosieve_fast.metrics import split_cluster_acc_v2

BACKENDS = ["torch", pytest.param("faiss", marks=pytest.mark.skipif(not faiss_available(), reason="no faiss"))]


def blobs(n=400, d=8, k=6, n_known=3, seed=0, spread=3.0, weights=None):
    """Float64 Gaussian blobs with a GCD split: classes < n_known known, about half of their points labelled."""
    g = np.random.RandomState(seed)
    y = g.choice(k, n, p=weights)
    x = g.randn(k, d)[y] * spread + g.randn(n, d)
    lab = (y < n_known) & (g.rand(n) < 0.5)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    m = torch.from_numpy(lab)
    return x[~m], x[m], y[m], y[~m]


def reference(u, l, t, k, *, n_init=3, max_iter=10, seed=0, **kw):
    return ReferenceSSKMeans(k, n_init=n_init, max_iter=max_iter, random_state=seed, empty="keep", **kw).fit_mix(
        u, l, t
    )


# ------------------------------------------------------------------------------------------------ reference parity
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 3])
def test_plain_matches_reference_transcription(backend, seed):
    u, l, t, _ = blobs(seed=seed)
    ref = reference(u, l, t, 6, seed=seed)
    res = semi_supervised_kmeans(u, l, t, 6, n_init=3, max_iter=10, seed=seed, backend=backend)
    assert torch.equal(res.labels, ref.labels_)
    assert res.inertia == pytest.approx(ref.inertia_, rel=1e-12)
    np.testing.assert_allclose(res.history, ref.history_, rtol=1e-12)
    torch.testing.assert_close(res.centers, ref.cluster_centers_, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reference_balance_matches_two_phase_transcription(backend):
    # imbalanced blobs so that Phase A's balancing passes actually move points
    u, l, t, _ = blobs(n=500, k=5, n_known=2, seed=4, spread=2.0, weights=[0.1, 0.15, 0.4, 0.2, 0.15])
    cs = 100
    ref = reference(u, l, t, 5, variant="infosieve", cluster_size=cs, kpp_deletion="fixed")
    res = semi_supervised_kmeans(
        u, l, t, 5, n_init=3, seed=0, balanced=True, balance="reference", cluster_size=cs, backend=backend
    )
    assert torch.equal(res.labels, ref.labels_)
    assert res.inertia == pytest.approx(ref.inertia_, rel=1e-12)
    np.testing.assert_allclose(res.history, ref.history_, rtol=1e-12)
    assert np.diff(res.history).max() > 0  # balancing passes moved points: Phase A's inertia rose at some step


def test_kpp_deletion_bug_reproduced_by_transcription():
    # REFERENCE.md §5.2: the published deletion removes rows from the *front* of the array (0, then 1-2, ...).
    x = torch.arange(40, dtype=torch.float64)[:, None]
    ref = ReferenceSSKMeans(4, n_init=1, random_state=0, variant="infosieve", cluster_size=5, kpp_deletion="bug")
    pre = torch.tensor([[100.0]], dtype=torch.float64)
    C = ref.kpp(x, pre, np.random.RandomState(0), cs=5)
    # every seed is the value of the chosen row after 1, then 2 front rows were deleted
    idx = ref.seed_indices[0]
    assert C[1, 0] == idx[0] and C[2, 0] == idx[1] + 1 and C[3, 0] == idx[2] + 3


# ------------------------------------------------------------------------------------------------------ invariants
@pytest.mark.parametrize(
    "kw",
    [{}, {"freeze_labelled_centers": True}, {"balanced": True}, {"balanced": True, "balance": "reference"}],
)
def test_labelled_points_keep_their_class(kw):
    u, l, t, _ = blobs(n=300, seed=1)
    res = semi_supervised_kmeans(u, l, t, 6, n_init=2, seed=1, **kw)
    assert res.labels.dtype == torch.long and res.labels.shape == (len(l) + len(u),)
    assert torch.equal(res.labels[: len(l)], t)
    assert int(res.labels.min()) >= 0 and int(res.labels.max()) < 6
    assert torch.isfinite(res.centers).all()


@pytest.mark.parametrize("freeze", [False, True])
def test_inertia_non_increasing_and_result_is_best(freeze):
    u, l, t, _ = blobs(n=600, d=16, k=10, n_known=5, seed=2, spread=1.0)
    res = semi_supervised_kmeans(u, l, t, 10, n_init=4, max_iter=30, tol=0, seed=2, freeze_labelled_centers=freeze)
    h = np.array(res.history)
    assert np.all(np.diff(h) <= 1e-9 * h[0])
    assert res.inertia == pytest.approx(h.min())
    assert res.n_iter == len(h)


def test_best_of_n_init():
    # restarts share one RNG stream, so the first runs of n_init=5 are the runs of n_init=1 and 3
    u, l, t, _ = blobs(n=600, d=16, k=10, n_known=5, seed=5, spread=1.0)
    inert = [semi_supervised_kmeans(u, l, t, 10, n_init=n, seed=5).inertia for n in (1, 3, 5)]
    assert inert[0] >= inert[1] >= inert[2]
    ref = reference(u, l, t, 10, n_init=5, seed=5)
    assert inert[2] == pytest.approx(ref.inertia_, rel=1e-12)


def test_frozen_labelled_centres_are_class_means():
    u, l, t, _ = blobs(seed=6)
    res = semi_supervised_kmeans(u, l, t, 6, n_init=2, seed=0, freeze_labelled_centers=True)
    for c in range(3):
        torch.testing.assert_close(res.centers[c], l[t == c].mean(0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_per_seed(backend):
    u, l, t, _ = blobs(n=500, d=16, k=8, n_known=4, seed=7, spread=1.0)
    u, l = u.float(), l.float()
    a = semi_supervised_kmeans(u, l, t, 8, n_init=3, seed=11, backend=backend, balanced=True)
    b = semi_supervised_kmeans(u, l, t, 8, n_init=3, seed=11, backend=backend, balanced=True)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.centers, b.centers) and a.inertia == b.inertia


def test_empty_cluster_keeps_its_centre():
    # labelled class 0 sits exactly on an unlabelled point and the other points coincide: the second new seed
    # duplicates an existing centre, its cluster gets no point. The reference's mean is NaN; we keep the seed.
    A, B = [0.0, 0.0], [4.0, 0.0]
    u = torch.tensor([A, B, B], dtype=torch.float64)
    l = torch.tensor([A], dtype=torch.float64)
    t = torch.tensor([0])
    res = semi_supervised_kmeans(u, l, t, 3, n_init=1, seed=0, backend="torch")
    assert torch.isfinite(res.centers).all()
    assert torch.bincount(res.labels, minlength=3)[2] == 0
    assert res.centers[2].tolist() in (A, B)
    ref = ReferenceSSKMeans(3, n_init=1, random_state=0).fit_mix(u, l, t)  # published behaviour: NaN centre
    assert torch.isnan(ref.cluster_centers_[2]).all()


# -------------------------------------------------------------------------------------------------------- capacity
def test_capacity_assignment_hand_made():
    u = torch.tensor([[0.0], [1.0], [2.0], [10.0]], dtype=torch.float64)
    C = torch.tensor([[0.0], [10.0]], dtype=torch.float64)
    p = _Problem(u, (u * u).sum(1), u[:0], torch.zeros(0, dtype=torch.long), 2, 0, C * 0, torch.zeros(2).long(), 4,
                 _TorchOps(2), 2)  # fmt: skip
    lab, inertia = _assign_capacity(p, C, torch.tensor([2, 2]))
    assert lab.tolist() == [0, 0, 1, 1]
    assert float(inertia) == pytest.approx(0 + 1 + 64 + 0)


def test_capacity_assignment_close_to_optimal():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(60, 4, generator=g, dtype=torch.float64)
    C = torch.randn(5, 4, generator=g, dtype=torch.float64) * 0.5
    cap = torch.tensor([25, 8, 18, 15, 12])
    p = _Problem(u, (u * u).sum(1), u[:0], torch.zeros(0, dtype=torch.long), 5, 0, C * 0, torch.zeros(5).long(), 60,
                 _TorchOps(16), 16)  # fmt: skip
    lab, inertia = _assign_capacity(p, C, cap)
    assert (torch.bincount(lab, minlength=5) <= cap).all()
    d = torch.cdist(u, C) ** 2
    assert float(inertia) == pytest.approx(float(d[torch.arange(60), lab].sum()))
    cols = np.repeat(np.arange(5), cap.numpy())  # optimum: one column per unit of capacity
    r, c = linear_sum_assignment(d.numpy()[:, cols])
    opt = d.numpy()[:, cols][r, c].sum()
    assert opt - 1e-9 <= float(inertia) <= 1.2 * opt


def test_capacity_mode_respects_capacity():
    # imbalanced data: one huge class among the unlabelled points, one labelled class larger than the capacity
    g = np.random.RandomState(8)
    sizes = [200, 20, 20, 20, 20]
    y = np.repeat(np.arange(5), sizes)
    x = torch.from_numpy(g.randn(5, 6)[y] * 4 + g.randn(len(y), 6))
    l_idx = np.r_[0:70, 200:205]  # class 0: 70 labelled points > capacity 56; class 1: 5
    m = np.zeros(len(y), bool)
    m[l_idx] = True
    u, l, t = x[~m], x[m], torch.from_numpy(y[m])
    cs = int(np.ceil(len(y) / 5))
    res = semi_supervised_kmeans(u, l, t, 5, n_init=3, seed=0, balanced=True)
    sizes_out = torch.bincount(res.labels, minlength=5)
    assert sizes_out[0] == 70  # labelled points alone exceed the capacity: no unlabelled point joins
    assert (sizes_out[1:] <= cs).all()
    assert torch.equal(res.labels[: len(l)], t)
    plain = semi_supervised_kmeans(u, l, t, 5, n_init=3, seed=0)
    assert torch.bincount(plain.labels, minlength=5).max() > cs  # the constraint is not vacuous here


# ------------------------------------------------------------------------------------------------- inputs & errors
def test_dtypes_numpy_and_noncontiguous_classes():
    u, l, t, _ = blobs(seed=9)
    ref = semi_supervised_kmeans(u.float(), l.float(), t, 6, n_init=2, seed=0)
    half = semi_supervised_kmeans(u.half().numpy(), l.half().numpy(), t.double().numpy(), 6, n_init=2, seed=0)
    exact = semi_supervised_kmeans(u.half().float(), l.half().float(), t, 6, n_init=2, seed=0)
    assert half.centers.dtype == torch.float32 and torch.equal(half.labels, exact.labels)
    assert (half.labels == ref.labels).float().mean() > 0.98
    bf = semi_supervised_kmeans(u.bfloat16(), l.bfloat16(), t.int(), 6, n_init=2, seed=0)
    assert torch.equal(bf.labels[: len(l)], t)
    # labelled classes {0, 2}: they keep their ids; novel seeds fill 1, 3, 4, 5
    sel = t != 1
    res = semi_supervised_kmeans(u, l[sel], t[sel] * 1, 6, n_init=2, seed=0)
    assert torch.equal(res.labels[: int(sel.sum())], t[sel])
    # no labelled points at all: plain k-means++ / Lloyd
    res = semi_supervised_kmeans(u, l[:0], t[:0], 4, n_init=2, seed=0)
    assert res.labels.shape == (len(u),) and len(torch.unique(res.labels)) == 4


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda u, l, t, k: (torch.where(u > 2, float("nan"), u), l, t, k), "u_feats contains NaN or inf"),
        (lambda u, l, t, k: (u, torch.where(l > 2, float("inf"), l), t, k), "l_feats contains NaN or inf"),
        (lambda u, l, t, k: (u, l, t + 6, k), r"0\.\.5"),
        (lambda u, l, t, k: (u, l, t - 1, k), r"0\.\.5"),
        (lambda u, l, t, k: (u, l, t.double() + 0.5, k), "integer"),
        (lambda u, l, t, k: (u[:0], l, t, k), "empty"),
        (lambda u, l, t, k: (u[:2], l[:2], t[:2] * 0, 5), "larger than the number of points"),
        (lambda u, l, t, k: (u[:2], l, t, k), "need seeds"),
        (lambda u, l, t, k: (u[:, :3], l, t, k), "features per row"),
        (lambda u, l, t, k: (u, l, t[:-1], k), "entries"),
        (lambda u, l, t, k: (u.long(), l, t, k), "floating"),
    ],
)
def test_bad_input_errors(mutate, match):
    u, l, t, _ = blobs(n=60)
    u, l, t, k = mutate(u, l, t, 6)
    with pytest.raises((ValueError, TypeError), match=match):
        semi_supervised_kmeans(u, l, t, k, n_init=1)


def test_bad_options():
    u, l, t, _ = blobs(n=60)
    with pytest.raises(ValueError, match="too small"):
        semi_supervised_kmeans(u, l, t, 6, balanced=True, cluster_size=5)
    with pytest.raises(ValueError, match="balance"):
        semi_supervised_kmeans(u, l, t, 6, balanced=True, balance="sinkhorn")
    with pytest.raises(ValueError, match="backend"):
        semi_supervised_kmeans(u, l, t, 6, backend="cuml")


# ------------------------------------------------------------------------------------------------------ real data
def cub_split(realdata, n_classes):
    z = np.load(realdata / "features" / "cub100_efflite0_224_feats.npz")
    F, y = z["F"].astype(np.float32), z["y"]
    keep = y < n_classes
    F, y = F[keep], y[keep]
    F /= np.linalg.norm(F, axis=1, keepdims=True)
    known = np.nonzero(y < n_classes // 2)[0]
    lab = np.zeros(len(y), bool)
    lab[np.random.RandomState(0).choice(known, len(known) // 2, replace=False)] = True
    return torch.from_numpy(F[~lab]), torch.from_numpy(F[lab]), torch.from_numpy(y[lab]), y[~lab], n_classes // 2


def _acc(res, n_l, y_u, n_old):
    return split_cluster_acc_v2(y_u, res.labels[n_l:].numpy(), y_u < n_old)[0]


def test_real_features_first_20_classes(realdata):
    u, l, t, y_u, n_old = cub_split(realdata, 20)
    res = semi_supervised_kmeans(u, l, t, 20, n_init=10, max_iter=10, seed=0)
    assert _acc(res, len(l), y_u, n_old) >= 0.80


def test_real_features_all_100_classes(realdata):
    # README baseline 0.672. Measured (10 x 10, seed 0): plain 0.597, capacity 0.703, reference two-phase 0.753.
    u, l, t, y_u, n_old = cub_split(realdata, 100)
    cs = int(np.ceil((len(u) + len(l)) / 100))
    plain = semi_supervised_kmeans(u, l, t, 100, n_init=10, max_iter=10, seed=0)
    assert _acc(plain, len(l), y_u, n_old) >= 0.58  # regression floor of GCD's plain SS-k-means on this split
    ref = semi_supervised_kmeans(u, l, t, 100, n_init=3, seed=0, balanced=True, balance="reference")
    assert _acc(ref, len(l), y_u, n_old) >= 0.672 - 0.02
    cap = semi_supervised_kmeans(u, l, t, 100, n_init=3, seed=0, balanced=True)
    assert torch.bincount(cap.labels).max() <= cs
    assert _acc(cap, len(l), y_u, n_old) >= 0.672 - 0.02


@pytest.mark.parametrize("balance", ["capacity", "reference"])
def test_balancing_without_the_stored_matrix(monkeypatch, balance):
    # large problems recompute distances per round / pass instead of keeping [N, K]: same labels
    import infosieve_fast.kmeans as km

    u, l, t, _ = blobs(n=500, k=5, n_known=2, seed=4, spread=2.0, weights=[0.1, 0.15, 0.4, 0.2, 0.15])
    kw = dict(n_init=2, seed=0, balanced=True, balance=balance, cluster_size=100)
    a = semi_supervised_kmeans(u, l, t, 5, **kw)
    monkeypatch.setattr(km, "_CAPACITY_MATRIX_MAX", 0)
    b = semi_supervised_kmeans(u, l, t, 5, **kw)
    assert torch.equal(a.labels, b.labels) and a.inertia == pytest.approx(b.inertia, rel=1e-12)
    if balance == "capacity":
        assert torch.bincount(a.labels).max() <= 100


def test_cluster_sums_onehot_path_equals_index_add():
    # the CUDA path (one-hot GEMM, deterministic) against index_add_, run on the CPU
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, 7, generator=g, dtype=torch.float64)
    lab = torch.randint(0, 9, (1000,), generator=g)
    lab[lab == 4] = 3  # an empty cluster
    a = _cluster_sums(x, lab, 9, 128, onehot=False)
    b = _cluster_sums(x, lab, 9, 128, onehot=True)
    torch.testing.assert_close(a, b)
    assert torch.equal(a[4], torch.zeros(7, dtype=torch.float64))
