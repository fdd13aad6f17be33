"""InfoSieve (docs/reference.md §3) through the method interface: the existing `InfoSieveLoss`, unchanged.

Its labeller reads the normalised projection rather than the backbone features, and
`infosieve_fast.network.model.InfoSieve` builds and runs it today, so the step passes that model's whole output as the
head output `MODEL_OUTPUT`."""

from __future__ import annotations

from torch import Tensor

from ..config.settings import LossConfig
from ..network.loss import InfoSieveLoss
from .base import Method, StepTensors

MODEL_OUTPUT = "model_output"  # StepTensors.heads entry: the InfoSieve model's ModelOutput


class InfoSieve(Method):
    name, labels, predicts = "infosieve", "kmeans", "kmeans"

    def __init__(self, cfg: LossConfig, n_old: int, backend: str = "auto"):
        super().__init__()
        self.loss = InfoSieveLoss(cfg, n_old, backend)

    def forward(self, step: StepTensors) -> tuple[Tensor, dict[str, Tensor]]:
        if step.pseudo is None:
            raise ValueError("InfoSieve's loss needs the batch's SS-k-means pseudo-labels (StepTensors.pseudo)")
        return self.loss(step.heads[MODEL_OUTPUT], step.targets, step.labelled, step.pseudo)
