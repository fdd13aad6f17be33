"""SimGCD (Wen et al., ICCV 2023): a cosine prototype classifier trained by self-distillation between the two views,
a mean-entropy regulariser and labelled cross-entropy, beside GCD's contrastive terms on a 256-d projection
(docs/reference.md §12.2).

The prediction is the prototype head's argmax, so the method needs no per-epoch clustering.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config.settings import Config
from ..network.model import WeightNormLinear
from .base import Method, StepTensors
from .contrastive import cosine_info_nce, cosine_supcon, labelled_rows

HEAD = "prototypes"  # the name of the head's output in StepTensors.heads
TEACHER = "teacher_prototypes"  # optional: a separate teacher's logits (the no-EMA fix); absent = the published teacher


class PrototypeHead(nn.Module):
    """Cosine prototypes: the L2-normalised backbone feature times K unit-norm rows (a bias-free weight-normed Linear
    with its gain frozen at 1, keys `last_layer.weight_g` / `last_layer.weight_v` as in SimGCD's `DINOHead`)."""

    def __init__(self, feat_dim: int, n_classes: int):
        super().__init__()
        self.last_layer = WeightNormLinear(feat_dim, n_classes)

    def forward(self, features: Tensor) -> Tensor:
        return self.last_layer(F.normalize(features, dim=-1))


def teacher_temperature(epoch: int, warmup: float = 0.07, final: float = 0.04, warmup_epochs: int = 30) -> float:
    """The published schedule: `warmup_epochs` evenly spaced values from `warmup` to `final` (both included), then
    `final`. The published code builds the table for exactly `epochs` entries and fails when epochs < warmup_epochs;
    here a short run simply stops inside the warm-up."""
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if epoch >= warmup_epochs - 1:
        return final
    return warmup + (final - warmup) * epoch / (warmup_epochs - 1)


class SimGCD(Method):
    name, labels, predicts = "simgcd", "none", "head"
    # the projection is the head MLP's 256-d output (SimGCD's DINOHead returns it beside the prototype logits), and the
    # published optimiser groups biases and 1-D parameters without weight decay (`get_params_groups`)
    projection_last_layer, decay_on_1d = False, False

    @classmethod
    def from_config(cls, cfg: Config, n_old: int) -> SimGCD:
        return cls(**dataclasses.asdict(cfg.simgcd))

    def __init__(
        self,
        memax_weight: float = 2.0,
        sup_weight: float = 0.35,
        student_temperature: float = 0.1,
        warmup_teacher_temperature: float = 0.07,
        teacher_temperature: float = 0.04,
        warmup_teacher_epochs: int = 30,
        temperature: float = 1.0,
        supcon_temperature: float = 0.07,
    ):
        super().__init__()
        self.memax_weight, self.sup_weight = memax_weight, sup_weight
        self.student_temperature, self.temperature, self.supcon_temperature = (
            student_temperature,
            temperature,
            supcon_temperature,
        )
        self.schedule = (warmup_teacher_temperature, teacher_temperature, warmup_teacher_epochs)
        # a buffer, written in place each epoch: the step reads it on the device (no recompile, no capture rebuild)
        self.register_buffer("teacher_temperature", torch.tensor(warmup_teacher_temperature, dtype=torch.float32))

    def build_heads(self, feat_dim: int, n_classes: int) -> nn.ModuleDict:
        return nn.ModuleDict({HEAD: PrototypeHead(feat_dim, n_classes)})

    def set_epoch(self, epoch: int) -> None:
        self.teacher_temperature.fill_(teacher_temperature(epoch, *self.schedule))

    def prediction_centres(self, heads: nn.ModuleDict) -> Tensor:
        """The prototypes' unit rows: argmax of cos(feature, prototype) is the nearest row to the normalised
        feature."""
        layer = heads[HEAD].last_layer
        return F.normalize(torch._weight_norm(layer.weight_v, layer.weight_g, 0).detach().float(), dim=-1)

    def forward(self, step: StepTensors) -> tuple[Tensor, dict[str, Tensor]]:
        with torch.autocast(step.projection.device.type, enabled=False):
            logits = step.heads[HEAD].float()
            teacher = step.heads.get(TEACHER, logits).float().detach()
            student = logits / self.student_temperature
            labels = labelled_rows(step.targets, step.labelled)
            cls = labelled_cross_entropy(student, labels)
            distill = cross_view_distillation(student, teacher / self.teacher_temperature)
            memax = mean_entropy_gap(student)
            cluster = distill + self.memax_weight * memax
            features = F.normalize(step.projection.float(), dim=-1)
            infonce = cosine_info_nce(features, self.temperature)
            tau = self.supcon_temperature
            supcon = cosine_supcon(features, labels, tau, tau)
            w = self.sup_weight
            total = (1 - w) * cluster + w * cls + (1 - w) * infonce + w * supcon
        parts = {
            "total": total,
            "cls": cls,
            "cluster": cluster,
            "distill": distill,
            "memax": memax,
            "infonce": infonce,
            "supcon": supcon,
        }
        return total, {k: v.detach() for k, v in parts.items()}


def labelled_cross_entropy(student: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy of the rows with a label (>= 0), averaged over them; no labelled row: 0 (published: NaN)."""
    weight = (labels >= 0).to(student.dtype)
    per_row = F.cross_entropy(student, labels.clamp_min(0), reduction="none")
    return (per_row * weight).sum() / weight.sum().clamp_min(1.0)


def cross_view_distillation(student: Tensor, teacher_logits: Tensor) -> Tensor:
    """Mean over the two (teacher view, other student view) pairs of the batch-mean cross-entropy
    -sum softmax(teacher) log_softmax(student): view 0's teacher teaches view 1's student and back."""
    q = torch.softmax(teacher_logits, dim=-1).chunk(2)
    log_p = torch.log_softmax(student, dim=-1).chunk(2)
    return (-(q[0] * log_p[1]).sum(-1).mean() - (q[1] * log_p[0]).sum(-1).mean()) / 2


def mean_entropy_gap(student: Tensor) -> Tensor:
    """log K - H(mean softmax over the 2B rows): >= 0, 0 when the batch's mean prediction is uniform. Minimising it
    maximises the mean prediction's entropy, against collapsing onto a few (seen) classes."""
    mean_p = torch.softmax(student, dim=-1).mean(0)
    return torch.special.xlogy(mean_p, mean_p).sum() + math.log(mean_p.numel())
