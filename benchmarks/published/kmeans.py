"""The reference's loop-based semi-supervised k-means, transcribed from docs/reference.md §5.1 / §5.2.

Written from the description (not from the published code) to serve as the timing baseline of ``bench_kmeans.py`` and
as the oracle of ``tests/test_kmeans.py``. It keeps the reference's structure on purpose: k-means++ recomputes the
distances to every centre for every new seed (O(N·K²·D)), the distance matrix is built in 1024-row chunks on the CPU,
and centre updates and balancing passes loop over the clusters in Python.

Switches (defaults = the published behaviour):
* ``variant``: ``"gcd"`` (§5.1, one phase) or ``"infosieve"`` (§5.2, Phase A with frozen labelled centres and
  optional balancing, then Phase B).
* ``kpp_deletion`` (infosieve with a cluster size): ``"bug"`` (the published row deletion), ``"fixed"`` (drop the
  ``cluster_size`` rows nearest the new seed) or ``"none"``.
* ``empty``: ``"nan"`` (an empty cluster's mean is NaN, as published) or ``"keep"`` (keep the old centre).
* ``sqdist_mode``: ``"gemm"`` (||a||² - 2ab + ||b||² per chunk) or ``"broadcast"`` ((a - b)² summed per chunk, much
  slower and closer to the published chunked distance); the algorithm is the same.
"""

from __future__ import annotations

import numpy as np
import torch


def sqdist(a: torch.Tensor, b: torch.Tensor, batch_size: int = 1024, mode: str = "gemm") -> torch.Tensor:
    """Squared Euclidean distances [len(a), len(b)], built in ``batch_size``-row chunks into a CPU tensor."""
    out = torch.zeros(a.shape[0], b.shape[0], dtype=a.dtype)
    b2 = (b * b).sum(1)
    for i in range(0, a.shape[0], batch_size):
        ac = a[i : i + batch_size]
        if mode == "broadcast":
            out[i : i + batch_size] = ((ac[:, None, :] - b[None, :, :]) ** 2).sum(-1).cpu()
        else:
            out[i : i + batch_size] = ((ac * ac).sum(1)[:, None] - 2 * ac @ b.t() + b2[None, :]).clamp_min(0).cpu()
    return out


