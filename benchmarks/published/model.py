"""Stand-in for the original InfoSieve model/loss modules: the reference names `kernels.compat` replaces.

Used by the tests (as the oracle) and by `benchmarks/published/train.py` (the published training step).

Transcribed from the behaviour docs/reference.md §2.2, §2.3, §3 and §8 describe (not copied from the public code): the
names, signatures and arithmetic of `SupConLoss` (HobbitLong's SupCon with Euclidean logits and the `is_code`
row-sum normalisation), `HLoss`, `NormPLoss`, `Norm0Loss`, `info_nce_logits` (reads `args.n_views`,
`args.temperature` and the module-global `device`), `DINOHead` and `DINOLABELLING`. Distances come from
`torch.cdist`, as in the original, so for more than 25 rows the diagonal carries the matrix-multiply path's rounding
noise (docs/reference.md §8).
"""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class NormPLoss(nn.Module):
    """||x / w||_p / ||1 / w||_p over the whole tensor; `w` is the tensor passed at construction."""

    def __init__(self, pnorm=1, code_weight=None):
        super().__init__()
        self.pnorm = pnorm
        self.code_weight = code_weight

    def forward(self, x):
        if self.code_weight is None:
            value = torch.norm(x, p=self.pnorm)
        else:
            scaled = torch.norm(x / self.code_weight, p=self.pnorm)
            value = scaled / torch.norm(1 / self.code_weight, p=self.pnorm)
        return value.mean()


class Norm0Loss(nn.Module):
    """Share of entries above zero."""

    def forward(self, x):
        return (x > 0).float().mean()


class HLoss(nn.Module):
    """Mask form: mean of ((1 - x) x)^2. Code form: mean of (1 - x^2) plus the squared per-column batch mean."""

    def __init__(self, is_mask=False):
        super().__init__()
        self.is_mask = is_mask

    def forward(self, x):
        if self.is_mask:
            terms = (x * (1 - x)) ** 2
        else:
            terms = (1 - x**2) + x.mean(0) ** 2
        return terms.mean()


class SupConLoss(nn.Module):
    """Supervised contrastive loss (SimCLR when labels and mask are both None) with -Euclidean logits."""

    def __init__(self, temperature=0.07, contrast_mode="all", base_temperature=0.07):
        super().__init__()
        self.temperature = temperature
        self.contrast_mode = contrast_mode
        self.base_temperature = base_temperature

    def forward(self, features, labels=None, mask=None, is_code=False):
        dev = features.device
        if features.dim() < 3:
            raise ValueError("`features` needs to be [bsz, n_views, ...], at least 3 dimensions are required")
        if features.dim() > 3:
            features = features.view(features.shape[0], features.shape[1], -1)
        bsz = features.shape[0]
        if labels is not None and mask is not None:
            raise ValueError("Cannot define both `labels` and `mask`")
        if labels is None and mask is None:
            pos = torch.eye(bsz, dtype=torch.float32, device=dev)
        elif labels is not None:
            col = labels.contiguous().view(-1, 1)
            if col.shape[0] != bsz:
                raise ValueError("Num of labels does not match num of features")
            pos = (col == col.T).float().to(dev)
        else:
            pos = mask.float().to(dev)

        n_views = features.shape[1]
        contrast = torch.cat(torch.unbind(features, dim=1), dim=0)
        if self.contrast_mode == "one":
            anchors, n_anchor_views = features[:, 0], 1
        elif self.contrast_mode == "all":
            anchors, n_anchor_views = contrast, n_views
        else:
            raise ValueError(f"Unknown mode: {self.contrast_mode}")

        dist = torch.cdist(anchors, contrast)
        if is_code:
            sim = -dist / (dist.sum(dim=1) + 1e-10)
        else:
            sim = -dist
        scores = sim / self.temperature
        scores = scores - scores.max(dim=1, keepdim=True).values.detach()

        pos = pos.repeat(n_anchor_views, n_views)
        n_rows = bsz * n_anchor_views
        not_self = torch.ones_like(pos).scatter(1, torch.arange(n_rows, device=dev).view(-1, 1), 0)
        pos = pos * not_self
        log_prob = scores - torch.log((scores.exp() * not_self).sum(1, keepdim=True))
        mean_pos = (pos * log_prob).sum(1) / pos.sum(1)
        per_anchor = -(self.temperature / self.base_temperature) * mean_pos
        return per_anchor.view(n_anchor_views, bsz).mean()


