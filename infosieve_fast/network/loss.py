"""InfoSieve's training objective (docs/reference.md §3.10), composed from the kernels' terms.

It knows the coefficients and the parity switches, not the kernels' internals. Every term runs in fp32 (the
65536-d Gram and the length term must not run in bf16, docs/reference.md §8), whatever autocast is active.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

import infosieve_kernels as kernels

from ..config.settings import LossConfig
from .model import ModelOutput


def check_labelled_targets(targets: Tensor, labelled: Tensor, n_old: int) -> None:
    """Labelled samples must belong to the known classes 0..n_old-1 (reads the device: not for the step on CUDA)."""
    known = targets[labelled.bool()]
    if bool(((known >= n_old) | (known < 0)).any()):
        raise ValueError(f"labelled targets must lie in 0..{n_old - 1} (the known classes)")


class InfoSieveLoss:
    def __init__(self, cfg: LossConfig, n_old: int, backend: str = "auto"):
        self.cfg, self.n_old, self.backend = cfg, n_old, backend

    def _settings(self, is_code: bool) -> tuple[float, float, float, bool]:
        """(InfoNCE T, label smoothing, SupCon tau, row-sum-normalised distances) of the input or the code branch.
        The code branch's values default to the input's (null in the config), its distances to the reference's
        row-sum normalisation; every value runs on both kernel backends."""
        cfg = self.cfg
        if not is_code:
            return cfg.temperature, cfg.label_smoothing, cfg.supcon_temperature, False
        return (
            cfg.temperature if cfg.code_temperature is None else cfg.code_temperature,
            cfg.label_smoothing if cfg.code_label_smoothing is None else cfg.code_label_smoothing,
            cfg.supcon_temperature if cfg.code_supcon_temperature is None else cfg.code_supcon_temperature,
            cfg.code_distance == "rowsum",
        )

    def _contrastive(
        self, feats: Tensor, sup_feats: Tensor, gt: Tensor, pseudo: Tensor, sup_weight: float, is_code: bool
    ):
        """The input (`is_code=False`) or code contrastive term: (1 - w) InfoNCE + w (SupCon_gt + SupCon_pseudo) / 2."""
        t, smoothing, tau, rowsum = self._settings(is_code)
        if feats is sup_feats:  # the input branch: one Gram matrix for the three terms
            unsup, (sup_gt, sup_pseudo) = kernels.info_nce_and_supcon(
                feats, [gt, pseudo], t, smoothing, tau, tau, rowsum_normalize=rowsum, backend=self.backend
            )
        else:
            unsup = kernels.info_nce_loss(feats, t, smoothing, rowsum_normalize=rowsum, backend=self.backend)
            sup_gt = kernels.supcon_loss(sup_feats, gt, tau, tau, rowsum_normalize=rowsum, backend=self.backend)
            sup_pseudo = kernels.supcon_loss(sup_feats, pseudo, tau, tau, rowsum_normalize=rowsum, backend=self.backend)
        return (1 - sup_weight) * unsup + sup_weight * (sup_gt + sup_pseudo) / 2, unsup, sup_gt, sup_pseudo

    def _code_constraint(self, out: ModelOutput) -> Tensor:
        if self.cfg.code_constraint == "reference":
            return out.head.code_cond.float()
        bits = (out.head.code_raw.float() + 1) / 2  # the paper's z in {0, 1}: mean z^2 (1 - z)^2
        return (bits * (1 - bits)).pow(2).mean()

    def _category(self, logits: Tensor, targets: Tensor, rows: Tensor) -> Tensor:
        """The categorizer loss averaged over the labelled `rows` (a bool mask) only, without indexing by the mask
        (which would wait for the device): every row is computed, the others are weighted 0. No labelled row: 0."""
        targets = torch.where(rows, targets, 0)
        weight = rows.to(logits.dtype)
        if self.cfg.categorizer_loss == "bce":
            onehot = (targets[:, None] == torch.arange(self.n_old, device=targets.device)).to(logits.dtype)  # no sync
            per_row = F.binary_cross_entropy_with_logits(logits, onehot, reduction="none").sum(1) / self.n_old
        else:
            per_row = F.cross_entropy(logits, targets, reduction="none")
        return (per_row * weight).sum() / weight.sum().clamp_min(1.0)

    def __call__(
        self, out: ModelOutput, targets: Tensor, labelled: Tensor, pseudo_labels: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Total loss and its detached terms for a batch of B samples whose 2 views form the model's 2B rows.

        `targets` are ground-truth classes (used where `labelled`), `pseudo_labels` this epoch's cluster ids; the
        pseudo-label SupCon uses the ground truth on labelled samples (docs/reference.md §3.10).
        """
        cfg = self.cfg
        if not targets.is_cuda:  # free on the CPU; on CUDA the trainer checks the whole train set once per epoch
            check_labelled_targets(targets, labelled, self.n_old)
        lab2 = labelled.bool().repeat(2)
        y2 = targets.long().repeat(2)
        gt = torch.where(lab2, y2, torch.full_like(y2, -1))
        pseudo = torch.where(labelled.bool(), targets.long(), pseudo_labels.long()).repeat(2)
        device_type = out.projection.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            head = out.head
            projection = out.projection.float()
            loss_in, in_unsup, in_gt, in_pseudo = self._contrastive(
                projection, projection, gt, pseudo, cfg.sup_con_weight, is_code=False
            )
            sup_code = (head.code if cfg.sup_code_input == "code" else head.trunc_code).float()
            nce_code = (head.code_raw if cfg.code_infonce_input == "code_raw" else head.code).float()
            loss_code, code_unsup, code_gt, code_pseudo = self._contrastive(
                nce_code, sup_code, gt, pseudo, cfg.sup_code_weight, is_code=True
            )
            code_cond = self._code_constraint(out)
            mask_cond = head.mask_cond.float()
            length = head.length.float()
            category = self._category(out.category_logits.float(), y2, lab2)
            total = (
                cfg.alpha * loss_in
                + cfg.beta * loss_code
                + cfg.zeta * code_cond
                + cfg.eta * category
                + cfg.delta * length
                + cfg.mu * mask_cond
            )
        parts = {
            "total": total,
            "in": loss_in,
            "in_infonce": in_unsup,
            "in_supcon_gt": in_gt,
            "in_supcon_pseudo": in_pseudo,
            "code": loss_code,
            "code_infonce": code_unsup,
            "code_supcon_gt": code_gt,
            "code_supcon_pseudo": code_pseudo,
            "code_cond": code_cond,
            "mask_cond": mask_cond,
            "length": length,
            "category": category,
        }
        return total, {k: v.detach() for k, v in parts.items()}
