"""Drop-in replacements for the loss and labeller names of the original InfoSieve code (docs/reference.md §8).

Each class or function here has the name and call signature of its counterpart in the reference
`methods/contrastive_training/contrastive_training.py` / `models/vision_transformer.py`, and computes the same value
through the `infosieve_kernels` dispatch (fused Triton kernels on CUDA, the PyTorch reference elsewhere; the environment
variable `INFOSIEVE_KERNELS=triton|torch` forces one everywhere). `patch_reference(module)` swaps them into a loaded
reference module, the way Liger-Kernel's `apply_liger_kernel_to_*` patches a model; for the training file, which the
original runs with `-m`, that is the running `sys.modules[__name__]` (docs/compat.md). The reference's `is_code`
argument keeps its name here; it is the kernels' `rowsum_normalize` (divide distances by their row sums).

Differences from the reference, all within float tolerance (see docs/compat.md):
- Distances have an exactly zero diagonal. The reference's `torch.cdist` takes the matrix-multiply path for more than
  25 rows, so its diagonal holds rounding noise (about 1e-3 in float32). Only the code variant (`is_code=True`) sees
  it, through the row sums it divides by.
- `SupConLoss` runs the fused kernel when the positives can be written as a label per sample: `labels`, the SimCLR
  case (both None), or a `mask` that is a 0/1 equivalence relation with ones on its diagonal. Any other `mask`,
  `contrast_mode='one'` and a single view fall back to a plain PyTorch transcription of the reference computation
  (with the exact-zero diagonal), so it also gives the reference's NaN for an anchor without a positive.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from .dispatch import code_head as _code_head
from .dispatch import info_nce_loss as _info_nce_loss
from .dispatch import supcon_loss as _supcon_loss
from .layers import mlp, trunc_normal_init
from .reference import contrastive_logits, length_loss, supcon_anchor_terms

__all__ = [
    "DINOLABELLING",
    "HLoss",
    "Norm0Loss",
    "NormPLoss",
    "PATCHED_NAMES",
    "SupConLoss",
    "info_nce_loss",
    "patch_reference",
    "unpatch_reference",
]


def info_nce_loss(
    features: Tensor, temperature: float = 1.0, label_smoothing: float = 0.0, is_code: bool = False, *, backend="auto"
) -> Tensor:
    """Fused `CrossEntropyLoss(label_smoothing)(*info_nce_logits(features, args, is_code))` with
    `args.temperature = temperature` and 2 views: replaces the pairs of calls at `CT.py:341-342` and `CT.py:387-388`.

    `features` [2B, D], view-major. Returns a scalar.
    """
    return _info_nce_loss(features, temperature, label_smoothing, rowsum_normalize=is_code, backend=backend)


class SupConLoss(nn.Module):
    """HobbitLong's SupCon with InfoSieve's Euclidean logits (`CT.py:73-166`), computed by the fused kernel."""

    def __init__(self, temperature=0.07, contrast_mode="all", base_temperature=0.07, *, backend="auto"):
        super().__init__()
        self.temperature = temperature
        self.contrast_mode = contrast_mode
        self.base_temperature = base_temperature
        self.backend = backend

    def forward(self, features: Tensor, labels: Tensor | None = None, mask: Tensor | None = None, is_code=False):
        """`features` [bsz, n_views, ...]; `labels` [bsz] or `mask` [bsz, bsz] (mask_ij = 1: j is a positive of i)."""
        if features.dim() < 3:
            raise ValueError("`features` needs to be [bsz, n_views, ...], at least 3 dimensions are required")
        if features.dim() > 3:
            features = features.view(features.shape[0], features.shape[1], -1)
        bsz, n_views = features.shape[:2]
        if labels is not None and mask is not None:
            raise ValueError("Cannot define both `labels` and `mask`")
        if self.contrast_mode not in ("all", "one"):
            raise ValueError(f"Unknown mode: {self.contrast_mode}")
        if labels is None and mask is None:
            ids = torch.arange(bsz, device=features.device)
        elif labels is not None:
            labels = labels.contiguous().view(-1)
            if labels.shape[0] != bsz:
                raise ValueError("Num of labels does not match num of features")
            ids = _dense_ids(labels.to(features.device))
        else:
            ids = _mask_as_ids(mask.to(features.device))
        if ids is None or self.contrast_mode != "all" or n_views < 2:
            if mask is None:
                mask = (ids[:, None] == ids[None, :]).float()
            return _supcon_torch(self, features, mask.float().to(features.device), is_code)
        flat = torch.cat(torch.unbind(features, dim=1), dim=0)  # view-major anchors, as the reference
        return _supcon_loss(
            flat,
            ids.repeat(n_views),
            self.temperature,
            self.base_temperature,
            rowsum_normalize=is_code,
            backend=self.backend,
        )


def _dense_ids(labels: Tensor) -> Tensor:
    """Any label values (negative, float, sparse) -> 0..K-1 with the same equality pattern, without a host sync.

    The kernels read -1 as "no label"; the reference only compares labels, so every value must stay a class here.
    """
    values, order = labels.sort()
    new_class = torch.zeros_like(order)
    new_class[1:] = values[1:] != values[:-1]
    ids = torch.empty_like(order)
    ids[order] = new_class.cumsum(0)
    return ids


def _mask_as_ids(mask: Tensor) -> Tensor | None:
    """Labels whose equality pattern is `mask`, or None when `mask` is not a 0/1 equivalence relation (host syncs)."""
    if mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        return None
    binary = mask != 0
    if not bool(((mask == 0) | (mask == 1)).all()):
        return None
    ids = binary.int().argmax(1)  # first positive of each row: a class representative
    if not bool(torch.equal(ids[:, None] == ids[None, :], binary)):
        return None
    return ids


def _supcon_torch(loss: SupConLoss, features: Tensor, mask: Tensor, rowsum_normalize: bool) -> Tensor:
    """The reference SupCon for any mask / contrast mode (the fallback path), on `reference.py`'s logits.

    'one' mode anchors are the first `bsz` rows; every anchor counts in the mean, so one without a positive gives the
    reference's NaN. With `rowsum_normalize` every column is divided by its row's sum over all rows (in 'one' mode the
    reference's broadcast fails there).
    """
    bsz, n_views = features.shape[:2]
    anchor_count = n_views if loss.contrast_mode == "all" else 1
    contrast = torch.cat(torch.unbind(features, dim=1), dim=0)
    logits = contrastive_logits(contrast, loss.temperature, rowsum_normalize)[: anchor_count * bsz]
    positives = mask.repeat(anchor_count, n_views).fill_diagonal_(0)
    log_prob_pos, n_pos = supcon_anchor_terms(logits, positives)
    return (-(loss.temperature / loss.base_temperature) * log_prob_pos / n_pos).view(anchor_count, bsz).mean()


class HLoss(nn.Module):
    """Binary constraint (`CT.py:61-69`): mask form mean(((1-x) x)^2), code form mean(1-x^2) + mean_k(mean_i x)^2."""

    def __init__(self, is_mask=False):
        super().__init__()
        self.is_mask = is_mask

    def forward(self, x: Tensor) -> Tensor:
        if self.is_mask:
            return ((1 - x) * x).pow(2).mean()
        return (1 - x.pow(2)).mean() + x.mean(0).pow(2).mean()


class NormPLoss(nn.Module):
    """Length loss (`CT.py:38-49`): `||x / w||_p / ||1 / w||_p` over the whole tensor.

    Keeps the very tensor it was built with, as the reference does: rebinding `labeller.code_weight` later does not
    reach it (the stale base-2 weights of docs/reference.md §3.5). p = 1 is computed in at least float32.
    """

    def __init__(self, pnorm=1, code_weight=None):
        super().__init__()
        self.pnorm = pnorm
        self.code_weight = code_weight

    def forward(self, x: Tensor) -> Tensor:
        if self.code_weight is None:
            return torch.norm(x, p=self.pnorm).mean()
        if self.pnorm == 1 and isinstance(self.code_weight, Tensor):
            return length_loss(x, self.code_weight)
        return (torch.norm(x / self.code_weight, p=self.pnorm) / torch.norm(1 / self.code_weight, p=self.pnorm)).mean()


class Norm0Loss(nn.Module):
    """Fraction of positive entries (logging only, `CT.py:374-375`)."""

    def forward(self, x: Tensor) -> Tensor:
        return (x > 0).float().mean()


def _labeller_mlp(in_dim: int, hidden_dim: int, out_dim: int, nlayers: int, use_bn: bool) -> nn.Module:
    """The reference labeller's MLP: one Linear for `nlayers=1`, else `mlp` with `nlayers` hidden->hidden layers."""
    return nn.Linear(in_dim, out_dim) if nlayers == 1 else mlp(in_dim, hidden_dim, out_dim, nlayers, use_bn)


class DINOLABELLING(nn.Module):
    """The labeller head (`VT.py:300-381`): Code Generator, Code Masker, Categorizer.

    Same constructor, modules and state-dict keys as the reference. `age` (float) and `code_weight` (tensor [L] or a
    scalar) are plain attributes, not state, so the training loop may reassign them every epoch and reference state
    dicts (which lack both) load as they are. The elementwise block after the two MLPs runs in the fused `code_head`.
    """

    def __init__(
        self,
        in_dim,
        use_bn=False,
        nlayers=3,
        hidden_dim=128,
        bottleneck_dim=20,
        code_weight=1,
        age=20,
        nclasses=1,
        *,
        backend="auto",
    ):
        super().__init__()
        nlayers = max(nlayers, 1)
        self.coder = _labeller_mlp(in_dim, hidden_dim, bottleneck_dim, nlayers, use_bn)
        self.masker = _labeller_mlp(in_dim, hidden_dim, bottleneck_dim, nlayers, use_bn)
        self.categorizer = _labeller_mlp(bottleneck_dim, hidden_dim, nclasses, nlayers, use_bn)
        for part in (self.coder, self.masker, self.categorizer):
            part.apply(trunc_normal_init)
        self.bottleneck_dim = bottleneck_dim
        self.code_weight = code_weight
        self.age = age
        self.backend = backend

    def forward(self, x: Tensor):
        """`x` [N, in_dim] -> (code_feat, mask, code_raw, code, trunc_code), each [N, bottleneck_dim]."""
        code_feat = self.coder(x)
        mask_feat = self.masker(x)
        weight = self.code_weight
        if not isinstance(weight, Tensor) or weight.dim() == 0:
            weight = torch.full((code_feat.shape[-1],), float(weight))
        weight = weight.to(device=code_feat.device)
        out = _code_head(code_feat, mask_feat, float(self.age), weight, weight, backend=self.backend)
        return code_feat, out.mask, out.code_raw, out.code, out.trunc_code


PATCHED_NAMES = ("SupConLoss", "HLoss", "NormPLoss", "Norm0Loss", "DINOLABELLING", "info_nce_loss")


def patch_reference(module: types.ModuleType, names: Iterable[str] = PATCHED_NAMES) -> dict[str, object]:
    """Replace the reference names in `module` by this module's, in place; return {name: what was there}.

    Names the module lacks are skipped, except that `info_nce_loss` is added beside `info_nce_logits` (the reference
    has no fused InfoNCE; the call sites that want it call `info_nce_loss(...)`); its entry is None then. Patch before
    the model and the losses are built: instances made earlier keep their class. `unpatch_reference(module,
    replaced)` undoes it. A second copy of the running script is refused (`_check_not_a_copy_of_main`).
    """
    _check_not_a_copy_of_main(module)
    replaced: dict[str, object] = {}
    for name in names:
        if name not in PATCHED_NAMES:
            raise ValueError(f"{name!r} is not one of the names compat provides: {PATCHED_NAMES}")
        added = name == "info_nce_loss" and hasattr(module, "info_nce_logits")
        if not hasattr(module, name) and not added:
            continue
        replaced[name] = getattr(module, name, None)
        setattr(module, name, globals()[name])
    return replaced


def _check_not_a_copy_of_main(module: types.ModuleType) -> None:
    """Refuse `module` when it is another copy of the file running as `__main__`.

    `python -m pkg.mod` (how the original trains) runs pkg/mod.py as `__main__`; `import pkg.mod` inside it loads the
    file a second time as a separate module, and patching that copy leaves the names the running code looks up alone.
    """
    main = sys.modules.get("__main__")
    if main is None or main is module:
        return
    spec = getattr(main, "__spec__", None)
    main_file, module_file = getattr(main, "__file__", None), getattr(module, "__file__", None)
    same_file = bool(main_file and module_file) and os.path.realpath(main_file) == os.path.realpath(module_file)
    if same_file or (spec is not None and spec.name == module.__name__):
        raise ValueError(
            f"patch_reference: {module.__name__} is a second copy of the running __main__ ({main_file}), so patching "
            "it leaves the running code's names alone; inside that file patch the running module instead: "
            "compat.patch_reference(sys.modules[__name__])"
        )


def unpatch_reference(module: types.ModuleType, replaced: dict[str, object]) -> None:
    """Undo `patch_reference`: restore what it returned (names that were absent are removed again)."""
    for name, old in replaced.items():
        if old is None:
            if hasattr(module, name):
                delattr(module, name)
        else:
            setattr(module, name, old)
