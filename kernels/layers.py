"""The MLP and the initialisation of the projection head and the labeller (docs/reference.md §2.2, §2.3).

They live here, below `infosieve_fast`, because the compat layer's `DINOLABELLING` builds the same MLPs.
"""

from __future__ import annotations

from torch import nn


def trunc_normal_init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def mlp(in_dim: int, hidden_dim: int, out_dim: int, n_hidden: int, use_bn: bool = False) -> nn.Sequential:
    """Linear(in, h), GELU, [Linear(h, h), GELU] * n_hidden, Linear(h, out), with BatchNorm1d before each GELU if
    `use_bn`: the projection head's and the labeller's MLPs (docs/reference.md §2.2, §2.3)."""
    layers: list[nn.Module] = []
    for width in [in_dim] + [hidden_dim] * n_hidden:
        layers.append(nn.Linear(width, hidden_dim))
        if use_bn:
            layers.append(nn.BatchNorm1d(hidden_dim))
        layers.append(nn.GELU())
    layers.append(nn.Linear(hidden_dim, out_dim))
    return nn.Sequential(*layers)
