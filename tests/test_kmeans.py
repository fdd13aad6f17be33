"""Semi-supervised k-means: parity with the reference transcription, invariants, hand-made cases, real features."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from benchmarks.published.kmeans import ReferenceSSKMeans
from infosieve_fast.config.settings import ConfigError, load_config
from infosieve_fast.evaluation.metrics import split_cluster_acc_v2
from infosieve_fast.kmeans import faiss_available, semi_supervised_kmeans
from infosieve_fast.kmeans.assign import _assign_capacity
from infosieve_fast.kmeans.checks import _pick_backend
from infosieve_fast.kmeans.problem import _cluster_sums, _Problem
from infosieve_fast.kmeans.search import _recheck_threshold, _TorchOps

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

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


IMBALANCED = dict(  # Phase A's balancing passes move points here
    n=500, k=5, n_known=2, seed=4, spread=2.0, weights=[0.1, 0.15, 0.4, 0.2, 0.15]
)


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
    u, l, t, _ = blobs(**IMBALANCED)
    cs = 100
    ref = reference(u, l, t, 5, variant="infosieve", cluster_size=cs, kpp_deletion="fixed")
    res = semi_supervised_kmeans(
        u, l, t, 5, n_init=3, seed=0, balanced=True, balance="reference", cluster_size=cs, backend=backend
    )
    assert torch.equal(res.labels, ref.labels_)
    assert res.inertia == pytest.approx(ref.inertia_, rel=1e-12)
    np.testing.assert_allclose(res.history, ref.history_, rtol=1e-12)
    assert np.diff(res.history).max() > 0  # balancing passes moved points: Phase A's inertia rose at some step


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 5])
def test_reference_unbalanced_matches_published_two_phases(backend, seed):
    # the published code runs Phase A (labelled centres frozen) and Phase B also with cluster_size=None (Herbarium19's
    # --unbalanced); its k-means++ deletion needs a cluster size, so the published deletion setting is kept here
    u, l, t, _ = blobs(**IMBALANCED)
    ref = reference(u, l, t, 5, seed=seed, variant="infosieve", cluster_size=None, kpp_deletion="bug")
    res = semi_supervised_kmeans(u, l, t, 5, n_init=3, seed=seed, balance="reference", backend=backend)
    assert torch.equal(res.labels, ref.labels_)
    assert res.inertia == pytest.approx(ref.inertia_, rel=1e-12)
    np.testing.assert_allclose(res.history, ref.history_, rtol=1e-12)
    torch.testing.assert_close(res.centers, ref.cluster_centers_, rtol=1e-10, atol=1e-10)
    # balance="capacity" (the function default) with balanced=False stays GCD's one phase, a different algorithm
    gcd = semi_supervised_kmeans(u, l, t, 5, n_init=3, seed=seed, backend=backend)
    ref_gcd = reference(u, l, t, 5, seed=seed)
    np.testing.assert_allclose(gcd.history, ref_gcd.history_, rtol=1e-12)
    assert len(gcd.history) != len(res.history) or not np.allclose(gcd.history, res.history)


def test_herbarium_config_runs_the_published_unbalanced_two_phases():
    k = load_config(CONFIGS / "herbarium19.yaml").kmeans
    assert (k.balanced, k.balance, k.distance_precision) == (False, "reference", "fp32")
    u, l, t, _ = blobs(**IMBALANCED)
    res = semi_supervised_kmeans(
        u,
        l,
        t,
        5,
        n_init=2,
        max_iter=k.max_iter,
        tol=k.tol,
        balanced=k.balanced,
        balance=k.balance,
        distance_precision=k.distance_precision,
        seed=0,
    )
    ref = reference(u, l, t, 5, n_init=2, max_iter=k.max_iter, variant="infosieve", cluster_size=None)
    assert torch.equal(res.labels, ref.labels_)
    assert res.inertia == pytest.approx(ref.inertia_, rel=1e-12)


def test_kpp_deletion_bug_reproduced_by_transcription():
    # docs/reference.md §5.2: the published deletion removes rows from the *front* of the array (0, then 1-2, ...).
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
    [
        {},
        {"freeze_labelled_centers": True},
        {"balance": "reference"},
        {"balanced": True},
        {"balanced": True, "balance": "reference"},
    ],
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
def unlabelled_problem(u: torch.Tensor, k: int, chunk: int) -> _Problem:
    """A problem of unlabelled rows `u` only, K = `k`, searched `chunk` rows at a time."""
    return _Problem(
        unlabelled=u,
        sq_norms=(u * u).sum(1),
        labelled=u[:0],
        labelled_ids=torch.zeros(0, dtype=torch.long),
        K=k,
        n_labelled=0,
        labelled_sums=u.new_zeros(k, u.shape[1]),
        labelled_counts=torch.zeros(k).long(),
        n_unlabelled_global=len(u),
        ops=_TorchOps(chunk),
        chunk=chunk,
    )


def test_capacity_assignment_hand_made():
    u = torch.tensor([[0.0], [1.0], [2.0], [10.0]], dtype=torch.float64)
    C = torch.tensor([[0.0], [10.0]], dtype=torch.float64)
    p = unlabelled_problem(u, k=2, chunk=2)
    lab, inertia = _assign_capacity(p, C[None], torch.tensor([2, 2]))
    assert lab.tolist() == [[0, 0, 1, 1]]
    assert float(inertia) == pytest.approx(0 + 1 + 64 + 0)


def test_capacity_assignment_close_to_optimal():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(60, 4, generator=g, dtype=torch.float64)
    C = torch.randn(5, 4, generator=g, dtype=torch.float64) * 0.5
    cap = torch.tensor([25, 8, 18, 15, 12])
    p = unlabelled_problem(u, k=5, chunk=16)
    lab, inertia = (a[0] for a in _assign_capacity(p, C[None], cap))
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
    with pytest.raises(ValueError, match="distance_precision must be one of"):
        semi_supervised_kmeans(u.float(), l.float(), t, 6, distance_precision="fp8")
    with pytest.raises(ValueError, match="float64 features are clustered exactly"):
        semi_supervised_kmeans(u, l, t, 6, distance_precision="bf16")
    if faiss_available():
        with pytest.raises(ValueError, match="backend='torch'"):
            semi_supervised_kmeans(u.float(), l.float(), t, 6, backend="faiss", distance_precision="tf32")


# ------------------------------------------------------------------------------------------- half-precision features
MODES = {
    "plain": {},
    "reference_unbalanced": {"balance": "reference"},
    "reference": {"balanced": True, "balance": "reference"},
    "capacity": {"balanced": True},
}
# balanced modes with the stored [N, K] matrix (small problems) and without it (large problems: per-row searches)
MODE_PATHS = [("plain", True), ("reference_unbalanced", True)] + [
    (m, stored) for m in ("reference", "capacity") for stored in (True, False)
]


@pytest.mark.parametrize("mode, stored_matrix", MODE_PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_features_equal_their_fp32_upcast(monkeypatch, dtype, mode, stored_matrix):
    # fp16/bf16 features are converted one row chunk at a time (chunk_size=64 forces many chunks); the result must be
    # exactly that of the fp32 upcast of the same values
    import infosieve_fast.kmeans as km

    if not stored_matrix:
        monkeypatch.setattr(km, "_CAPACITY_MATRIX_MAX", 0)
    u, l, t, _ = blobs(n=500, d=16, k=8, n_known=4, seed=7, spread=1.0)
    uh, lh = u.to(dtype), l.to(dtype)
    half = semi_supervised_kmeans(uh, lh, t, 8, n_init=2, seed=3, chunk_size=64, **MODES[mode])
    full = semi_supervised_kmeans(uh.float(), lh.float(), t, 8, n_init=2, seed=3, chunk_size=64, **MODES[mode])
    assert torch.equal(half.labels, full.labels) and torch.equal(half.centers, full.centers)
    assert half.inertia == full.inertia and half.history == full.history and half.centers.dtype == torch.float32


# ------------------------------------------------------------------------------------- low-precision distance GEMMs
def near_tie_rows(n_tie=300, n_clear=100, d=64, seed=0):
    """Centres 0 and 1 and points on their bisector pushed toward one of them by 1e-4..1e-3 (fp32 resolves these
    gaps, bf16 does not), plus points next to centres 2..5 (far from any tie). Returns x, C, the fp64 argmin."""
    g = torch.Generator().manual_seed(seed)
    C = torch.randn(6, d, generator=g)
    a, b = C[0], C[1]
    w = (a - b) / (a - b).norm()
    x = (a + b) / 2 + 0.5 * torch.randn(n_tie, d, generator=g)
    x -= (x - (a + b) / 2) @ w[:, None] * w  # onto the bisector
    step = (1e-4 + 9e-4 * torch.rand(n_tie, generator=g)) * torch.where(torch.rand(n_tie, generator=g) < 0.5, 1, -1)
    x += step[:, None] * w
    clear = C[2 + torch.arange(n_clear) % 4] + 0.1 * torch.randn(n_clear, d, generator=g)
    x = torch.cat([x, clear])
    truth = torch.cdist(x.double(), C.double()).argmin(1)
    return x, C, truth


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_low_precision_search_equals_fp32_on_near_ties(precision):
    x, C, truth = near_tie_rows()
    x2 = (x * x).sum(1)
    d32, i32 = (a[0] for a in _TorchOps(128).nearest(x, x2, C[None]))
    assert torch.equal(i32, truth)  # the constructed gaps are resolved in fp32
    ops = _TorchOps(128, precision)
    d_low, i_low = (a[0] for a in ops.nearest(x, x2, C[None]))
    assert torch.equal(i_low, i32)
    torch.testing.assert_close(d_low, d32, rtol=1e-5, atol=1e-4)
    assert ops.searched == len(x) and ops.rechecked > 0
    # near-tie rows are re-searched exactly, clear rows are not
    ties, clear = _TorchOps(128, precision), _TorchOps(128, precision)
    ties.nearest(x[:300], x2[:300], C[None])
    clear.nearest(x[300:], x2[300:], C[None])
    assert ties.rechecked + clear.rechecked == ops.rechecked and clear.rechecked == 0
    if precision == "bf16":  # without the recheck bf16 would get near ties wrong: the recheck is what makes it exact
        wrong = int((((C * C).sum(1) - 2 * (x.bfloat16() @ C.bfloat16().t()).float()).argmin(1) != truth).sum())
        assert 10 < wrong <= ties.rechecked
    # restricted search (balancing / capacity rounds): centre 0 not allowed
    allowed = torch.tensor([False, True, True, True, True, True])
    rows = torch.arange(0, len(x), 3)
    _, i32r = _TorchOps(50).nearest(x, x2, C[None], rows=rows, allowed=allowed[None])
    _, ilr = _TorchOps(50, precision).nearest(x, x2, C[None], rows=rows, allowed=allowed[None])
    assert torch.equal(ilr, i32r) and not bool((i32r == 0).any())


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_recheck_threshold_bounds_the_bf16_error(scale):
    # property: every low-precision value c2 - 2 x·c is within half the threshold of the fp32 GEMM's value
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2000, 96, generator=g) * scale
    C = torch.randn(40, 96, generator=g) * scale * torch.rand(40, 1, generator=g)
    c2 = (C * C).sum(1)
    v32 = torch.addmm(c2, x, C.t(), beta=1, alpha=-2)
    v_low = torch.add(c2, x.bfloat16() @ C.bfloat16().t(), alpha=-2)
    thr = _recheck_threshold("bf16", 96, True, x.norm(dim=1), C.norm(dim=1).max())
    err = (v_low - v32).abs().max(1).values
    assert bool((err <= thr / 2).all())
    assert float((err / thr).max()) > 1e-3  # and the bound is not vacuous: within three orders of the worst error


@pytest.mark.gpu_parity
@pytest.mark.parametrize("mode, stored_matrix", MODE_PATHS)
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_low_precision_kmeans_labels_equal_fp32(monkeypatch, device, precision, mode, stored_matrix):
    # on CUDA: the bf16 product with out_dtype, TF32 and the segment-sum centre update, against the IEEE fp32 search
    import infosieve_fast.kmeans as km

    if not stored_matrix:
        monkeypatch.setattr(km, "_CAPACITY_MATRIX_MAX", 0)
    u, l, t, _ = blobs(n=600, d=32, k=10, n_known=5, seed=3, spread=0.6)  # overlapping blobs: many near ties
    u, l, t = u.float().to(device), l.float().to(device), t.to(device)
    ref = semi_supervised_kmeans(u, l, t, 10, n_init=2, seed=1, chunk_size=100, **MODES[mode])
    low = semi_supervised_kmeans(
        u, l, t, 10, n_init=2, seed=1, chunk_size=100, distance_precision=precision, **MODES[mode]
    )
    assert torch.equal(low.labels, ref.labels)
    assert low.inertia == pytest.approx(ref.inertia, rel=1e-6)
    assert ref.searched_rows == ref.rechecked_rows == 0
    assert low.searched_rows > 0 and 0 < low.rechecked_rows < low.searched_rows


@pytest.mark.gpu_parity
def test_fp32_search_runs_in_ieee_even_when_tf32_is_allowed(monkeypatch, device):
    import infosieve_fast.kmeans as km

    seen = []
    original = km._kmeans_pp
    monkeypatch.setattr(
        km, "_kmeans_pp", lambda *a: seen.append(torch.backends.cuda.matmul.fp32_precision) or original(*a)
    )
    u, l, t, _ = blobs(n=600, d=32, k=10, n_known=5, seed=3, spread=0.6)
    u, l, t = u.float().to(device), l.float().to(device), t.to(device)
    ieee = semi_supervised_kmeans(u, l, t, 10, n_init=1, backend="torch")
    old = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        allowed = semi_supervised_kmeans(u, l, t, 10, n_init=1, backend="torch")
        assert seen == ["ieee", "ieee"] and torch.backends.cuda.matmul.fp32_precision == "tf32"  # restored afterwards
    finally:
        torch.backends.cuda.matmul.fp32_precision = old
    assert torch.equal(allowed.labels, ieee.labels) and allowed.inertia == ieee.inertia


# --------------------------------------------------------------------------------------------------- backend choice
def test_auto_backend_is_faiss_only_with_gpu_faiss_and_cuda_features(monkeypatch):
    import infosieve_fast.kmeans.checks as km

    monkeypatch.setattr(km, "faiss_available", lambda gpu=False: True)  # a GPU build of FAISS that sees a GPU
    assert _pick_backend("auto", True, "fp32") == "faiss"
    assert _pick_backend("auto", False, "fp32") == "torch"
    assert _pick_backend("auto", True, "tf32") == "torch"  # FAISS has no low-precision search with recheck
    monkeypatch.setattr(km, "faiss_available", lambda gpu=False: not gpu)  # faiss-cpu
    assert _pick_backend("auto", True, "fp32") == "torch"
    assert _pick_backend("faiss", False, "fp32") == "faiss" and _pick_backend("torch", True, "fp32") == "torch"


def test_auto_backend_on_this_machine():
    u, l, t, _ = blobs(n=100)
    if faiss_available():
        import faiss

        assert faiss_available(gpu=True) == (hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0)
    assert semi_supervised_kmeans(u, l, t, 6, n_init=1).backend == "torch"  # CPU features: torch even with FAISS


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

    u, l, t, _ = blobs(**IMBALANCED)
    kw = dict(n_init=2, seed=0, balanced=True, balance=balance, cluster_size=100)
    a = semi_supervised_kmeans(u, l, t, 5, **kw)
    monkeypatch.setattr(km, "_CAPACITY_MATRIX_MAX", 0)
    b = semi_supervised_kmeans(u, l, t, 5, **kw)
    assert torch.equal(a.labels, b.labels) and a.inertia == pytest.approx(b.inertia, rel=1e-12)
    if balance == "capacity":
        assert torch.bincount(a.labels).max() <= 100


@pytest.mark.gpu_parity
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_cluster_sums_segment_path_equals_index_add(device, dtype):
    # the CUDA path (rows sorted by cluster, segment sums across row chunks; deterministic) against index_add_ and a
    # per-cluster loop, for 3 restarts at once; half-precision rows are summed in the compute dtype
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, 7, generator=g, dtype=torch.float64).to(dtype)
    lab = torch.randint(0, 9, (3, 1000), generator=g)
    x, lab = x.to(device), lab.to(device)
    lab[lab == 4] = 3  # an empty cluster
    cdtype = torch.float64 if dtype == torch.float64 else torch.float32
    a = _cluster_sums(x, lab, 9, 128, cdtype, segments=False)
    b = _cluster_sums(x, lab, 9, 128, cdtype, segments=True)
    loop = torch.stack([torch.stack([x[lr == k].to(torch.float64).sum(0) for k in range(9)]) for lr in lab])
    assert a.dtype == b.dtype == cdtype and a.shape == (3, 9, 7)
    torch.testing.assert_close(a, loop.to(cdtype))
    torch.testing.assert_close(b, loop.to(cdtype))
    assert torch.equal(a[:, 4], torch.zeros(3, 7, dtype=cdtype)) and torch.equal(b[:, 4], a[:, 4])
    # each restart's sums are bit for bit those of the restart alone (segments: same rows per chunk, 128 // 3 = 42)
    for r in range(3):
        assert torch.equal(a[r], _cluster_sums(x, lab[r : r + 1], 9, 128, cdtype, segments=False)[0])
        assert torch.equal(b[r], _cluster_sums(x, lab[r : r + 1], 9, 42, cdtype, segments=True)[0])


def test_cluster_size_and_frozen_centres_reach_the_training_rounds_from_the_config():
    from infosieve_fast.training.engine import FeatureSet, Trainer
    from tests.test_engine import smoke_config

    u, l, t, _ = blobs(n=320, k=5, n_known=2, seed=4, spread=2.0, weights=IMBALANCED["weights"])
    feats = torch.cat([l, u]).float()
    targets = torch.cat([t, torch.zeros(len(u), dtype=t.dtype)])
    labelled = torch.arange(320) < len(l)
    fs = FeatureSet(feats, targets, labelled, torch.arange(320), torch.arange(320))
    sets = ["kmeans.n_init=3", "kmeans.cluster_size=80", "kmeans.n_clusters=5"]

    with pytest.raises(ConfigError, match=r"kmeans.cluster_size=63 x 5 clusters holds fewer than the 320 .* >= 64"):
        Trainer(smoke_config("kmeans.cluster_size=63", "kmeans.n_clusters=5"))
    clustering = Trainer(smoke_config(*sets)).evaluator.cluster(fs, seed=0, balanced=True)
    ref = reference(u.float(), l.float(), t, 5, variant="infosieve", cluster_size=80, kpp_deletion="fixed")
    assert torch.equal(clustering.labels, ref.labels_)
    assert clustering.inertia == pytest.approx(float(ref.inertia_), rel=1e-5)

    frozen_trainer = Trainer(smoke_config(*sets, "kmeans.freeze_labelled_centers=true"))
    frozen = frozen_trainer.evaluator.cluster(fs, seed=0, balanced=True)
    means = torch.stack([l[t == c].float().mean(0) for c in range(2)])
    torch.testing.assert_close(frozen.centers[:2], means)
    assert not torch.allclose(clustering.centers[:2], means)  # not frozen: the published Phase B moves them
