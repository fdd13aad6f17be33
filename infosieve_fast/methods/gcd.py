"""GCD (Vaze et al., CVPR 2022): InfoNCE and ground-truth SupCon on cosine similarities (docs/reference.md §12.1).

No extra head and no training labels: the loss reads the projection and the ground truth only; the prediction is
SS-k-means on backbone features, as for InfoSieve.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config.settings import Config
from .base import Method, StepTensors
from .contrastive import cosine_info_nce, cosine_supcon, labelled_rows


class GCD(Method):
    name, labels, predicts = "gcd", "none", "kmeans"

    @classmethod
    def from_config(cls, cfg: Config, n_old: int) -> GCD:
        return cls(**dataclasses.asdict(cfg.gcd))

    def __init__(self, sup_con_weight: float = 0.35, temperature: float = 1.0, supcon_temperature: float = 0.07):
        super().__init__()
        self.sup_con_weight, self.temperature, self.supcon_temperature = sup_con_weight, temperature, supcon_temperature

    def forward(self, step: StepTensors) -> tuple[Tensor, dict[str, Tensor]]:
        with torch.autocast(step.projection.device.type, enabled=False):
            features = F.normalize(step.projection.float(), dim=-1)
            infonce = cosine_info_nce(features, self.temperature)
            tau = self.supcon_temperature
            supcon = cosine_supcon(features, labelled_rows(step.targets, step.labelled), tau, tau)
            total = (1 - self.sup_con_weight) * infonce + self.sup_con_weight * supcon
        parts = {"total": total, "infonce": infonce, "supcon": supcon}
        return total, {k: v.detach() for k, v in parts.items()}
