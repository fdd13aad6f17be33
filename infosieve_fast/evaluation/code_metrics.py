"""What the learned codes hold (docs/tree.md): the measures `train.eval_every`, `infosieve eval` and `infosieve tree`
report next to the backbone's All/Old/New.

- All/Old/New of SS-k-means on the binary digits `code_raw`: the published code's "label" accuracy (docs/reference.md
  §4; it clusters `code_raw` too), here with the run's own evaluation settings (K, balancing, protocol), so it compares
  directly with the backbone-feature All/Old/New;
- per depth d (4, 8, 16): the number of distinct code prefixes of d digits, their class purity (the share of samples
  in their prefix's majority class) and the normalised mutual information between prefixes and classes;
- the mean code length the mask selects.

A sample's prefix at depth d is its tree node (`tree.code_strings`): the first d signs of its code, or the whole code
when the mask cuts it shorter (a short code stops higher in the tree). Every measure is computed on the unlabelled
train samples, the ones All/Old/New score.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from ..common.labels import NO_LABEL

if TYPE_CHECKING:
    from .evaluator import Evaluator, FeatureSet

DEPTHS = (4, 8, 16)


def code_lengths(mask: Tensor, threshold: float = 0.5) -> Tensor:
    """Each row's code length: the index of its first digit whose mask is below `threshold` (L when none is)."""
    off = mask < threshold
    return torch.where(off.any(1), off.int().argmax(1), torch.full_like(off[:, 0], off.shape[1], dtype=torch.long))


def prefix_ids(code_raw: Tensor, mask: Tensor, depth: int, threshold: float = 0.5) -> Tensor:
    """Group id (0..G-1, long [N]) of each row's tree node at `depth`: the signs of its first min(depth, length)
    digits, the same strings as `tree.code_strings(...)[i][:depth]`."""
    if code_raw.shape != mask.shape or code_raw.dim() != 2:
        raise ValueError(f"code_raw and mask must both be [N, L], got {tuple(code_raw.shape)} and {tuple(mask.shape)}")
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    depth = min(depth, code_raw.shape[1])
    n = code_lengths(mask, threshold).clamp_max(depth)
    digits = torch.arange(depth, device=code_raw.device)
    bits = (code_raw[:, :depth] > 0) & (digits[None, :] < n[:, None])
    key = (bits.long() << digits).sum(1) * (depth + 1) + n  # < 2^depth (depth + 1): exact in int64 for depth <= 56
    return torch.unique(key, return_inverse=True)[1]


def _contingency(groups, targets) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """N and the non-zero cells of the groups x classes table: (group index, class index, count), both indices
    renumbered 0..G-1 and 0..C-1."""
    g = groups.detach().cpu().numpy() if isinstance(groups, Tensor) else np.asarray(groups)
    y = targets.detach().cpu().numpy() if isinstance(targets, Tensor) else np.asarray(targets)
    if g.shape != y.shape or g.ndim != 1:
        raise ValueError(f"groups and targets must be two 1-d arrays of one length, got {g.shape} and {y.shape}")
    g, y = np.unique(g, return_inverse=True)[1].ravel(), np.unique(y, return_inverse=True)[1].ravel()
    n_cls = int(y.max()) + 1 if len(y) else 1
    cells, counts = np.unique(g.astype(np.int64) * n_cls + y, return_counts=True)
    return len(g), cells // n_cls, cells % n_cls, counts


def purity(groups, targets) -> float:
    """Share of the samples that belong to the majority class of their group (0 for no sample)."""
    n, g, _, counts = _contingency(groups, targets)
    if n == 0:
        return 0.0
    best = np.zeros(int(g.max()) + 1, dtype=np.int64)
    np.maximum.at(best, g, counts)
    return float(best.sum() / n)


