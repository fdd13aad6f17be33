"""InfoSieve's loss math in plain PyTorch (docs/reference.md §3): the oracle for the Triton kernels and the CPU path.

Conventions shared with the fused kernels:
- Contrastive inputs are view-major: rows [view-0 of B samples; view-1 of the same B samples], N = 2B.
- Distances are non-squared Euclidean, the diagonal is exactly 0, and the gradient through a zero distance is 0
  (as in `torch.cdist`'s backward).
- SupCon takes a label per row; a label of -1 removes the row from the loss as anchor and as contrast, so the
  ground-truth-only and pseudo-label terms are one function with different label vectors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

# Shared with the Triton kernels, which read them as constexprs.
ROW_SUM_EPS = 1e-10  # the reference's `dist.sum(dim=1) + 1e-10` in the row-sum normalisation of distances
NORM_EPS = 1e-12  # F.normalize's eps: rows shorter than this are divided by it, not by their norm


class CodeHead(NamedTuple):
    """The labeller's elementwise block and its three regularisers (docs/reference.md §2.3, §3.3-3.5)."""

    code_raw: Tensor  # tanh(age * code_feat), in (-1, 1)
    mask: Tensor  # (tanh(mask_feat + 1/(age+1)) + 1) / 2, in (0, 1)
    code: Tensor  # code_raw * code_weight (positional weighting, not masked)
    trunc_code: Tensor  # mask * code
    code_cond: Tensor  # mean(1 - z^2) + mean_k(mean_i z_ik)^2
    mask_cond: Tensor  # mean((m (1 - m))^2)
    length: Tensor  # sum_ik m_ik / w_k / sum_k (1 / w_k), fp32, a batch sum as in the reference


def positional_weights(length: int, base: float, *, device=None, dtype=torch.float32) -> Tensor:
    """w_k = base^(-k), k = 0..length-1 (docs/reference.md §2.3)."""
    k = torch.arange(length, dtype=torch.float64, device=device)
    return torch.pow(torch.as_tensor(float(base), dtype=torch.float64, device=device), -k).to(dtype)


def code_head(code_feat: Tensor, mask_feat: Tensor, age: float, code_weight: Tensor, length_weight: Tensor) -> CodeHead:
    """Binarise codes and mask, weight by position, truncate, and compute the code/mask/length terms.

    `code_feat`, `mask_feat`: coder and masker pre-activations [N, L]. `code_weight` [L] weights the code;
    `length_weight` [L] weights the length term (the reference keeps the stale base-2 weights there).
    """
    code_raw = torch.tanh(code_feat * age)
    mask = (torch.tanh(mask_feat + 1.0 / (age + 1.0)) + 1.0) / 2.0
    code = code_raw * code_weight.to(code_raw.dtype)
    trunc_code = mask * code
    code_cond = (1.0 - code_raw.pow(2)).mean() + code_raw.mean(0).pow(2).mean()
    mask_cond = (mask * (1.0 - mask)).pow(2).mean()
    return CodeHead(code_raw, mask, code, trunc_code, code_cond, mask_cond, length_loss(mask, length_weight))


def length_loss(mask: Tensor, length_weight: Tensor) -> Tensor:
    """`NormPLoss(p=1)`: ||m / w||_1 over the batch / ||1 / w||_1, in at least fp32 (2^39 overflows fp16)."""
    dtype = torch.promote_types(mask.dtype, torch.float32)
    inv_w = 1.0 / length_weight.to(device=mask.device, dtype=dtype)
    return (mask.to(dtype) * inv_w).abs().sum() / inv_w.abs().sum()


def pairwise_distances(x: Tensor) -> Tensor:
    """Euclidean distances [N, N] from the Gram matrix, clamped at 0, exact-zero diagonal, zero gradient at 0."""
    sq = x.pow(2).sum(1)
    d2 = (sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)).clamp_min(0.0)
    eye = torch.eye(x.shape[0], dtype=torch.bool, device=x.device)
    positive = (d2 > 0) & ~eye
    return torch.where(positive, torch.where(positive, d2, torch.ones_like(d2)).sqrt(), torch.zeros_like(d2))


def contrastive_logits(x: Tensor, temperature: float, rowsum_normalize: bool) -> Tensor:
    """-d / T, or with `rowsum_normalize` -d_ij / (sum_k d_jk + ROW_SUM_EPS) / T: column j divided by row j's sum, as
    the reference does for the codes (its `is_code=True`, docs/reference.md §3.2)."""
    d = pairwise_distances(x)
    if rowsum_normalize:
        d = d / (d.sum(1)[None, :] + ROW_SUM_EPS)
    return -d / temperature


