"""The published SimGCD head and training step's loss (docs/reference.md §12.2), transcribed from that description.

`SimGCDHead` is its `DINOHead`: the MLP to the 256-d projection (not normalised) and, beside it, a weight-normed
bias-free Linear on the L2-normalised backbone feature. The loss keeps the published structure: logits / 0.1,
`f[mask_lab]` selection, the teacher = the same output detached, `DistillLoss` with its numpy temperature table, the
mean-entropy term written as -sum log(p^-p) + log K, and GCD's cosine InfoNCE and SupCon (on the normalised
projection of the labelled samples).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .gcd import SupConLoss, info_nce_logits
from .model import _stack, _trunc_normal_init


class SimGCDHead(nn.Module):
    def __init__(self, in_dim, out_dim, nlayers=3, hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        self.mlp = _stack(in_dim, hidden_dim, bottleneck_dim, nlayers - 2, False)
        self.apply(_trunc_normal_init)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self.last_layer = nn.utils.weight_norm(nn.Linear(in_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        x_proj = self.mlp(x)
        return x_proj, self.last_layer(F.normalize(x, dim=-1, p=2))


class DistillLoss(nn.Module):
    def __init__(self, warmup_teacher_temp_epochs, nepochs, ncrops=2, warmup_teacher_temp=0.07, teacher_temp=0.04,
                 student_temp=0.1):  # fmt: skip
        super().__init__()
        self.student_temp, self.ncrops = student_temp, ncrops
        self.teacher_temp_schedule = np.concatenate(
            (
                np.linspace(warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs),
                np.ones(nepochs - warmup_teacher_temp_epochs) * teacher_temp,
            )
        )

    def forward(self, student_output, teacher_output, epoch):
        student_out = (student_output / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax(teacher_output / temp, dim=-1).detach().chunk(2)
        total, n_terms = 0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                total += torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1).mean()
                n_terms += 1
        return total / n_terms


def simgcd_loss(student_proj, student_out, class_labels, mask_lab, epoch, cluster_criterion, memax_weight=2.0,
                sup_weight=0.35):  # fmt: skip
    """One step's loss from the head's outputs (x_proj [2B, 256], logits [2B, K]): (total, parts)."""
    mask_lab = mask_lab.bool()
    teacher_out = student_out.detach()
    sup_logits = torch.cat([f[mask_lab] for f in (student_out / 0.1).chunk(2)], dim=0)
    sup_labels = torch.cat([class_labels[mask_lab] for _ in range(2)], dim=0)
    cls = nn.CrossEntropyLoss()(sup_logits, sup_labels)
    distill = cluster_criterion(student_out, teacher_out, epoch)
    avg_probs = (student_out / 0.1).softmax(dim=1).mean(dim=0)
    memax = -torch.sum(torch.log(avg_probs ** (-avg_probs))) + math.log(float(len(avg_probs)))
    cluster = distill + memax_weight * memax
    logits, labels = info_nce_logits(student_proj)
    infonce = nn.CrossEntropyLoss()(logits, labels)
    proj = torch.cat([f[mask_lab].unsqueeze(1) for f in student_proj.chunk(2)], dim=1)
    supcon = SupConLoss()(F.normalize(proj, dim=-1), labels=class_labels[mask_lab])
    total = (1 - sup_weight) * cluster + sup_weight * cls + (1 - sup_weight) * infonce + sup_weight * supcon
    parts = dict(cls=cls, cluster=cluster, distill=distill, memax=memax, infonce=infonce, supcon=supcon)
    return total, parts
