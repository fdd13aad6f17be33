"""The semi-supervised Lloyd iterations of R restarts in lockstep, and the pick of the best iteration."""

from __future__ import annotations

import torch

from infosieve_fast.common.distributed import all_reduce_sum

from .assign import _assign_capacity, _assign_plain, _assign_reference_phase_a
from .problem import _labelled_inertia, _Problem, _update_centers


class _Runs:
    """R restarts iterated in lockstep, every restart's state on the device.

    A restart stops (keeps its centres and records nothing more) after the iteration whose centre shift is below
    ``tol``; the others go on. Per restart: the inertia history, the iteration count and the best iteration (strict
    ``<``: the first of equal inertias), its labels and the centres updated from them. Nothing is read back to the
    host until :meth:`best_restart`.
    """

    def __init__(self, problem: _Problem, n_restarts: int, steps: int):
        device, (n, dim) = problem.device, problem.unlabelled.shape
        self.history = torch.zeros(n_restarts, steps, dtype=torch.float64, device=device)
        self.recorded = torch.zeros(n_restarts, steps, dtype=torch.bool, device=device)
        self.step = 0
        self.best_inertia = torch.full((n_restarts,), float("inf"), dtype=torch.float64, device=device)
        self.best_lab = torch.zeros(n_restarts, n, dtype=torch.long, device=device)
        self.best_centers = torch.zeros(n_restarts, problem.K, dim, dtype=problem.dtype, device=device)

    def iterate(self, problem: _Problem, centers, max_iter, tol, assign, frozen):
        """Up to ``max_iter`` iterations of ``assign(centers, iteration)`` and the centre update -> the last centres."""
        active = torch.ones(centers.shape[0], dtype=torch.bool, device=problem.device)
        for it in range(max_iter):
            u_lab, inertia_u = assign(centers, it)
            inertia = all_reduce_sum(inertia_u) + _labelled_inertia(problem, centers)
            new = _update_centers(problem, centers, u_lab, frozen)
            self._record(inertia, active, u_lab, new)
            shift = (new - centers).norm(dim=2).sum(1).to(torch.float64) ** 2
            centers = torch.where(active[:, None, None], new, centers)
            active = active & ~(shift < tol)
            if problem.host_syncs_free and not bool(active.any()):
                break
        return centers

    def _record(self, inertia, active, u_lab, new_centers) -> None:
        """Record one iteration's inertia for the active restarts, and keep it where it is their best so far."""
        self.history[:, self.step] = inertia
        self.recorded[:, self.step] = active
        self.step += 1
        better = active & (inertia < self.best_inertia)
        self.best_inertia = torch.where(better, inertia, self.best_inertia)
        self.best_lab = torch.where(better[:, None], u_lab, self.best_lab)
        self.best_centers = torch.where(better[:, None, None], new_centers, self.best_centers)

    def best_restart(self):
        """(inertia, history, n_iter, index in the batch, labels, centres) of the best restart (the first of equal
        inertias)."""
        r = int(torch.argmin(self.best_inertia))
        history = self.history[r][self.recorded[r]].tolist()
        return float(self.best_inertia[r]), history, len(history), r, self.best_lab[r], self.best_centers[r]


def _run_restarts(problem, seeds, max_iter, tol, balance, cap, frozen):
    """Run the restarts whose seeds are ``seeds`` [R, K, D] together -> :meth:`_Runs.best_restart` of the batch.
    ``cap``: room left per cluster for unlabelled points (None: unbalanced)."""
    centers, runs = seeds.clone(), _Runs(problem, seeds.shape[0], 2 * max_iter)
    if balance == "reference":  # Phase A (capacity passes only when balanced), then Phase B
        frozen_a = torch.zeros(problem.K, dtype=torch.bool, device=problem.device)
        frozen_a[: problem.n_labelled] = True
        phase_a = lambda c, it: _assign_reference_phase_a(problem, c, cap, it)
        centers = runs.iterate(problem, centers, max_iter, tol, phase_a, frozen_a)
        runs.iterate(problem, centers, max_iter, tol, lambda c, it: _assign_plain(problem, c), frozen)
    elif cap is None:
        runs.iterate(problem, centers, max_iter, tol, lambda c, it: _assign_plain(problem, c), frozen)
    else:
        cap_free = cap.clamp_min(0)
        runs.iterate(problem, centers, max_iter, tol, lambda c, it: _assign_capacity(problem, c, cap_free), frozen)
    return runs.best_restart()
