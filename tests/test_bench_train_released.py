"""The as-released parts of the published epoch (`benchmarks/published/train.py`): the loop's per-step records, the
pseudo-label pass with codes, kmeans_pytorch, the accuracy scoring, the saves, and the epoch's phases and projection
hooks, each against an independent computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from benchmarks.published import model as pm
from benchmarks.published import train as pt
from infosieve_fast.data.reading.augment import AugmentConfig, DeviceAugment
from infosieve_fast.evaluation.metrics import split_cluster_acc_v1, split_cluster_acc_v2

N_OLD, N_CLASSES, CODE_LENGTH = 2, 4, 8


def tiny_model(seed: int = 0) -> pt.PublishedModel:
    torch.manual_seed(seed)
    return pt.build_published_model(
        N_OLD, "vit_tiny_patch16_224", 2, CODE_LENGTH, 256, {"img_size": 32, "depth": 4}, 64, 32
    )


def gcd_batch(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 36, 36), dtype=torch.uint8, generator=g)
    targets = torch.arange(n) % N_CLASSES
    labelled = (targets < N_OLD) & (torch.arange(n) < n // 2)
    return images, targets, labelled


def blobs(n_per: int, k: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.eye(dim)[:k] * 5
    y = torch.arange(k).repeat_interleave(n_per)
    return centres[y] + 0.05 * torch.randn(len(y), dim, generator=g), y


# ------------------------------------------------------------------------------------------------------ step log
def test_step_log_reads_the_loss_terms_and_leaves_the_step_unchanged():
    """The logged values are the step's own loss terms (and the logged-only Norm0 shares and InfoNCE accuracy,
    recomputed here from the labeller and the logits); logging does not change the SGD update."""
    images, targets, labelled = gcd_batch(6)
    views = DeviceAugment(AugmentConfig(crop_size=32)).train_views(images, 2, torch.Generator().manual_seed(0))
    pseudo = torch.tensor([0, 1, 2, 3, 0, 1])
    logged, plain = tiny_model(), tiny_model()
    with torch.no_grad():
        _, parts = pt.published_loss(logged, views, targets, labelled, pseudo, n_old=N_OLD)
        feats = F.normalize(logged.projection_head(logged.backbone(views)), dim=-1)
        _, mask, bin_raw, _, _ = logged.labeller(feats)
        losses = pt.PublishedLosses.build(logged, N_OLD)
        with pt._module_device(feats.device):
            logits, positives = pm.info_nce_logits(feats, losses.args)
    log = pt.StepLog()
    for model, step_log in ((logged, log), (plain, None)):
        loop = pt.PublishedLoop.build(model, N_OLD)
        pt.published_step(model, loop.optimizer, loop.losses, views, targets, labelled, pseudo, step_log)

    got = log.averages()
    assert set(got) == set(pt.StepLog.TERMS)
    for name in ("in", "code", "length", "category", "code_cond", "mask_cond", "total"):
        assert got[name] == pytest.approx(float(parts[name]), rel=1e-6), name
    assert got["code_on"] == pytest.approx(float((bin_raw > 0).float().mean()))
    assert got["mask_on"] == pytest.approx(float((mask > 0).float().mean()))
    assert got["train_acc"] == pytest.approx(float((logits.argmax(1) == positives).float().mean()))
    for (name, a), b in zip(logged.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------------------------- passes, k-means
def test_released_train_pass_collects_what_the_published_pass_does():
    """Backbone features equal the minimal pass's (same views); codes are code_raw of the UNnormalised projection;
    the concatenation is normalised; targets, labelled and known-class masks follow the samples."""
    model = tiny_model()
    images, targets, labelled = gcd_batch(12)
    augment = DeviceAugment(AugmentConfig(crop_size=32)).train_views
    got = pt.released_train_pass(model, images, targets, labelled, 5, augment, torch.Generator().manual_seed(3), N_OLD)
    minimal = pt.published_features(model, images, 5, augment, torch.Generator().manual_seed(3))
    np.testing.assert_allclose(got.feats, minimal.numpy(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        views = torch.cat(
            [augment(images[lo : lo + 5], 1, g) for g in [torch.Generator().manual_seed(3)] for lo in range(0, 12, 5)]
        )
        raw = model.backbone(views)
        codes = torch.tanh(model.labeller.coder(model.projection_head(raw)) * model.labeller.age)
    np.testing.assert_allclose(got.codes, codes.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got.comb, axis=1), 1.0, rtol=1e-5)
    assert got.comb.shape == (12, model.backbone.num_features + CODE_LENGTH)
    assert got.targets.dtype == np.float64 and np.array_equal(got.targets, targets.numpy())
    assert np.array_equal(got.labelled, labelled.numpy())
    assert np.array_equal(got.known_class, targets.numpy() < N_OLD)


def test_kmeans_pytorch_finds_separated_blobs_and_stops_at_a_fixed_point():
    x, y = blobs(8, 3, 6)
    ids, centres = pt.kmeans_pytorch(x, 3, random_state=0)
    assert ids.device.type == centres.device.type == "cpu" and ids.shape == (24,)
    assert split_cluster_acc_v1(y.numpy(), ids.numpy(), np.ones(24, bool)).all == 1.0
    for k in range(3):  # converged: each centre is the mean of its points
        torch.testing.assert_close(centres[k], x[ids == k].mean(0))
    again, _ = pt.kmeans_pytorch(x, 3, random_state=0)
    assert torch.equal(ids, again)


def test_released_test_kmeans_runs_three_times_from_one_random_state():
    x, _ = blobs(5, 3, 4)
    runs = pt.released_test_kmeans(x.numpy(), 3, torch.device("cpu"), random_state=7)
    rs = np.random.RandomState(7)
    expected = [pt.kmeans_pytorch(x, 3, random_state=rs)[0].numpy() for _ in range(3)]
    assert len(runs) == 3 and all(np.array_equal(a, b) for a, b in zip(runs, expected, strict=True))


def test_published_scoring_matches_the_metrics_module():
    """The transcribed v1 / v2 (loops over samples, as published) against infosieve_fast.evaluation.metrics
    (vectorised)."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        y = rng.integers(0, 6, 50)
        p = rng.integers(0, 8, 50)
        mask = y < 3
        assert pt.published_log_accs(y, p, mask) == pytest.approx(tuple(split_cluster_acc_v1(y, p, mask)))
        assert pt.split_acc_v2(y, p, mask) == pytest.approx(tuple(split_cluster_acc_v2(y, p, mask)))


