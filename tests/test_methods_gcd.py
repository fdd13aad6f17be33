"""GCD's loss (`infosieve_fast.methods.gcd`) against the published step transcribed in `benchmarks/published/gcd.py`
(docs/reference.md §12.1): loss terms and gradients, fp32, and the properties the transcription cannot show."""

from __future__ import annotations

import pytest
import torch

from benchmarks.published.gcd import gcd_loss
from infosieve_fast.methods import GCD, StepTensors
from tests.methods_helpers import assert_close, batch

B, D, N_CLASSES, N_OLD = 10, 48, 6, 3


def _step(projection, targets, labelled):
    return StepTensors(backbone=torch.zeros(2 * B, 4), projection=projection, targets=targets, labelled=labelled)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_terms_and_gradient_equal_the_published_step(seed):
    torch.manual_seed(seed)
    projection = torch.randn(2 * B, D) * 3
    targets, labelled = batch(seed, B, N_CLASSES, N_OLD)
    fast_in, pub_in = projection.clone().requires_grad_(), projection.clone().requires_grad_()
    total, parts = GCD()(_step(fast_in, targets, labelled))
    pub_total, pub_parts = gcd_loss(pub_in, targets, labelled)
    for name in ("infonce", "supcon"):
        assert_close(parts[name], pub_parts[name], 1e-6, name)
    assert_close(total, pub_total, 1e-6, "total")
    total.backward()
    pub_total.backward()
    assert_close(fast_in.grad, pub_in.grad, 1e-5, "d total / d projection")


def test_unlabelled_targets_are_never_read_and_an_empty_labelled_batch_gives_zero_supcon():
    torch.manual_seed(3)
    projection = torch.randn(2 * B, D)
    targets, labelled = batch(3, B, N_CLASSES, N_OLD)
    shuffled = torch.where(labelled, targets, (targets + 1) % N_CLASSES)
    _, parts = GCD()(_step(projection, targets, labelled))
    _, parts_shuffled = GCD()(_step(projection, shuffled, labelled))
    assert torch.equal(parts["supcon"], parts_shuffled["supcon"])
    nobody = torch.zeros(B, dtype=torch.bool)
    total, parts = GCD()(_step(projection.requires_grad_(), targets, nobody))
    assert parts["supcon"].item() == 0.0  # the published mean over no anchor is NaN
    assert_close(total, 0.65 * parts["infonce"], 1e-7, "total without a labelled sample")
    total.backward()
    assert torch.isfinite(projection.grad).all()


def test_the_loss_traces_as_one_graph_without_breaks():
    """No host sync or data-dependent Python branch in the loss (every row kept and masked, no boolean indexing):
    dynamo sees one graph, as for SimGCD's (test_methods_simgcd.py)."""
    targets, labelled = batch(4, B, N_CLASSES, N_OLD)
    method = GCD()

    def loss(projection):
        return method(StepTensors(torch.zeros(2 * B, 4), projection, targets, labelled))[0]

    explained = torch._dynamo.explain(loss)(torch.randn(2 * B, D))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
