"""The published SelEx training step's loss (docs/reference.md §12.3), transcribed from that description, fp32.

Kept in the published structure on purpose: the per-epoch radii from the level centres; per step, under no_grad, the
backbone features detached and NOT normalised, `torch.cdist` distances, the per-level one-hot cluster indexer and
momentum update of the radii (in place in the caller's list), the zero-one confusion accumulated level by level, its
min-max scaling and the broadcast division by the row sums; then the InfoNCE logits and the confusion laid out
[positive, negatives] by boolean-mask selection, `CrossEntropyLoss` on the soft target, the Euclidean SupCon of the
InfoSieve transcription (`model.SupConLoss`) on the labelled samples and on every level's prefix, and the published
composition (1 - w) InfoNCE + w SupCon / 2.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .model import SupConLoss


def initial_radii(protos_list):
    """Per level: half the distance from each centre to its nearest other centre."""
    radii = []
    for protos in protos_list:
        d = torch.cdist(protos, protos)
        radii.append((d + torch.eye(d.shape[0], device=d.device) * d.max()).min(dim=1)[0] / 2)
    return radii


def batch_level_labels(preds_ind_list, uq_index, uq_idxs):
    """Each level's labels of the batch: the table looked up at the position of each unique index."""
    return [preds[np.argsort(uq_index)[uq_idxs]].clone() for preds in preds_ind_list]


def confusion_factor(all_features, level_labels, protos_list, radius_list, n_labeled, n_unlabeled, momentum=1.0):
    pair_dist = torch.cdist(all_features, all_features)
    confusion = 0
    for i, cluster_labels in enumerate(level_labels):
        indexer = F.one_hot(cluster_labels.long(), n_labeled + n_unlabeled).float().T
        n_labeled, n_unlabeled = max(int(n_labeled / 2), 1), max(int(n_unlabeled / 2), 1)
        indexer = torch.cat([indexer, indexer], dim=1)
        n_samples = torch.sum(indexer, dim=1).unsqueeze(1)
        n_samples[n_samples == 0] = 1
        distance = torch.cdist(all_features, protos_list[i].float())
        radius_list[i] = (indexer * distance.T).sum(dim=1) / n_samples.squeeze() * (1 - momentum) + radius_list[
            i
        ] * momentum
        cluster_labels = torch.cat([cluster_labels, cluster_labels])
        confusion += (pair_dist > 2 * radius_list[i][cluster_labels]).float() / 2**i
    confusion = (confusion - confusion.min()) / (confusion.max() - confusion.min() + 0.0000001)
    return confusion / confusion.sum(dim=1)


def info_nce_logits(features, confusion, n_views=2, temperature=1.0):
    dev = features.device
    half = features.shape[0] // 2
    ids = torch.cat([torch.arange(half) for _ in range(n_views)], dim=0)
    same = (ids[None, :] == ids[:, None]).float().to(dev)
    features = F.normalize(features, dim=1)
    sim = -torch.cdist(features, features)
    off_diag = ~torch.eye(same.shape[0], dtype=torch.bool, device=dev)
    same = same[off_diag].view(same.shape[0], -1)
    sim = sim[off_diag].view(sim.shape[0], -1)
    confusion = confusion[off_diag].view(confusion.shape[0], -1)
    positives = sim[same.bool()].view(same.shape[0], -1)
    pos_confs = confusion[same.bool()].view(confusion.shape[0], -1)
    negatives = sim[~same.bool()].view(sim.shape[0], -1)
    neg_confs = confusion[~same.bool()].view(confusion.shape[0], -1)
    logits = torch.cat([positives, negatives], dim=1) / temperature
    confs = torch.cat([pos_confs, neg_confs], dim=1)
    return logits, torch.zeros(logits.shape[0], dtype=torch.long, device=dev), confs


def label_smoothing_loss(logits, target, similarity, smoothing):
    soft = F.one_hot(target, logits.size(1)).float() * (1 - smoothing) + smoothing * similarity
    return nn.CrossEntropyLoss()(logits, soft)


def selex_loss(backbone_out, projection, class_labels, mask_lab, level_labels, protos_list, radius_list, n_old,
               n_new, smoothing=1.0, momentum=1.0, sup_con_weight=0.35, temperature=1.0):  # fmt: skip
    """One step's loss: `backbone_out` [2B, F] the backbone's CLS output, `projection` [2B, D] the head's output,
    `level_labels` each level's [B] labels of the batch. Returns (total, parts)."""
    mask_lab = mask_lab.bool()
    all_features = torch.cat(backbone_out.detach().chunk(2), dim=0)
    features = F.normalize(projection, dim=-1)
    with torch.no_grad():
        confusion = confusion_factor(all_features, level_labels, protos_list, radius_list, n_old, n_new, momentum)
    logits, targets, similarity = info_nce_logits(features, confusion, temperature=temperature)
    infonce = label_smoothing_loss(logits, targets, similarity, smoothing)
    f1n, f2n = features.chunk(2)
    semisup = torch.cat([f1n.unsqueeze(1), f2n.unsqueeze(1)], dim=1)
    f1, f2 = (f[mask_lab] for f in features.chunk(2))
    sup_con_crit = SupConLoss()
    supcon_gt = sup_con_crit(torch.cat([f1.unsqueeze(1), f2.unsqueeze(1)], dim=1), labels=class_labels[mask_lab])
    supcon = supcon_gt
    dimension = semisup.shape[-1]
    for i in range(len(level_labels)):
        supcon = supcon + sup_con_crit(semisup[:, :, : int(dimension / 2 ** (i + 1))], labels=level_labels[i]) / 2 ** (
            i + 1
        )
    total = (1 - sup_con_weight) * infonce + sup_con_weight * supcon / 2
    return total, {"infonce": infonce, "supcon": supcon, "supcon_gt": supcon_gt}