def nmi(groups, targets) -> float:
    """Normalised mutual information I(G; Y) / ((H(G) + H(Y)) / 2), natural log (scikit-learn's default, with its
    conventions: 1 when both sides are one single group, 0 when exactly one side is)."""
    n, g, y, counts = _contingency(groups, targets)
    if n == 0 or (g.max() == 0 and y.max() == 0):
        return 1.0
    a, b = np.bincount(g, weights=counts) / n, np.bincount(y, weights=counts) / n
    p = counts / n
    mi = float(np.sum(p * np.log(p / (a[g] * b[y]))))
    h = (-np.sum(a * np.log(a)) - np.sum(b * np.log(b))) / 2
    return max(mi, 0.0) / max(float(h), np.finfo(np.float64).eps)


def code_measures(code_raw: Tensor, mask: Tensor, targets: Tensor, depths=DEPTHS, threshold: float = 0.5) -> dict:
    """{"prefixes_d", "purity_d", "nmi_d"} for each depth d and "mean_length" over the rows given. Purity and NMI
    need a class: they are computed on the rows whose target is not `NO_LABEL`, and are NaN when there is none."""
    out: dict[str, float] = {}
    targets = torch.as_tensor(targets).cpu()
    labelled = targets != NO_LABEL
    no_class = len(targets) > 0 and not bool(labelled.any())  # rows, but none with a class to score against
    for d in depths:
        groups = prefix_ids(code_raw, mask, d, threshold)
        out[f"prefixes_{d}"] = int(groups.max()) + 1 if len(groups) else 0
        scored = (groups.cpu()[labelled], targets[labelled])
        out[f"purity_{d}"] = math.nan if no_class else purity(*scored)
        out[f"nmi_{d}"] = math.nan if no_class else nmi(*scored)
    lengths = code_lengths(mask, threshold)
    out["mean_length"] = float(lengths.double().mean()) if len(lengths) else math.nan
    return out


def require_codes(model: nn.Module) -> None:
    """A one-line refusal where codes are read from a model without InfoSieve's labeller (another `method:`)."""
    if model.labeller is None:
        raise ValueError(
            "this run's method learns no codes (only method=infosieve has the code head): the tree and the code "
            "measures read codes; eval, report (with its cluster gallery) and predict work without them"
        )


def code_features(ev: Evaluator) -> FeatureSet:
    """The train samples' `[code_raw | mask]` (test view) as a `FeatureSet` (this rank's share)."""
    model = ev.model
    require_codes(model)

    def embed(x: Tensor) -> Tensor:
        head = model(x).head
        return torch.cat([head.code_raw, head.mask], dim=1).float()

    return ev.features("test", embed=embed)


def evaluate_codes(ev: Evaluator, fs: FeatureSet | None = None) -> dict:
    """All/Old/New of SS-k-means on `code_raw` (`Evaluator.evaluate`: the run's K, `kmeans.eval_balanced`, seed 0 and
    protocol, as the backbone evaluation) and `code_measures`, on the unlabelled train samples. `fs`:
    `code_features(ev)`, if already computed. Every rank returns the same numbers."""
    fs = fs if fs is not None else code_features(ev)
    length = fs.feats.shape[1] // 2  # the code length: code_raw and mask are as wide
    scored = ev.evaluate(dataclasses.replace(fs, feats=fs.feats[:, :length].contiguous()))
    out = scored.metrics
    table = ev.gather_table(fs, fs.feats, fill=0)[scored.unlabelled]
    out.update(code_measures(table[:, :length], table[:, length:], scored.targets[scored.unlabelled]))
    return out


def format_code_measures(m: dict) -> str:
    """A few lines for the console: SS-k-means on the codes (n/a for a part no label can score), then prefixes /
    purity / NMI per depth."""
    parts = "  ".join(f"{p} {'n/a' if m[p.lower()] is None else f'{m[p.lower()]:.4f}'}" for p in ("All", "Old", "New"))
    lines = [f"codes: SS-k-means {parts}  mean length {m['mean_length']:.1f}"]
    for d in sorted(int(k.split("_")[1]) for k in m if k.startswith("prefixes_")):
        lines.append(
            f"  depth {d:>2}: {m[f'prefixes_{d}']:>6} prefixes  purity {m[f'purity_{d}']:.4f}  NMI {m[f'nmi_{d}']:.4f}"
        )
    return "\n".join(lines)
