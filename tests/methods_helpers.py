"""Shared pieces of the tests/test_methods_*.py files: a random two-view batch and a normwise closeness check."""

from __future__ import annotations

import torch


def batch(seed: int, b: int, n_classes: int, n_old: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets [b], labelled [b]): labelled samples from the known classes, at least two labelled and two not."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, n_classes, (b,), generator=g)
    labelled = (torch.rand(b, generator=g) < 0.5) & (targets < n_old)
    labelled[:2], labelled[-2:] = True, False
    targets[:2] = torch.randint(0, n_old, (2,), generator=g)
    return targets, labelled


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, what: str = "") -> None:
    """Normwise: ||actual - expected|| <= rtol ||expected|| + 1e-7."""
    err = (actual.detach().double() - expected.detach().double()).norm().item()
    scale = expected.detach().double().norm().item()
    assert err <= rtol * scale + 1e-7, f"{what}: |diff| {err:.3e} vs |expected| {scale:.3e}"
