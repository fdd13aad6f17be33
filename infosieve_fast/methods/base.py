"""What a GCD method provides to the shared engine: its extra heads, its loss, and how it labels the train set.

Everything else (backbone, projection head, two-view sampler, augmentation, bf16 forward, optimiser, SS-k-means,
evaluators, run folder) is shared. A method is a `Method` module: its loss is `forward`, its per-epoch state (a
schedule, a hierarchy) lives in buffers updated in place, so a compiled or graph-captured step never recompiles for a
new epoch and never reads the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor, nn

if TYPE_CHECKING:
    from ..config.settings import Config
    from .selex_hierarchy import ClusterFn

# What the training loss reads each epoch, computed before the epoch's steps (docs/reference.md §12):
# "kmeans": one SS-k-means pseudo-label per train sample; "hierarchy": one per sample and level (SelEx);
# "none": nothing (GCD, SimGCD), so the engine skips the per-epoch feature pass and clustering. A "hierarchy" method
# builds its levels from the epoch's SS-k-means round (`label_levels`).
LABELS = ("kmeans", "hierarchy", "none")
# The StepTensors.heads entry that holds the whole model output (`network.model.ModelOutput`), beside the method's
# own heads: InfoSieve's loss reads the labeller's outputs from it.
MODEL_OUTPUT = "model_output"
# How the method predicts a class: SS-k-means on backbone features, or the argmax of its prototype head.
PREDICTIONS = ("kmeans", "head")


@dataclass
class StepTensors:
    """One step's tensors. Rows are view-major: view 0 of the B samples, then view 1 of the same samples (2B)."""

    backbone: Tensor  # [2B, F] backbone CLS features as the backbone returns them (not normalised)
    projection: Tensor  # [2B, D] projection-head output; every method normalises it itself
    targets: Tensor  # [B] ground-truth classes, read only where `labelled`
    labelled: Tensor  # [B] bool
    pseudo: Tensor | None = None  # [B] SS-k-means labels ("kmeans") or [levels, B] ("hierarchy")
    heads: Mapping[str, Any] = field(default_factory=dict)  # the outputs of the method's own heads, by name


class Method(nn.Module):
    """A method's loss (`forward`) and what the engine must do around it (class attributes, `build_heads`,
    `set_epoch`). Subclasses set `name`, `labels` and `predicts`."""

    name: ClassVar[str]
    labels: ClassVar[str]  # one of LABELS
    predicts: ClassVar[str]  # one of PREDICTIONS
    # What the shared model and optimiser build for the method: InfoSieve's labeller (coder, masker, categorizer) on
    # the projection; the projection head's weight-normed last layer (without it the projection is the MLP's
    # bottleneck output); weight decay on biases and 1-D parameters (SimGCD's optimiser exempts them).
    labeller: ClassVar[bool] = False
    projection_last_layer: ClassVar[bool] = True
    decay_on_1d: ClassVar[bool] = True

    @classmethod
    def from_config(cls, cfg: Config, n_old: int) -> Method:
        """The method of a run's config (`method:` names it): its own section's settings, `train.kernels`."""
        raise NotImplementedError

    def build_heads(self, feat_dim: int, n_classes: int) -> nn.ModuleDict:
        """The method's heads on the backbone features, beside the shared projection head (none by default). The
        engine runs each on the [2B, F] backbone features and passes the outputs as `StepTensors.heads`."""
        return nn.ModuleDict()

    def set_epoch(self, epoch: int) -> None:
        """Per-epoch schedules, written into buffers in place (nothing by default)."""

    def label_levels(self, labels: Tensor, centres: Tensor, labelled: Tensor, n_old: int, cluster: ClusterFn) -> Tensor:
        """`labels == "hierarchy"`: the epoch's labels [levels, n_train] from its SS-k-means round (`labels` [n_train]
        by uq, `centres` [K, F]), clustering further levels with `cluster`; keeps what its steps need (the levels'
        centres). `labelled`: [n_train] the samples labelled in the data."""
        raise NotImplementedError(f"method {self.name} reads {self.labels!r} labels, not a hierarchy")

    def step_state(self) -> dict[str, Tensor]:
        """What the method keeps between the steps of an epoch (set by `set_epoch` / `label_levels`, or updated by the
        steps), saved with a checkpoint taken mid-epoch; nothing by default."""
        return {}

    def load_step_state(self, state: dict[str, Tensor]) -> None:
        """`step_state` of a checkpoint taken mid-epoch, before the epoch's remaining steps."""

    def prediction_centres(self, heads: nn.ModuleDict) -> Tensor:
        """`predicts == "head"`: [K, F] unit rows whose nearest row (largest dot product) to an L2-normalised backbone
        feature is the head's prediction, so evaluation, the test split and `predict` assign by nearest centre."""
        raise NotImplementedError(f"method {self.name} predicts by SS-k-means, not by a head")

    def forward(self, step: StepTensors) -> tuple[Tensor, dict[str, Tensor]]:
        """(total loss, its detached terms by name) of one step; every term in fp32 whatever autocast is on."""
        raise NotImplementedError
