"""The token cache of the test-view passes: replayed features equal recomputed ones (before and after training, for
backbone features and for codes), a replay reads no image, and the cache stays off where the frozen prefix is not a
pure function of the image (BatchNorm) or does not fit."""

import pytest
import torch
from torch import nn

from infosieve_fast.config.settings import ConfigError, load_config
from infosieve_fast.data.writing.shards import make_shards
from infosieve_fast.evaluation.code_metrics import code_features
from infosieve_fast.training.engine import Trainer

TINY_VIT = [
    "train.device=cpu",
    "model.backbone=vit_tiny_patch16_224",
    "model.backbone_kwargs={in_chans: 1, img_size: 32, patch_size: 8, depth: 3}",
    "model.grad_from_block=2",
    "data.crop_size=32",
    "train.train_subset=96",
    "data.batch_size=32",
    "data.feature_batch_size=40",
    "kmeans.n_init=1",
    "model.proj_out_dim=64",
    "model.proj_hidden_dim=32",
    "model.proj_bottleneck_dim=16",
    "train.max_steps_per_epoch=2",
]


def trainer(*extra) -> Trainer:
    return Trainer(load_config("configs/demo.yaml", [*TINY_VIT, *extra]))


def no_images(*args, **kwargs):
    raise AssertionError("a replayed pass read the data source")


def assert_same_features(a, b):
    assert torch.equal(a.uq, b.uq) and torch.equal(a.targets, b.targets) and torch.equal(a.labelled, b.labelled)
    assert torch.equal(a.feats, b.feats)


def test_replayed_test_view_features_equal_recomputed_ones_before_and_after_training(monkeypatch):
    cached, plain = trainer(), trainer("train.token_cache=off")
    first = cached.evaluator.features("test")
    assert cached.token_cache.placement == {"train": "cpu"} and len(cached.token_cache.splits["train"]) == 3
    assert_same_features(first, plain.evaluator.features("test"))
    for t in (cached, plain):
        t.train_epoch(0)  # the trained blocks and the head change; the frozen prefix does not
    monkeypatch.setattr(cached.source, "feature_batches", no_images)
    after = cached.evaluator.features("test")
    assert_same_features(after, plain.evaluator.features("test"))
    assert not torch.equal(after.feats, first.feats)  # training did change the features
    # the codes' pass replays the tokens too
    assert_same_features(code_features(cached.evaluator), code_features(plain.evaluator))
    assert plain.token_cache.splits == {}


def test_the_augmented_pass_never_uses_the_cache(monkeypatch):
    cached = trainer()
    cached.evaluator.features("test")
    monkeypatch.setattr(cached.token_cache, "replay", no_images)
    monkeypatch.setattr(cached.token_cache, "recorder", no_images)
    cached.evaluator.features("train", seed=3)


def test_loading_weights_forgets_the_tokens():
    cached = trainer()
    cached.evaluator.features("test")
    cached.load_model_state({"model": cached.model.state_dict()})
    assert cached.token_cache.splits == {} and cached.token_cache.placement == {}


def test_tokens_that_do_not_fit_are_recomputed_every_pass(capsys):
    cached, plain = trainer("data.memory_threshold_mb=0.01"), trainer("train.token_cache=off")
    for _ in range(2):
        assert_same_features(cached.evaluator.features("test"), plain.evaluator.features("test"))
    assert cached.token_cache.placement == {"train": "recompute"} and cached.token_cache.splits == {}
    assert "nowhere: recomputed every pass" in capsys.readouterr().err


def test_a_prefix_with_running_statistics_is_not_cached():
    cached = trainer()
    backbone = cached.model.backbone
    assert backbone.prefix_is_pure
    backbone.net.blocks[0].add_module("stats", nn.BatchNorm1d(4))  # frozen, yet updated by every training forward
    assert not backbone.prefix_is_pure
    cached.evaluator.features("test")
    assert cached.token_cache.splits == {}