def info_nce_logits(features, args, is_code=False):
    """Logits [2B, 2B-1] with the positive (the other view) in column 0, and zero targets."""
    half = 0.5 * int(features.size(0))
    ids = torch.cat([torch.arange(half) for _ in range(args.n_views)], dim=0)
    same = (ids[None, :] == ids[:, None]).float().to(device)

    features = F.normalize(features, dim=1)
    if is_code:
        dist = torch.cdist(features, features, p=2)
        sim = -dist / (dist.sum(dim=1) + 1e-10)
    else:
        sim = -torch.cdist(features, features)

    off_diag = ~torch.eye(same.shape[0], dtype=torch.bool).to(device)
    same = same[off_diag].view(same.shape[0], -1)
    sim = sim[off_diag].view(sim.shape[0], -1)
    positives = sim[same.bool()].view(same.shape[0], -1)
    negatives = sim[~same.bool()].view(sim.shape[0], -1)
    logits = torch.cat([positives, negatives], dim=1) / args.temperature
    targets = torch.zeros(logits.shape[0], dtype=torch.long).to(device)
    return logits, targets


def _trunc_normal_init(m):
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.constant_(m.bias, 0)


def _stack(first, hidden_dim, last, n_hidden, use_bn):
    """first->hidden, then n_hidden hidden->hidden layers, then hidden->last; GELU (after optional BN) between."""
    mods = []
    for width in [first] + [hidden_dim] * n_hidden:
        mods.append(nn.Linear(width, hidden_dim))
        if use_bn:
            mods.append(nn.BatchNorm1d(hidden_dim))
        mods.append(nn.GELU())
    mods.append(nn.Linear(hidden_dim, last))
    return nn.Sequential(*mods)


class DINOHead(nn.Module):
    """Projection head: MLP, L2-normalise, weight-normed bias-free last layer with g fixed at 1."""

    def __init__(
        self, in_dim, out_dim, use_bn=False, norm_last_layer=True, nlayers=3, hidden_dim=2048, bottleneck_dim=256
    ):
        super().__init__()
        nlayers = max(nlayers, 1)
        if nlayers == 1:
            self.mlp = nn.Linear(in_dim, bottleneck_dim)
        else:
            self.mlp = _stack(in_dim, hidden_dim, bottleneck_dim, nlayers - 2, use_bn)
        self.apply(_trunc_normal_init)
        with warnings.catch_warnings():  # the original's (deprecated) weight_norm: keys weight_g / weight_v
            warnings.simplefilter("ignore", FutureWarning)
            self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        if norm_last_layer:
            self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


class DINOLABELLING(nn.Module):
    """Labeller head: coder and masker MLPs (`nlayers` hidden->hidden layers each) and a categorizer on codes."""

    def __init__(
        self, in_dim, use_bn=False, nlayers=3, hidden_dim=128, bottleneck_dim=20, code_weight=1, age=20, nclasses=1
    ):
        super().__init__()
        nlayers = max(nlayers, 1)
        if nlayers == 1:
            self.coder = nn.Linear(in_dim, bottleneck_dim)
            self.masker = nn.Linear(in_dim, bottleneck_dim)
            self.categorizer = nn.Linear(bottleneck_dim, nclasses)
        else:
            self.coder = _stack(in_dim, hidden_dim, bottleneck_dim, nlayers, use_bn)
            self.masker = _stack(in_dim, hidden_dim, bottleneck_dim, nlayers, use_bn)
            self.categorizer = _stack(bottleneck_dim, hidden_dim, nclasses, nlayers, use_bn)
        for part in (self.masker, self.categorizer, self.coder):
            part.apply(_trunc_normal_init)
        self.code_weight = code_weight
        self.age = age

    def forward(self, x):
        code_feat = self.coder(x)
        code_raw = torch.tanh(code_feat * self.age)
        mask = (torch.tanh(self.masker(x) + 1 / (self.age + 1)) + 1) / 2.0
        code = code_raw * self.code_weight
        trunc_code = mask * code
        return code_feat, mask, code_raw, code, trunc_code
