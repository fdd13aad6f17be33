"""Cosine-similarity InfoNCE and SupCon, as GCD and SimGCD use them (docs/reference.md §12.1), without host syncs.

The fused kernels of `infosieve_kernels` compute logits from Euclidean distances (InfoSieve, SelEx); a cosine logit
is another elementwise map of the Gram matrix, so these run in PyTorch: one [N, N] Gram (the GEMM dominates) plus
elementwise work on it, with every row kept and masked rather than indexed by a boolean mask (which waits for the
device). Inputs are fp32 rows the caller has L2-normalised.
"""

from __future__ import annotations

import torch
from torch import Tensor


def cosine_info_nce(features: Tensor, temperature: float = 1.0) -> Tensor:
    """InfoNCE over 2 views: row i's positive is its other view (i +- B), every other row but itself a negative,
    logits cos / T, cross-entropy without smoothing, mean over the 2B rows."""
    n = features.shape[0]
    if n < 2 or n % 2:
        raise ValueError(f"features must hold 2 views of B >= 1 samples (an even number of rows), got {n} rows")
    eye = torch.eye(n, dtype=torch.bool, device=features.device)
    logits = (features @ features.T / temperature).masked_fill(eye, float("-inf"))
    rows = torch.arange(n, device=features.device)
    return -torch.log_softmax(logits, dim=1)[rows, (rows + n // 2) % n].mean()


def cosine_supcon(features: Tensor, labels: Tensor, temperature: float = 0.07, base_temperature: float = 0.07):
    """SupCon (`contrast_mode='all'`) on cos / tau over the rows whose label is not -1; each anchor's term is the
    mean log-probability of its positives (the other kept rows with its label), the loss the mean over the anchors
    with a positive, times -(tau / base tau). No anchor: 0 (the published code gives NaN for an empty batch)."""
    n = features.shape[0]
    keep = labels >= 0
    eye = torch.eye(n, dtype=torch.bool, device=features.device)
    pair = keep[:, None] & keep[None, :] & ~eye
    positive = pair & (labels[:, None] == labels[None, :])
    logits = features @ features.T / temperature
    # a row without any pair gets a finite dummy row, so neither its value nor its gradient is NaN
    masked = torch.where(pair.any(1, keepdim=True), logits.masked_fill(~pair, float("-inf")), 0.0)
    log_prob = logits - torch.logsumexp(masked, dim=1, keepdim=True)
    n_pos = positive.sum(1)
    per_anchor = torch.where(positive, log_prob, 0.0).sum(1) / n_pos.clamp_min(1)
    anchor = (n_pos > 0).to(features.dtype)
    return -(temperature / base_temperature) * (per_anchor * anchor).sum() / anchor.sum().clamp_min(1.0)


def labelled_rows(targets: Tensor, labelled: Tensor) -> Tensor:
    """[2B] labels of both views: the ground truth on labelled samples, -1 (no label) elsewhere."""
    return torch.where(labelled.bool(), targets.long(), -1).repeat(2)
