"""SelEx (Rastegar et al., ECCV 2024): Euclidean InfoNCE with soft targets from a cluster hierarchy, and Euclidean
SupCon on the ground truth plus one SupCon per hierarchy level on a shrinking prefix of the projection
(docs/reference.md §12.3).

Each epoch the engine gives the method its hierarchy (`set_hierarchy`: every level's SS-k-means centres) and each
step the batch's labels at every level (`StepTensors.pseudo`, [levels, B]). Every loss term runs in the fused
Euclidean kernels where the backend is Triton: the soft-target InfoNCE and the ground-truth SupCon share one Gram
matrix (`infosieve_kernels.info_nce_and_supcon` with the confusion as its `smoothing_target`), and each level's
SupCon is `infosieve_kernels.supcon_loss` on a prefix of the projection (a strided view). The confusion matrix, a
no-grad elementwise map of the batch's backbone distances, stays in PyTorch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

import infosieve_kernels as kernels
from infosieve_kernels.reference import pairwise_distances

from ..config.settings import Config
from .base import Method, StepTensors
from .contrastive import labelled_rows
from .selex_hierarchy import LEVEL_ORDERS, ClusterFn, build_hierarchy

# The batch's backbone features the confusion matrix compares with the cluster radii: "raw", as the backbone returns
# them (published, while the centres are centres of L2-normalised features), or "normalized", as the centres' own.
BATCH_FEATURES = ("raw", "normalized")
MINMAX_EPS = 1e-7  # the published (cf - min) / (max - min + 1e-7)


def cluster_radii(centres: Tensor) -> Tensor:
    """[K] half the distance from each centre to its nearest other centre (the published radius at the start of an
    epoch). A single centre has no neighbour: its radius is taken as 0."""
    if centres.shape[0] < 2:
        return torch.zeros(centres.shape[0], device=centres.device)
    d = torch.cdist(centres.float(), centres.float())
    return (d + torch.eye(d.shape[0], device=d.device) * d.max()).min(dim=1).values / 2


class SelEx(Method):
    name, labels, predicts = "selex", "hierarchy", "kmeans"

    @classmethod
    def from_config(cls, cfg: Config, n_old: int) -> SelEx:
        return cls(**dataclasses.asdict(cfg.selex), backend=cfg.train.kernels)

    def __init__(
        self,
        smoothing: float = 1.0,
        sup_con_weight: float = 0.35,
        temperature: float = 1.0,
        supcon_temperature: float = 0.07,
        cluster_momentum: float = 1.0,
        batch_features: str = "raw",
        level_order: str = "published",
        backend: str = "auto",
    ):
        super().__init__()
        if batch_features not in BATCH_FEATURES:
            raise ValueError(f"batch_features={batch_features!r} is not one of {BATCH_FEATURES}")
        if level_order not in LEVEL_ORDERS:
            raise ValueError(f"level_order={level_order!r} is not one of {LEVEL_ORDERS}")
        if not 0.0 <= cluster_momentum <= 1.0:
            raise ValueError(f"cluster_momentum must be in [0, 1], got {cluster_momentum}")
        self.smoothing, self.sup_con_weight, self.temperature = smoothing, sup_con_weight, temperature
        self.supcon_temperature, self.cluster_momentum = supcon_temperature, cluster_momentum
        self.batch_features, self.level_order, self.backend = batch_features, level_order, backend
        # the epoch's hierarchy, padded to the widest level: centres [levels, K_0, F], radii [levels, K_0]
        self.register_buffer("centres", torch.zeros(0, 0, 0), persistent=False)
        self.register_buffer("radii", torch.zeros(0, 0), persistent=False)

    def label_levels(self, labels: Tensor, centres: Tensor, labelled: Tensor, n_old: int, cluster: ClusterFn) -> Tensor:
        """The epoch's hierarchy (`selex_hierarchy.build_hierarchy`, `level_order` as set): its labels, and its
        centres kept (`set_hierarchy`)."""
        tables, level_centres = build_hierarchy(labels, centres, labelled, n_old, cluster, self.level_order)
        self.set_hierarchy(level_centres)
        return tables

    def step_state(self) -> dict[str, Tensor]:
        """The levels' centres and radii (the radii move every step when cluster_momentum < 1)."""
        return {"centres": self.centres.cpu(), "radii": self.radii.cpu()}

    def load_step_state(self, state: dict[str, Tensor]) -> None:
        self.centres, self.radii = state["centres"].to(self.radii.device), state["radii"].to(self.radii.device)

    def set_hierarchy(self, centres: Sequence[Tensor]) -> None:
        """This epoch's levels, finest first: `centres[i]` [K_i, F] the level-i SS-k-means centres. Resets the radii
        to the published starting value (`cluster_radii`)."""
        if not centres:
            raise ValueError("set_hierarchy needs at least one level of centres")
        widest, dim = max(c.shape[0] for c in centres), centres[0].shape[1]
        device = self.radii.device
        self.centres = torch.zeros(len(centres), widest, dim, device=device)
        self.radii = torch.zeros(len(centres), widest, device=device)
        for i, c in enumerate(centres):
            self.centres[i, : c.shape[0]] = c.to(device, torch.float32)
            self.radii[i, : c.shape[0]] = cluster_radii(c.to(device))

    def forward(self, step: StepTensors) -> tuple[Tensor, dict[str, Tensor]]:
        levels = self.radii.shape[0]
        if levels == 0:
            raise RuntimeError("SelEx has no hierarchy for this epoch: call set_hierarchy(centres) before the steps")
        if step.pseudo is None or step.pseudo.dim() != 2 or step.pseudo.shape[0] != levels:
            got = None if step.pseudo is None else tuple(step.pseudo.shape)
            raise ValueError(f"SelEx needs the batch's labels at each of the {levels} levels, [levels, B]; got {got}")
        dim = step.projection.shape[1]
        if dim >> levels < 1:
            raise ValueError(f"the projection's {dim} columns cannot give {levels} halved prefixes: use fewer levels")
        level_labels = step.pseudo.long().repeat(1, 2)  # [levels, 2B], view-major
        tau = self.supcon_temperature
        with torch.autocast(step.projection.device.type, enabled=False):
            with torch.no_grad():
                confusion = self._confusion(step.backbone.detach().float(), level_labels)
            features = F.normalize(step.projection.float(), dim=-1)
            gt = labelled_rows(step.targets, step.labelled)
            # the InfoNCE's target: (1 - s) on the other view plus s times the confusion (self column dropped)
            infonce, (supcon_gt,) = kernels.info_nce_and_supcon(
                features, [gt], self.temperature, self.smoothing, tau, tau, smoothing_target=confusion,
                backend=self.backend,
            )  # fmt: skip
            supcon_levels = sum(
                kernels.supcon_loss(features[:, : dim >> (i + 1)], level_labels[i], tau, tau, backend=self.backend)
                / 2 ** (i + 1)
                for i in range(levels)
            )
            supcon = supcon_gt + supcon_levels
            total = (1 - self.sup_con_weight) * infonce + self.sup_con_weight * supcon / 2
        parts = {
            "total": total,
            "infonce": infonce,
            "supcon": supcon,
            "supcon_gt": supcon_gt,
            "supcon_levels": supcon_levels,
        }
        return total, {k: v.detach() for k, v in parts.items()}

    def _confusion(self, backbone: Tensor, level_labels: Tensor) -> Tensor:
        """The soft-target weights [2B, 2B]: per level i, 2^-i where the pair's distance exceeds twice the radius of
        the COLUMN sample's cluster; min-max scaled over the whole matrix; then column j divided by row j's sum (the
        published broadcast)."""
        if self.batch_features == "normalized":
            backbone = F.normalize(backbone, dim=-1)
        pair = pairwise_distances(backbone)
        confusion = torch.zeros_like(pair)
        for i in range(level_labels.shape[0]):
            if self.cluster_momentum != 1.0:
                self._update_radii(i, backbone, level_labels[i])
            radius = self.radii[i][level_labels[i]]
            confusion = confusion + (pair > 2 * radius[None, :]).float() / 2**i
        low, high = confusion.min(), confusion.max()
        confusion = (confusion - low) / (high - low + MINMAX_EPS)
        return confusion / confusion.sum(1)[None, :]

    def _update_radii(self, level: int, backbone: Tensor, labels: Tensor) -> None:
        """radius <- m radius + (1 - m) (mean distance of the batch's rows in the cluster to its centre; 0 for a
        cluster without a row), in place, per step (published `--cluster_momentum`; 1, the default, keeps them)."""
        centres = self.centres[level]
        sq = (backbone.pow(2).sum(1)[:, None] + centres.pow(2).sum(1)[None, :] - 2 * backbone @ centres.T).clamp_min(0)
        own = sq.gather(1, labels[:, None]).squeeze(1).sqrt()
        sums = torch.zeros(centres.shape[0], device=own.device).index_add_(0, labels, own)
        counts = torch.zeros(centres.shape[0], device=own.device).index_add_(0, labels, torch.ones_like(own))
        m = self.cluster_momentum
        self.radii[level].mul_(m).add_((1 - m) * sums / counts.clamp_min(1))
