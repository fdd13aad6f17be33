"""The published GCD training step's loss (docs/reference.md §12.1), transcribed from that description, fp32.

Kept in the published structure on purpose: the InfoNCE logits laid out as [positive, negatives in increasing order]
by boolean-mask selection, `CrossEntropyLoss` with target 0, and HobbitLong's SupCon on dot products of the
normalised features of the labelled samples (selected with `features[mask_lab]`). SimGCD reuses both pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SupConLoss(nn.Module):
    """SupCon with dot-product logits (`contrast_mode='all'`, anchors view-major), features [bsz, n_views, D]."""

    def __init__(self, temperature=0.07, base_temperature=0.07):
        super().__init__()
        self.temperature, self.base_temperature = temperature, base_temperature

    def forward(self, features, labels):
        dev = features.device
        bsz, n_views = features.shape[:2]
        col = labels.contiguous().view(-1, 1)
        pos = (col == col.T).float().to(dev)
        contrast = torch.cat(torch.unbind(features, dim=1), dim=0)
        scores = contrast @ contrast.T / self.temperature
        scores = scores - scores.max(dim=1, keepdim=True).values.detach()
        pos = pos.repeat(n_views, n_views)
        n_rows = bsz * n_views
        not_self = torch.ones_like(pos).scatter(1, torch.arange(n_rows, device=dev).view(-1, 1), 0)
        pos = pos * not_self
        log_prob = scores - torch.log((scores.exp() * not_self).sum(1, keepdim=True))
        mean_pos = (pos * log_prob).sum(1) / pos.sum(1)
        return (-(self.temperature / self.base_temperature) * mean_pos).view(n_views, bsz).mean()


def info_nce_logits(features, n_views=2, temperature=1.0):
    """Cosine logits [2B, 2B-1], the other view in column 0, and zero targets."""
    dev = features.device
    half = features.shape[0] // 2
    ids = torch.cat([torch.arange(half) for _ in range(n_views)], dim=0)
    same = (ids[None, :] == ids[:, None]).float().to(dev)
    features = F.normalize(features, dim=1)
    sim = features @ features.T
    off_diag = ~torch.eye(same.shape[0], dtype=torch.bool, device=dev)
    same = same[off_diag].view(same.shape[0], -1)
    sim = sim[off_diag].view(sim.shape[0], -1)
    positives = sim[same.bool()].view(same.shape[0], -1)
    negatives = sim[~same.bool()].view(sim.shape[0], -1)
    logits = torch.cat([positives, negatives], dim=1) / temperature
    return logits, torch.zeros(logits.shape[0], dtype=torch.long, device=dev)


def gcd_loss(projection, class_labels, mask_lab, sup_con_weight=0.35, temperature=1.0):
    """One step's loss from the projection head's output [2B, D]: (total, {"infonce", "supcon"})."""
    mask_lab = mask_lab.bool()
    features = F.normalize(projection, dim=-1)
    logits, targets = info_nce_logits(features, temperature=temperature)
    infonce = nn.CrossEntropyLoss()(logits, targets)
    f1, f2 = (f[mask_lab] for f in features.chunk(2))
    supcon = SupConLoss()(torch.cat([f1.unsqueeze(1), f2.unsqueeze(1)], dim=1), labels=class_labels[mask_lab])
    total = (1 - sup_con_weight) * infonce + sup_con_weight * supcon
    return total, {"infonce": infonce, "supcon": supcon}