class ReferenceSSKMeans:
    def __init__(
        self,
        k: int,
        n_init: int = 10,
        max_iter: int = 10,
        tol: float = 1e-4,
        random_state=None,
        cluster_size: int | None = None,
        variant: str = "gcd",
        kpp_deletion: str = "bug",
        empty: str = "nan",
        sqdist_mode: str = "gemm",
    ):
        self.k, self.n_init, self.max_iter, self.tol = k, n_init, max_iter, tol
        self.random_state = random_state
        self.cluster_size = cluster_size
        self.variant, self.kpp_deletion, self.empty, self.sqdist_mode = variant, kpp_deletion, empty, sqdist_mode
        self.seed_indices: list[list[int]] = []  # per run: index of each new seed in the (shrinking) array

    def _d(self, a, b):
        return sqdist(a, b, mode=self.sqdist_mode)

    # ---------------------------------------------------------------------------------------------------- k-means++
    def kpp(self, X, pre_centers, rs, cs=None):
        C = pre_centers.clone()
        ind = 0
        picked = []
        while C.shape[0] < self.k:
            dist = self._d(X, C)
            d2 = dist.min(1).values
            cum = torch.cumsum(d2 / d2.sum(), 0)
            r = rs.rand()
            hit = torch.nonzero(cum >= r)
            if hit.numel():
                ind = int(hit[0, 0])
            picked.append(ind)
            C = torch.cat([C, X[ind : ind + 1]], 0)
            if self.variant == "infosieve" and cs is not None and self.kpp_deletion != "none":
                if self.kpp_deletion == "bug":
                    ignored = torch.argsort(dist[ind])[:cs]  # indices of centres, used as rows of X
                else:
                    ignored = torch.argsort(self._d(X, X[ind : ind + 1])[:, 0])[:cs]
                keep = torch.ones(X.shape[0], dtype=torch.bool)
                keep[ignored] = False
                X = X[keep]
        self.seed_indices.append(picked)
        return C

    # ----------------------------------------------------------------------------------------------------- helpers
    def _update(self, X, labels, centers, ks):
        for k in ks:
            sel = X[labels == k]
            if sel.shape[0] == 0 and self.empty == "keep":
                continue
            centers[k] = sel.mean(0)

    def _inertia(self, Dm, u_lab_unbal, l, centers, lab_l):
        return float(Dm.min(1).values.sum() + ((l - centers[lab_l]) ** 2).sum())

    def _balance(self, Dm, u_lab, cs, cnt_l, passes):
        K = self.k
        for _ in range(passes):
            free = torch.zeros(u_lab.shape[0], dtype=torch.bool)
            room = torch.zeros(K, dtype=torch.bool)
            for k in range(K):
                mem = torch.nonzero(u_lab == k)[:, 0]
                cap = cs - int(cnt_l[k])
                if mem.numel() == 1 or mem.numel() < cap:
                    room[k] = True
                elif mem.numel() > cap:
                    order = torch.argsort(Dm[mem, k])
                    free[mem[order[cap:]]] = True
            if room.any():
                rk = torch.nonzero(room)[:, 0]
                fi = torch.nonzero(free)[:, 0]
                u_lab[fi] = rk[torch.argmin(Dm[fi][:, rk], 1)]
        return u_lab

    # ------------------------------------------------------------------------------------------------------ one run
    def fit_mix_once(self, u, l, t, rs):
        K = self.k
        cls = torch.unique(t).sort().values
        nL = cls.numel()
        lab_l = torch.searchsorted(cls, t)
        C_l = torch.stack([l[lab_l == c].mean(0) for c in range(nL)]) if nL else u[:0]
        cs = self.cluster_size if self.variant == "infosieve" else None
        centers = self.kpp(u, C_l, rs, cs)
        X = torch.cat([l, u], 0)
        best = None
        history = []

        def step(centers, ks, balance_passes):
            nonlocal best
            old = centers.clone()
            Dm = self._d(u, centers)
            u_lab = torch.argmin(Dm, 1)
            inertia = self._inertia(Dm, u_lab, l, centers, lab_l)
            if balance_passes is not None and cs is not None:
                cnt_l = torch.bincount(lab_l, minlength=K)
                u_lab = self._balance(Dm, u_lab, cs, cnt_l, balance_passes)
            labels = torch.cat([lab_l, u_lab.to(lab_l.device)])  # the published code moves labels between devices
            self._update(X, labels, centers, ks)
            history.append(inertia)
            if best is None or inertia < best[2]:
                best = (labels.clone(), centers.clone(), inertia)
            shift = sum(float(torch.norm(centers[k] - old[k])) for k in range(K))
            return shift**2 < self.tol

        if self.variant == "infosieve":
            for it in range(self.max_iter):  # Phase A: only novel centres move
                if step(centers, range(nL, K), it):
                    break
        for _ in range(self.max_iter):  # GCD / Phase B: all centres move
            if step(centers, range(K), None):
                break
        return best[0], best[2], best[1], history

    def fit_mix(self, u, l, t):
        rs = self.random_state
        if rs is None:
            rs = np.random.mtrand._rand  # numpy's global RandomState, as check_random_state(None)
        elif not isinstance(rs, np.random.RandomState):
            rs = np.random.RandomState(rs)
        best = None
        for _ in range(self.n_init):
            labels, inertia, centers, history = self.fit_mix_once(u, l, t, rs)
            if best is None or inertia < best[1]:
                best = (labels, inertia, centers, history)
        self.labels_, self.inertia_, self.cluster_centers_, self.history_ = best
        return self