def info_nce_loss(
    features: Tensor,
    temperature: float = 1.0,
    label_smoothing: float = 0.0,
    rowsum_normalize: bool = False,
    smoothing_target: Tensor | None = None,
) -> Tensor:
    """Euclidean InfoNCE over 2 views with label smoothing: CE(label_smoothing) over `info_nce_logits` (§3.1).

    Row i's positive is its other view (i ± B); the self column is dropped, so each row has 2B-1 classes and
    loss_i = (1 - s)(-log p_pos) + s * mean_c(-log p_c). With `smoothing_target` C [2B, 2B] (a constant: no gradient
    reaches it) the smoothing term is s * sum_{j != i} C_ij (-log p_ij) instead, C's rows free to sum to anything
    (SelEx's soft targets, docs/reference.md §12.3).
    """
    n = features.shape[0]
    if n < 2 or n % 2:
        raise ValueError(f"features must hold 2 views of B >= 1 samples (an even number of rows), got {n} rows")
    logits = contrastive_logits(F.normalize(features, dim=1, eps=NORM_EPS), temperature, rowsum_normalize)
    eye = torch.eye(n, dtype=torch.bool, device=features.device)
    log_p = torch.log_softmax(logits.masked_fill(eye, float("-inf")), dim=1).masked_fill(eye, 0.0)
    rows = torch.arange(n, device=features.device)
    nll_positive = -log_p[rows, (rows + n // 2) % n]
    if smoothing_target is None:
        nll_smoothed = -log_p.sum(1) / (n - 1)
    else:
        nll_smoothed = -(smoothing_target.detach().to(log_p.dtype).masked_fill(eye, 0.0) * log_p).sum(1)
    return ((1.0 - label_smoothing) * nll_positive + label_smoothing * nll_smoothed).mean()


def supcon_loss(
    features: Tensor,
    labels: Tensor,
    temperature: float = 0.07,
    base_temperature: float = 0.07,
    rowsum_normalize: bool = False,
) -> Tensor:
    """Euclidean SupCon (`contrast_mode='all'`) over the rows whose label is not -1 (§3.1, §3.2).

    Anchors without any positive among the kept rows have no term and are left out of the mean (with two views of
    every labelled sample this never happens); with no anchor at all the loss is 0.
    """
    if labels.shape != features.shape[:1]:
        raise ValueError(
            f"labels must have one entry per feature row: {tuple(labels.shape)} vs {tuple(features.shape)}"
        )
    keep = labels >= 0
    x, y = features[keep], labels[keep]
    eye = torch.eye(x.shape[0], dtype=torch.bool, device=x.device)
    positives = (y[:, None] == y[None, :]) & ~eye
    log_prob_pos, n_pos = supcon_anchor_terms(contrastive_logits(x, temperature, rowsum_normalize), positives)
    has_pos = n_pos > 0
    if not bool(has_pos.any()):
        return features.sum() * 0.0
    return -(temperature / base_temperature) * (log_prob_pos[has_pos] / n_pos[has_pos]).mean()


def supcon_anchor_terms(logits: Tensor, positives: Tensor) -> tuple[Tensor, Tensor]:
    """SupCon's per-anchor sums: sum_j w_ij log p_ij and sum_j w_ij for anchor rows i.

    `logits` [A, N]: anchor i's own column is i, left out of the softmax p_i. `positives` [A, N]: the weights w (bool
    or float, 0 on the own column). The anchor's term is their ratio (0 / 0 for an anchor without a positive).
    """
    own = torch.eye(*logits.shape, dtype=torch.bool, device=logits.device)
    log_prob = logits - torch.logsumexp(logits.masked_fill(own, float("-inf")), dim=1, keepdim=True)
    return (log_prob * positives).sum(1), positives.sum(1)


def info_nce_and_supcon(
    features: Tensor,
    supcon_labels: list[Tensor],
    temperature: float = 1.0,
    label_smoothing: float = 0.0,
    supcon_temperature: float = 0.07,
    base_temperature: float = 0.07,
    rowsum_normalize: bool = False,
    smoothing_target: Tensor | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """`info_nce_loss` and one `supcon_loss` per label vector on the same features (the fused twin shares their Gram
    matrix)."""
    nce = info_nce_loss(features, temperature, label_smoothing, rowsum_normalize, smoothing_target)
    return nce, [
        supcon_loss(features, y, supcon_temperature, base_temperature, rowsum_normalize) for y in supcon_labels
    ]
