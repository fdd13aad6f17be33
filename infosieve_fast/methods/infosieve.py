"""InfoSieve (docs/reference.md §3) through the method interface: the existing `InfoSieveLoss`, unchanged.

Its labeller reads the normalised projection rather than the backbone features, and
`infosieve_fast.network.model.InfoSieve` builds and runs it (`Method.labeller`), so the loss reads the model's whole
output, which every step passes as `StepTensors.heads[MODEL_OUTPUT]`."""

from __future__ import annotations

from torch import Tensor

from ..config.settings import Config, LossConfig
from ..network.loss import InfoSieveLoss
from .base import MODEL_OUTPUT, Method, StepTensors


class InfoSieve(Method):
    name, labels, predicts = "infosieve", "kmeans", "kmeans"
    labeller = True

    @classmethod
    def from_config(cls, cfg: Config, n_old: int) -> InfoSieve:
        return cls(cfg.loss, n_old, cfg.train.kernels)

    def __init__(self, cfg: LossConfig, n_old: int, backend: str = "auto"):
        super().__init__()
        self.loss = InfoSieveLoss(cfg, n_old, backend)

    def forward(self, step: StepTensors) -> tuple[Tensor, dict[str, Tensor]]:
        if step.pseudo is None:
            raise ValueError("InfoSieve's loss needs the batch's SS-k-means pseudo-labels (StepTensors.pseudo)")
        return self.loss(step.heads[MODEL_OUTPUT], step.targets, step.labelled, step.pseudo)