# ---------------------------------------------------------------------------------------------------- the epoch
def released_epoch(tmp_path, **kwargs):
    model = tiny_model()
    loop = pt.PublishedLoop.build(model, N_OLD, epochs=4)
    images, targets, labelled = gcd_batch(40)
    test_images, _, _ = gcd_batch(16, seed=1)
    test_targets = torch.arange(16) % N_CLASSES
    augment = DeviceAugment(AugmentConfig(crop_size=32))
    released = pt.ReleasedWork(test_images, test_targets, augment.test_view, tmp_path)
    result = pt.published_epoch(
        loop,
        images,
        targets,
        labelled,
        N_CLASSES,
        batch_size=8,
        epoch=1,
        epochs=4,
        augment=augment.train_views,
        generator=torch.Generator().manual_seed(0),
        sampler_generator=torch.Generator().manual_seed(0),
        kmeans_kwargs={"random_state": 0},
        released=released,
        **kwargs,
    )
    return model, loop, result


def test_released_epoch_runs_every_phase_and_saves_the_three_state_dicts(tmp_path):
    model, loop, result = released_epoch(tmp_path)
    assert list(result.seconds) == [
        "features",
        "kmeans",
        "scoring",
        "code_kmeans",
        "steps",
        "test_features",
        "test_kmeans",
        "saves",
    ]
    assert all(s > 0 for s in result.seconds.values())
    assert result.scale == {"features": 1.0, "steps": 1.0, "test_features": 1.0} and len(result.losses) == 40 // 8
    assert set(result.step_log) == set(pt.StepLog.TERMS)
    assert result.step_log["total"] == pytest.approx(float(torch.stack(result.losses).mean()), rel=1e-6)
    assert set(result.accuracies) == {"train", "codes", "test_0", "test_1", "test_2"}
    assert all(0 <= a <= 1 for acc in result.accuracies.values() for a in acc)
    assert loop.scheduler.last_epoch == 1
    for name, module in (
        ("model.pt", model.backbone),
        ("model_proj_head.pt", model.projection_head),
        ("model_label_head.pt", model.labeller),
    ):
        saved = torch.load(tmp_path / name, weights_only=True)
        assert saved.keys() == module.state_dict().keys()
        assert all(torch.equal(saved[k], v) for k, v in module.state_dict().items()), name


def test_stand_ins_and_max_images_cut_the_passes_and_say_by_how_much(tmp_path):
    """With clustered stand-ins every k-means clusters them (near-perfect scores); max_images cuts the passes and the
    steps, and `scale` gives the full size over the size run."""
    g = torch.Generator().manual_seed(0)
    means = F.normalize(torch.randn(N_CLASSES, 16, generator=g), dim=1)
    code_means = F.normalize(torch.randn(N_CLASSES, CODE_LENGTH, generator=g), dim=1)
    targets, test_targets = torch.arange(40) % N_CLASSES, torch.arange(16) % N_CLASSES
    stand_ins = pt.StandIns(means[targets], code_means[targets], means[test_targets])
    _, _, result = released_epoch(tmp_path, stand_ins=stand_ins, max_images=12)
    assert result.scale == {"features": 40 / 12, "steps": (40 // 8) / 1, "test_features": 16 / 12}
    assert len(result.losses) == 1
    assert torch.equal(result.features, stand_ins.train)
    assert all(acc[0] == 1.0 for acc in result.accuracies.values())  # identical points per class: exact clusters


def test_max_images_without_stand_ins_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"max_images=12 cuts a feature pass of 40 images short: pass StandIns\(train"):
        released_epoch(tmp_path, max_images=12)
    short = pt.StandIns(torch.zeros(39, 16))
    with pytest.raises(ValueError, match="stand_ins.train has 39 rows; its pass has 40"):
        released_epoch(tmp_path, stand_ins=short)
