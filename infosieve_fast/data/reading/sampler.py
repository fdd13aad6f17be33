"""Weighted sampling with a controlled labelled share (docs/reference.md §4, step 3)."""

from __future__ import annotations

import torch
from torch import Tensor


def reference_labelled_share(n_labelled: int, n_unlabelled: int) -> float:
    """The reference's expected labelled fraction: weights 1 (labelled) and L/(U+L) (unlabelled) give (U+L)/(2U+L)."""
    return (n_unlabelled + n_labelled) / (2 * n_unlabelled + n_labelled)


def sample_epoch(
    labelled: Tensor, n_samples: int, share: float | None, generator: torch.Generator, present: Tensor | None = None
) -> Tensor:
    """Indices of one epoch drawn with replacement so that labelled samples make up `share` in expectation.

    `share=None` uses the reference's weights. A share of 0 or 1 draws from one group only. `present` (bool, optional)
    leaves the other samples out, as if the dataset held only the present ones.
    """
    labelled = labelled.bool().cpu()
    present = torch.ones_like(labelled) if present is None else present.bool().cpu()
    n_lab = int((labelled & present).sum())
    n_unl = int(present.sum()) - n_lab
    if share is None:
        share = reference_labelled_share(n_lab, n_unl)
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"labelled share must be in [0, 1] (or None for the reference's), got {share}")
    if (share > 0 and n_lab == 0) or (share < 1 and n_unl == 0):
        raise ValueError(f"labelled share {share} needs both labelled ({n_lab}) and unlabelled ({n_unl}) samples")
    weights = torch.where(labelled, share / max(n_lab, 1), (1.0 - share) / max(n_unl, 1)).double() * present
    return torch.multinomial(weights, n_samples, replacement=True, generator=generator)