def test_a_backbone_without_a_frozen_prefix_is_not_cached():
    cached = Trainer(load_config("configs/demo.yaml", [*TINY_VIT[:-1], "model.grad_from_block=null"]))
    assert not cached.model.backbone.prefix_is_pure
    cached.evaluator.features("test")
    assert cached.token_cache.splits == {}


def test_the_setting_is_checked():
    assert not trainer("train.token_cache=off").token_cache.enabled
    with pytest.raises(ConfigError, match=r"train.token_cache must be one of \('auto', 'off'\)"):
        trainer("train.token_cache=gpu")


def cifar_shards(realdata, tmp_path) -> list[str]:
    """Overrides for shards of 16 train and 8 test images of three cifar10 classes (two known), 3 channels at 36 px."""
    for split, lo, hi in (("train", 0, 16), ("test", 16, 24)):
        for cls in ("airplane", "automobile", "bird"):
            (tmp_path / "raw" / split / cls).mkdir(parents=True)
            for src in sorted((realdata / "cifar10_test" / "test" / cls).glob("*.jpg"))[lo:hi]:
                (tmp_path / "raw" / split / cls / src.name).symlink_to(src)
    make_shards("imagefolder", tmp_path / "raw", tmp_path / "shards", resize=36, known_classes=[0, 1], progress=False)
    return [
        "data.source=shards",
        f"data.shards={tmp_path / 'shards'}",
        "data.num_workers=0",
        "data.mean=[0.5, 0.5, 0.5]",
        "data.std=[0.25, 0.25, 0.25]",
        "model.backbone_kwargs={in_chans: 3, img_size: 32, patch_size: 8, depth: 3}",
        "train.train_subset=null",
    ]


def test_the_test_split_replays_its_tokens_too(realdata, tmp_path, monkeypatch):
    """From shards with a test split: the inductive test-split evaluation gives the same accuracy from replayed
    tokens as recomputed, and the replay reads no test image."""
    shards = cifar_shards(realdata, tmp_path)
    cached, plain = trainer(*shards), trainer(*shards, "train.token_cache=off")
    centers = torch.nn.functional.normalize(torch.randn(3, cached.model.backbone.feat_dim), dim=1)
    first = cached.evaluator.evaluate_test(centers)
    assert cached.token_cache.placement == {"test": "cpu"}
    monkeypatch.setattr(cached.source, "test_batches", no_images)
    assert cached.evaluator.evaluate_test(centers) == first == plain.evaluator.evaluate_test(centers)


@pytest.mark.parametrize("frozen_bf16", ["false", "true"])
def test_efficientnet_lite0_replays_its_frozen_blocks_output(realdata, tmp_path, monkeypatch, frozen_bf16):
    """efficientnet_lite0's BatchNorms never update, so its frozen stem and blocks are cached like a ViT's prefix:
    replayed features equal recomputed ones before and after training, in fp32 and with the prefix in bf16."""
    pytest.importorskip("efficientnet_lite_pytorch")
    lite0 = [*cifar_shards(realdata, tmp_path), "model.backbone=efficientnet_lite0", "model.backbone_kwargs={}",
             "model.grad_from_block=15", f"train.frozen_bf16={frozen_bf16}"]  # fmt: skip
    cached, plain = trainer(*lite0), trainer(*lite0, "train.token_cache=off")
    assert cached.model.backbone.prefix_is_pure
    first = cached.evaluator.features("test")
    assert cached.token_cache.placement == {"train": "cpu"}
    stored = cached.token_cache.splits["train"][0].tokens.dtype
    assert stored == (torch.bfloat16 if frozen_bf16 == "true" else torch.float32)
    assert_same_features(first, plain.evaluator.features("test"))
    for t in (cached, plain):
        t.train_epoch(0)
    monkeypatch.setattr(cached.source, "feature_batches", no_images)
    after = cached.evaluator.features("test")
    assert_same_features(after, plain.evaluator.features("test"))
    assert not torch.equal(after.feats, first.feats)
