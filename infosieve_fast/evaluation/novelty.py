"""Whether the unlabelled pool holds anything new: do its points lie as near the known classes as the labelled points?

GCD's score (estimate_k.py) cannot say "nothing new": with only known classes in the pool, k-means with a few extra
clusters still scores as well or better on the labelled points (on cub100 species 0-9, all known, the smoothed score
is highest at K = 13 and the answer was 12). This asks the pool directly. Each point's distance to the nearest
known class mean (L2-normalised features; a labelled point's own class mean leaves it out) is the statistic. Without
new classes the unlabelled points of the known classes are exchangeable with the labelled ones (GCD's split draws
both from the same classes), so the share of unlabelled points farther than the labelled points' `QUANTILE`
quantile is 1 - `QUANTILE` up to sampling noise. New classes lie farther and raise it. The excess over 1 - `QUANTILE`,
in binomial standard errors of the pool's share, is `z`; the pool holds something new when `z >= Z_NEW`.

Chosen on cub100 species 0-19 only (224 and 112 px EfficientNet-Lite0 features; benchmarks/bench_novelty.py, result
in benchmarks/results/novelty_tuning_0-19_cpu.json, command in docs/kmeans.md): ten random sets of 10 species, all
known, gave z up to 2.4 (quantile 0.8); ten of 10 known + 1 novel gave z from -0.4 to 7.4, 6 or 7 of 10 at 2.5 or
more. The quantile 0.9 did about as well (7 of 10 at both sizes), 0.95 worse (a pool of only known species at z = 2.9;
6 and 5 of 10). On held-out species 60-79 and 80-99 (the same benchmark,
novelty_heldout_*_cpu.json) no pool of only known species was said to hold something new (z at most 2.2), and one
novel species among 10 known was seen in 5 to 9 of 10 draws, two in 8 to 10, five or more in all. A novel class that
lies as near a known class as that class's own images is not seen: those miss here, and K then stays the known
classes'.

The test assumes the pool's known-class images are like the labelled ones. In a discovery loop's later round the
labelled classes include clusters exported from the round before; where those clusters were poor (CIFAR-10's
EfficientNet-Lite0 features: a third to a half of the pool left behind were images of named species that round 1
had put in known clusters), the pool is not like them and the test says "new" with nothing new in it
(docs/kmeans.md, "On another domain: CIFAR-10").
"""

from __future__ import annotations

import numpy as np
import torch

QUANTILE = 0.8
Z_NEW = 2.5
CHUNK_ROWS = 65536  # rows of the [rows, known classes] distance block at a time


def nearest_mean_distances(x: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """Each row's distance to the nearest of `means`, one block of rows at a time (in the means' dtype)."""
    blocks = (x[i : i + CHUNK_ROWS].to(means.dtype) for i in range(0, len(x), CHUNK_ROWS))
    return torch.cat([torch.cdist(block, means).min(1).values for block in blocks])


def pool_novelty(
    x: torch.Tensor, targets: np.ndarray, labelled: np.ndarray, n_old: int, quantile: float = QUANTILE
) -> dict:
    """{"quantile", "beyond" (the share of unlabelled points beyond the labelled points' quantile), "z", "new"} for
    L2-normalised features `x` [N, D], the labelled points' `targets` (classes 0..n_old-1) and the labelled mask;
    `quantile` other than `QUANTILE` only to compare quantiles (benchmarks/bench_novelty.py)."""
    lab = torch.from_numpy(np.asarray(labelled, bool)).to(x.device)
    y = torch.as_tensor(np.asarray(targets)[np.asarray(labelled, bool)], dtype=torch.long, device=x.device)
    xl = x[lab].double()
    counts = torch.bincount(y, minlength=n_old).double()
    sums = torch.zeros(n_old, x.shape[1], dtype=torch.float64, device=x.device).index_add_(0, y, xl)
    means = sums / counts.clamp_min(1)[:, None]
    own = (xl - (sums[y] - xl) / (counts[y] - 1).clamp_min(1)[:, None]).norm(dim=1)  # own mean without the point
    others = torch.cdist(xl, means).scatter_(1, y[:, None], float("inf")).min(1).values
    threshold = torch.quantile(torch.minimum(own, others), quantile).item()
    beyond = (nearest_mean_distances(x[~lab], means) > threshold).double().mean().item()
    n_pool = int((~lab).sum())
    z = (beyond - (1 - quantile)) / np.sqrt(quantile * (1 - quantile) / n_pool)
    return {"quantile": quantile, "beyond": round(beyond, 6), "z": round(float(z), 4), "new": bool(z >= Z_NEW)}
