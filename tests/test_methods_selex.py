"""SelEx's loss (`infosieve_fast.methods.selex`) against the published step transcribed in
`benchmarks/published/selex.py` (docs/reference.md §12.3): loss terms, gradients and the radii, fp32, on the torch
path and on the fused kernels, every term of them (the Triton interpreter on the CPU, both Gram paths); the radius rule
by hand.

B = 8 (16 rows) keeps `torch.cdist` on its exact path. The backbone rows are drawn around the level-0 centres at the
scale of the radii, so the zero-one confusion mixes zeros and ones (checked), as it must to test anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.published import selex as published
from infosieve_fast.methods import SelEx, StepTensors
from infosieve_fast.methods.selex import cluster_radii
from tests.methods_helpers import assert_close, batch

B, FEAT, D, N_OLD, N_NEW = 8, 6, 32, 4, 4
LEVEL_K = (8, 4, 2)  # the published halving: 4+4, 2+2, 1+1


def _hierarchy(seed: int, raw_scale: float):
    g = torch.Generator().manual_seed(seed)
    centres = [torch.nn.functional.normalize(torch.randn(k, FEAT, generator=g), dim=1) for k in LEVEL_K]
    targets, labelled = batch(seed, B, N_OLD + N_NEW, N_OLD)
    level0 = torch.where(labelled, targets, torch.randint(0, LEVEL_K[0], (B,), generator=g))
    labels = [level0] + [torch.randint(0, k, (B,), generator=g) for k in LEVEL_K[1:]]
    rows = torch.cat([centres[0][level0], centres[0][level0]]) + 0.3 * torch.randn(2 * B, FEAT, generator=g)
    return centres, labels, targets, labelled, rows * raw_scale, torch.randn(2 * B, D, generator=g) * 2


def _compare(seed, backend, momentum=1.0, batch_features="raw", steps=1):
    centres, labels, targets, labelled, backbone, projection = _hierarchy(seed, 1.0)
    method = SelEx(smoothing=0.5, cluster_momentum=momentum, batch_features=batch_features, backend=backend)
    method.set_hierarchy(centres)
    radii = published.initial_radii(centres)
    pub_backbone = backbone if batch_features == "raw" else torch.nn.functional.normalize(backbone, dim=1)
    for _ in range(steps):
        fast_in, pub_in = projection.clone().requires_grad_(), projection.clone().requires_grad_()
        step = StepTensors(backbone, fast_in, targets, labelled, pseudo=torch.stack(labels))
        total, parts = method(step)
        pub_total, pub_parts = published.selex_loss(
            pub_backbone, pub_in, targets, labelled, labels, centres, radii, N_OLD, N_NEW, smoothing=0.5,
            momentum=momentum,
        )  # fmt: skip
        for name, value in pub_parts.items():
            assert_close(parts[name], value, 2e-6, name)
        assert_close(total, pub_total, 2e-6, "total")
        total.backward()
        pub_total.backward()
        assert_close(fast_in.grad, pub_in.grad, 1e-5, "d total / d projection")
        for i, k in enumerate(LEVEL_K):
            assert_close(method.radii[i, :k], radii[i], 1e-6, f"level {i} radii")
    confusion = published.confusion_factor(pub_backbone, labels, centres, list(radii), N_OLD, N_NEW, momentum)
    off_diagonal = confusion[~torch.eye(2 * B, dtype=torch.bool)]
    assert off_diagonal.unique().numel() > 2, "the confusion is degenerate: the test would not see its rule"


@pytest.mark.parametrize("seed", [0, 1])
def test_terms_gradients_and_radii_equal_the_published_step(seed):
    _compare(seed, "torch")


def test_momentum_below_one_updates_the_radii_every_step_as_published():
    _compare(2, "torch", momentum=0.5, steps=2)


def test_normalised_batch_features_switch_is_the_published_step_on_normalised_features():
    _compare(3, "torch", batch_features="normalized")


@pytest.mark.parametrize("gram", ["mm", "triton"])
def test_every_term_on_the_fused_kernels_equals_the_published_step(gram, monkeypatch):
    """The soft-target InfoNCE and every SupCon run in the Triton kernels: one InfoNCE launch with the confusion as
    its target, one SupCon per level plus the ground truth's, and the PyTorch twins never reached."""
    from infosieve_kernels import contrastive_triton, reference

    monkeypatch.setattr(contrastive_triton, "GRAM", gram)
    for name in ("info_nce_loss", "supcon_loss", "info_nce_and_supcon"):
        monkeypatch.setattr(reference, name, lambda *a, name=name, **k: pytest.fail(f"reference.{name} ran"))
    losses, apply = [], contrastive_triton._Contrastive.apply

    def recorded(features, labels, supcon, *args):
        losses.append("supcon" if supcon else "soft infonce" if args[-1] is not None else "infonce")
        return apply(features, labels, supcon, *args)

    monkeypatch.setattr(contrastive_triton._Contrastive, "apply", recorded)
    _compare(0, "triton")
    assert sorted(losses) == ["soft infonce"] + ["supcon"] * (1 + len(LEVEL_K))


def test_radius_is_half_the_distance_to_the_nearest_other_centre():
    centres = torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0]])
    assert torch.allclose(cluster_radii(centres), torch.tensor([0.5, 0.5, 1.0]))
    assert torch.allclose(cluster_radii(centres), published.initial_radii([centres])[0])


def test_unnormalised_features_far_apart_flatten_the_targets_into_uniform_smoothing():
    """The published default compares raw backbone distances (here x100) with radii of unit-norm centres: every pair
    is 'far' at every level, and the soft target becomes (1 - s) on the positive plus s / (2B - 1) everywhere."""
    centres, labels, targets, labelled, backbone, _ = _hierarchy(5, 100.0)
    method = SelEx()
    method.set_hierarchy(centres)
    confusion = method._confusion(backbone, torch.stack(labels).repeat(1, 2))
    eye = torch.eye(2 * B, dtype=torch.bool)
    assert torch.allclose(confusion[~eye], torch.full((2 * B * (2 * B - 1),), 1 / (2 * B - 1)), atol=1e-6)


def test_published_lookup_of_the_batch_labels_is_a_table_gather():
    g = torch.Generator().manual_seed(6)
    n = 20
    uq_index = np.random.default_rng(6).permutation(n).astype(float)  # the loader's unique indices, in its order
    table = torch.randint(0, 5, (n,), generator=g)
    uq = torch.tensor([3, 17, 0, 9])
    (looked_up,) = published.batch_level_labels([table], uq_index, uq.numpy())
    by_index = torch.empty_like(table)
    by_index[torch.from_numpy(uq_index).long()] = table  # the table re-keyed by unique index: what the engine holds
    assert torch.equal(looked_up, by_index[uq])


def test_missing_hierarchy_or_levels_fail_with_the_fix():
    method = SelEx()
    step = StepTensors(torch.zeros(4, 3), torch.zeros(4, 8), torch.zeros(2), torch.zeros(2, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="set_hierarchy"):
        method(step)
    method.set_hierarchy([torch.randn(4, 3), torch.randn(2, 3)])
    with pytest.raises(ValueError, match="each of the 2 levels"):
        method(step)
    with pytest.raises(ValueError, match="batch_features"):
        SelEx(batch_features="cosine")
