"""Semi-supervised k-means restarts run as one batch: the batch's result is that of the best restart run alone, and a
round makes a fixed number of host syncs, however many iterations and restarts it runs."""

from __future__ import annotations

import pytest
import torch

import infosieve_fast.kmeans as km
from infosieve_fast.kmeans import semi_supervised_kmeans
from tests.test_kmeans import IMBALANCED, blobs

MODES = {
    "plain": {},
    "frozen": {"freeze_labelled_centers": True},
    "reference_unbalanced": {"balance": "reference"},
    "reference": {"balanced": True, "balance": "reference", "cluster_size": 100},
}
RUN_RESTARTS = km._run_restarts


@pytest.mark.parametrize("cuda_like", [False, True])
@pytest.mark.parametrize("stored_matrix", [True, False])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_restarts_equal_each_restart_alone(monkeypatch, mode, dtype, stored_matrix, cuda_like):
    # cuda_like: the sync-free paths (no convergence polling, balancing passes over every point) run on the CPU
    if not stored_matrix:
        monkeypatch.setattr(km, "_CAPACITY_MATRIX_MAX", 0)
    if cuda_like:
        monkeypatch.setattr(km, "_host_syncs_are_free", lambda device: False)
    u, l, t, _ = blobs(**IMBALANCED)
    calls = []  # the arguments of every _run_restarts call
    monkeypatch.setattr(km, "_run_restarts", lambda p, s, *a: calls.append((p, s, a)) or RUN_RESTARTS(p, s, *a))
    # tol = 1: the restarts stop after different numbers of iterations, the stopped ones wait for the others
    res = semi_supervised_kmeans(u.to(dtype), l.to(dtype), t, 5, n_init=6, seed=2, tol=1.0, **MODES[mode])
    [(p, seeds, args)] = calls  # all restarts in one batch
    assert seeds.shape[0] == 6
    batch = RUN_RESTARTS(p, seeds, *args)
    alone = [RUN_RESTARTS(p, seeds[r : r + 1], *args) for r in range(6)]
    inertias = [a[0] for a in alone]
    best = inertias.index(min(inertias))  # the first restart of least inertia
    assert len(set(inertias)) > 1 and len({a[2] for a in alone}) > 1  # the restarts differ, and stop apart
    inertia, history, n_iter, _, lab, centers = alone[best]
    assert batch[:4] == (inertia, history, n_iter, best)
    assert torch.equal(batch[4], lab) and torch.equal(batch[5], centers)
    assert (res.inertia, res.history, res.n_iter, res.best_init) == batch[:4]


SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "nonzero")


def count_host_syncs(monkeypatch) -> dict:
    """Count every tensor read-back to the host (the calls that block on the device under CUDA) by name."""
    counts = dict.fromkeys(SYNCS, 0)
    for name in SYNCS:
        method = getattr(torch.Tensor, name)

        def counting(self, *a, _name=name, _method=method, **kw):
            counts[_name] += 1
            return _method(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counting)
    nonzero = torch.nonzero
    monkeypatch.setattr(
        torch, "nonzero", lambda *a, **kw: counts.__setitem__("nonzero", counts["nonzero"] + 1) or nonzero(*a, **kw)
    )
    return counts


@pytest.mark.parametrize("mode", ["plain", "reference_unbalanced", "reference"])
def test_host_syncs_per_round_do_not_grow_with_iterations_or_restarts(monkeypatch, mode):
    # as on CUDA: no polling for convergence; the syncs are those of the input checks, k-means++ setup and the result
    monkeypatch.setattr(km, "_host_syncs_are_free", lambda device: False)
    u, l, t, _ = blobs(**IMBALANCED)
    syncs = {}
    for n_init, max_iter in [(2, 2), (2, 6), (5, 6)]:
        with monkeypatch.context() as m:
            counts = count_host_syncs(m)
            semi_supervised_kmeans(u, l, t, 5, n_init=n_init, max_iter=max_iter, seed=1, **MODES[mode])
        syncs[n_init, max_iter] = dict(counts)
    assert syncs[2, 2] == syncs[2, 6] == syncs[5, 6]
    assert 0 < sum(syncs[2, 2].values()) < 40
