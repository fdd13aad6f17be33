"""One test-view pass over a run's train samples for the report's gallery: each sample's distance to its cluster's
centre, its margin (distance to the nearest other centre minus that), and its code cut by the mask (for a method that
learns codes: InfoSieve's alone)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..evaluation.tree import code_strings


@dataclass(frozen=True)
class PoolView:
    """By uq (dicts over the readable train samples): distance to the sample's own centre, margin, code (empty for a
    method without codes), target."""

    distance: dict[int, float]
    margin: dict[int, float]
    codes: dict[int, str]
    targets: dict[int, int]


def own_distances(feats: Tensor, centers: Tensor, own: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(distance to centre `own[i]`, margin: distance to the nearest other centre minus it) per row of `feats`."""
    dist = torch.cdist(feats.float(), centers.float())
    mine = dist.gather(1, own[:, None]).squeeze(1)
    others = dist.scatter(1, own[:, None], float("inf")).min(1).values
    return mine.cpu().numpy(), (others - mine).cpu().numpy()


@torch.no_grad()
def pool_view(trainer, centers: Tensor, clusters: dict[int, int]) -> PoolView:
    """`trainer`'s test-view pass over the train samples: backbone features (L2-normalised, as SS-k-means and
    SimGCD's prototypes see them) measured against `centers` for the samples `clusters` assigns ({uq: cluster}), and
    every sample's code where the model has InfoSieve's labeller."""
    model = trainer.model
    length = trainer.cfg.model.code_length if model.labeller is not None else 0

    def embed(x: Tensor) -> Tensor:
        out = model(x)
        feats = torch.nn.functional.normalize(out.backbone.float(), dim=-1)
        if not length:
            return feats
        return torch.cat([feats, out.head.code_raw.float(), out.head.mask.float()], dim=1)

    fs = trainer.evaluator.features("test", embed=embed)
    width = fs.feats.shape[1] - 2 * length
    uq = fs.uq.tolist()
    codes = {}
    if length:
        codes = dict(
            zip(uq, code_strings(fs.feats[:, width : width + length], fs.feats[:, width + length :]), strict=True)
        )
    rows = [i for i, u in enumerate(uq) if u in clusters]
    own = torch.as_tensor([clusters[uq[i]] for i in rows], dtype=torch.long, device=fs.feats.device)
    distance, margin = own_distances(fs.feats[rows, :width], centers.to(fs.feats.device), own)
    assigned = [uq[i] for i in rows]
    return PoolView(
        dict(zip(assigned, distance.tolist(), strict=True)),
        dict(zip(assigned, margin.tolist(), strict=True)),
        codes,
        dict(zip(uq, fs.targets.tolist(), strict=True)),
    )
