"""Backbone checkpoints in the official DINOv2 layout, timm's own layout and DINO's, loaded at the training image size
through timm's checkpoint filter (`model.load_backbone_weights`). Every checkpoint is built here with random values
and the key names and shapes of its layout: nothing is downloaded."""

import argparse
import dataclasses
import re

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed

from infosieve_fast.common.files import CheckpointError
from infosieve_fast.config.settings import ModelConfig, load_config
from infosieve_fast.network.model import build_backbone, load_backbone_weights

# facebookresearch/dinov2 (dinov2/hub/backbones.py, dinov2/models/vision_transformer.py): the torch.hub models
# dinov2_vit{s,b,l}14[_reg] are built at 518 px with 14-pixel patches, so their position embedding holds 1 + 37 x 37
# tokens; the _reg models add 4 register tokens.
OFFICIAL_GRID = 518 // 14
ARCHS = {"small": 384, "base": 768, "large": 1024}  # vit_small / vit_base / vit_large: embed_dim
REGISTERS = 4
TRAIN_GRID = 224 // 14  # 16 x 16 patches at the training crop


def official_dinov2(dim: int, depth: int, registers: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict with exactly the keys and shapes of an official DINOv2 checkpoint (MLP FFN, LayerScale, qkv and
    ffn biases, the unused `mask_token`), random values."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    state = {
        "cls_token": rand(1, 1, dim),
        "pos_embed": rand(1, 1 + OFFICIAL_GRID**2, dim),
        "mask_token": rand(1, dim),
        "patch_embed.proj.weight": rand(dim, 3, 14, 14),
        "patch_embed.proj.bias": rand(dim),
    }
    if registers:
        state["register_tokens"] = rand(1, REGISTERS, dim)
    for i in range(depth):
        for name, shape in (
            ("norm1.weight", (dim,)),
            ("norm1.bias", (dim,)),
            ("attn.qkv.weight", (3 * dim, dim)),
            ("attn.qkv.bias", (3 * dim,)),
            ("attn.proj.weight", (dim, dim)),
            ("attn.proj.bias", (dim,)),
            ("ls1.gamma", (dim,)),
            ("norm2.weight", (dim,)),
            ("norm2.bias", (dim,)),
            ("mlp.fc1.weight", (4 * dim, dim)),
            ("mlp.fc1.bias", (4 * dim,)),
            ("mlp.fc2.weight", (dim, 4 * dim)),
            ("mlp.fc2.bias", (dim,)),
            ("ls2.gamma", (dim,)),
        ):
            state[f"blocks.{i}.{name}"] = rand(*shape)
    state["norm.weight"], state["norm.bias"] = rand(dim), rand(dim)
    return state


def timm_dinov2(arch: str, registers: bool, depth: int, **kwargs) -> torch.nn.Module:
    name = f"vit_{arch}_patch14_reg4_dinov2" if registers else f"vit_{arch}_patch14_dinov2"
    return timm.create_model(name, pretrained=False, num_classes=0, depth=depth, **kwargs)


def saved(tmp_path, state: dict) -> str:
    path = tmp_path / "checkpoint.pth"
    torch.save(state, path)
    return str(path)


def bicubic_grid(pos: torch.Tensor, size: int) -> torch.Tensor:
    """A [1, g*g, D] position grid resized to size x size by hand: antialiased bicubic, as timm resamples."""
    g, dim = int(pos.shape[1] ** 0.5), pos.shape[-1]
    grid = pos.reshape(1, g, g, dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
    return grid.permute(0, 2, 3, 1).reshape(1, size * size, dim)


def assert_loaded_at_224(net: torch.nn.Module, source: dict, registers: bool) -> None:
    """Every weight equals the source where nothing is resampled; the position embedding is the source's 37 x 37 grid
    resampled to 16 x 16 (timm's resample function and a hand-written one agree); the register layout as timm
    converts it (registers as `reg_token`, the class token's position folded into the class token)."""
    got = net.state_dict()
    for key, value in source.items():
        if key not in ("cls_token", "pos_embed", "mask_token", "register_tokens"):
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    prefix = 0 if registers else 1
    grid = source["pos_embed"][:, 1:]
    expected = resample_abs_pos_embed(
        source["pos_embed"][:, 1 - prefix :], new_size=(TRAIN_GRID, TRAIN_GRID), num_prefix_tokens=prefix
    )
    assert got["pos_embed"].shape == (1, prefix + TRAIN_GRID**2, source["cls_token"].shape[-1])
    torch.testing.assert_close(got["pos_embed"], expected, rtol=0, atol=0)
    torch.testing.assert_close(got["pos_embed"][:, prefix:], bicubic_grid(grid, TRAIN_GRID), rtol=1e-5, atol=1e-5)
    if registers:
        torch.testing.assert_close(got["reg_token"], source["register_tokens"], rtol=0, atol=0)
        torch.testing.assert_close(got["cls_token"], source["cls_token"] + source["pos_embed"][:, :1], rtol=0, atol=0)
    else:
        torch.testing.assert_close(got["cls_token"], source["cls_token"], rtol=0, atol=0)
        torch.testing.assert_close(got["pos_embed"][:, :1], source["pos_embed"][:, :1], rtol=0, atol=0)


@pytest.mark.parametrize("registers", [False, True], ids=["plain", "reg"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_official_dinov2_layouts_load_into_timms_models_at_224(tmp_path, arch, registers):
    """dinov2_vit{s,b,l}14[_reg] (one block each, to stay small) into timm's vit_*_patch14[_reg4]_dinov2 at 224 px."""
    source = official_dinov2(ARCHS[arch], depth=1, registers=registers)
    net = timm_dinov2(arch, registers, depth=1, img_size=224)
    load_backbone_weights(net, saved(tmp_path, source))
    assert_loaded_at_224(net, source, registers)


@pytest.mark.parametrize("registers", [False, True], ids=["plain", "reg"])
def test_loaded_official_weights_give_the_official_tokens(tmp_path, registers):
    """At 518 px (no resampling) timm's token preparation with the loaded weights equals DINOv2's own
    (prepare_tokens_with_masks): [cls, patches] + pos_embed, then the registers inserted after the class token."""
    source = official_dinov2(ARCHS["small"], depth=1, registers=registers)
    net = timm_dinov2("small", registers, depth=1)  # timm's default size for DINOv2: 518
    load_backbone_weights(net, saved(tmp_path, source))
    patches = torch.randn(2, OFFICIAL_GRID**2, ARCHS["small"], generator=torch.Generator().manual_seed(1))
    tokens = torch.cat([source["cls_token"].expand(2, -1, -1), patches], dim=1) + source["pos_embed"]
    if registers:
        tokens = torch.cat([tokens[:, :1], source["register_tokens"].expand(2, -1, -1), tokens[:, 1:]], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(net._pos_embed(patches), tokens, rtol=1e-6, atol=1e-6)


def test_official_dinov2_loads_into_a_dynamic_size_model(tmp_path):
    """`dynamic_img_size`: the checkpoint loads (mask_token dropped, not reported) and the model runs at other sizes."""
    source = official_dinov2(ARCHS["small"], depth=2, registers=False)
    net = timm_dinov2("small", False, depth=2, img_size=224, dynamic_img_size=True).eval()
    load_backbone_weights(net, saved(tmp_path, source))
    assert_loaded_at_224(net, source, registers=False)
    with torch.no_grad():
        for size in (224, 280):
            out = net(torch.randn(1, 3, size, size))
            assert out.shape == (1, ARCHS["small"]) and torch.isfinite(out).all()


@pytest.mark.parametrize("registers", [False, True], ids=["plain", "reg"])
def test_timms_own_dinov2_checkpoint_loads_at_224(tmp_path, registers):
    """timm's layout of the same weights (what its hub files hold: 518 px, `reg_token`, no mask_token)."""
    source = timm_dinov2("small", registers, depth=2).state_dict()
    assert source["pos_embed"].shape[1] == (0 if registers else 1) + OFFICIAL_GRID**2
    net = timm_dinov2("small", registers, depth=2, img_size=224)
    load_backbone_weights(net, saved(tmp_path, source))
    got = net.state_dict()
    for key, value in source.items():
        if key != "pos_embed":
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    prefix = 0 if registers else 1
    expected = resample_abs_pos_embed(source["pos_embed"], new_size=(TRAIN_GRID, TRAIN_GRID), num_prefix_tokens=prefix)
    torch.testing.assert_close(got["pos_embed"], expected, rtol=0, atol=0)
    assert got["pos_embed"].shape[1] == prefix + TRAIN_GRID**2


def test_dino_v1_teacher_layout_still_loads(tmp_path):
    """DINO's full checkpoint (`teacher` / `student`, `backbone.` prefixes, its projection head) at the model's size."""
    source = timm.create_model("vit_small_patch16_224", num_classes=0, depth=2).state_dict()
    teacher = {f"backbone.{k}": v for k, v in source.items()} | {"head.last_layer.weight_v": torch.zeros(4, 4)}
    net = timm.create_model("vit_small_patch16_224", num_classes=0, depth=2)
    load_backbone_weights(net, saved(tmp_path, {"teacher": teacher, "student": {}, "epoch": 100}))
    for key, value in net.state_dict().items():
        torch.testing.assert_close(value, source[key], rtol=0, atol=0, msg=key)


def test_a_training_checkpoint_that_pickles_its_arguments_is_refused_with_the_way_to_its_weights(tmp_path):
    """DINO's training checkpoint holds its `argparse.Namespace` beside the weights: reading it could run code, so it is
    refused in one line naming the file and the object; the recipe that line gives (for a file one trusts, here this
    test's own) yields a file that loads."""
    source = timm.create_model("vit_small_patch16_224", num_classes=0, depth=1).state_dict()
    teacher = {f"backbone.{k}": v for k, v in source.items()}
    path = tmp_path / "checkpoint.pth"
    torch.save({"teacher": teacher, "args": argparse.Namespace(arch="vit_small"), "epoch": 100}, path)
    net = timm.create_model("vit_small_patch16_224", num_classes=0, depth=1)
    with pytest.raises(CheckpointError) as err:
        load_backbone_weights(net, path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path} holds objects other than tensors")
    assert "(it holds argparse.Namespace)" in message and "point model.pretrained at that file" in message
    recipe = re.search(r"torch\.save\(.*?'weights\.pth'\)", message).group(0)
    exec(recipe.replace("'weights.pth'", repr(str(tmp_path / "w.pth"))), {"torch": torch})
    load_backbone_weights(net, tmp_path / "w.pth")
    for key, value in net.state_dict().items():
        torch.testing.assert_close(value, source[key], rtol=0, atol=0, msg=key)


def test_a_weights_file_cut_short_is_named(tmp_path):
    net = timm.create_model("vit_small_patch16_224", num_classes=0, depth=1)
    path = tmp_path / "weights.pth"
    torch.save(net.state_dict(), path)
    path.write_bytes(path.read_bytes()[:1000])  # a download cut short
    with pytest.raises(CheckpointError, match=r"cannot be read \(.*\); model.pretrained must be a PyTorch weights"):
        load_backbone_weights(net, path)


def test_a_timm_classifier_checkpoint_keeps_the_heads_feature_norm(tmp_path):
    """timm's ImageNet checkpoint of a model whose pooled features pass through `head.norm` (ConvNeXt): that norm
    loads, the classifier `head.fc` (absent with num_classes=0) is dropped."""
    classifier = timm.create_model("convnext_atto", num_classes=10)
    net = timm.create_model("convnext_atto", num_classes=0)
    load_backbone_weights(net, saved(tmp_path, classifier.state_dict()))
    source = classifier.state_dict()
    assert {"head.norm.weight", "head.fc.weight"} <= set(source) and "head.fc.weight" not in net.state_dict()
    for key, value in net.state_dict().items():
        torch.testing.assert_close(value, source[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("registers", [False, True], ids=["plain", "reg"])
def test_patch14_backbone_from_the_config_splits_its_frozen_prefix_exactly(tmp_path, registers):
    """build_backbone with an official checkpoint: the frozen-prefix forward (registers included) equals timm's plain
    forward on 224-pixel crops, and only the blocks from grad_from_block train."""
    source = official_dinov2(ARCHS["small"], depth=3, registers=registers)
    name = "vit_small_patch14_reg4_dinov2" if registers else "vit_small_patch14_dinov2"
    cfg = ModelConfig(
        backbone=name,
        backbone_kwargs={"img_size": 224, "depth": 3},
        pretrained=saved(tmp_path, source),
        grad_from_block=2,
    )
    backbone = build_backbone(cfg).eval()
    assert_loaded_at_224(backbone.net, source, registers)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    out = backbone(x)
    torch.testing.assert_close(out, backbone.net(x), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    for key, p in backbone.net.named_parameters():
        assert (p.grad is not None) == key.startswith("blocks.2."), key


def test_the_dinov2_configs_backbone_takes_the_official_vitb14_at_its_crop(tmp_path):
    """configs/dinov2-cub.yaml's backbone (one block, to stay small) with an official dinov2_vitb14 checkpoint."""
    cfg = load_config("configs/dinov2-cub.yaml")
    source = official_dinov2(ARCHS["base"], depth=1, registers=False)
    one_block = {**cfg.model.backbone_kwargs, "depth": 1}
    model_cfg = dataclasses.replace(cfg.model, backbone_kwargs=one_block, pretrained=saved(tmp_path, source))
    backbone = build_backbone(model_cfg)
    assert_loaded_at_224(backbone.net, source, registers=False)
    crop = cfg.data.crop_size
    assert backbone(torch.randn(2, 3, crop, crop)).shape == (2, ARCHS["base"])


def test_keys_left_over_after_the_filter_are_named(tmp_path):
    source = official_dinov2(ARCHS["small"], depth=2, registers=False)
    extra = source | {"blocks.1.attn.q_bias": torch.zeros(384)}
    del extra["norm.weight"]
    net = timm_dinov2("small", False, depth=2, img_size=224)
    with pytest.raises(ValueError, match="does not match the backbone") as err:
        load_backbone_weights(net, saved(tmp_path, extra))
    message = str(err.value)
    assert "missing ['norm.weight'], unexpected ['blocks.1.attn.q_bias']; check model.backbone" in message
    assert "mask_token" not in message  # dropped by the filter, as DINOv2's checkpoints always hold it


def test_checkpoint_of_another_width_is_named_by_shape(tmp_path):
    net = timm_dinov2("small", False, depth=1, img_size=224)
    with pytest.raises(ValueError, match=r"other shape \['cls_token \[1, 1, 768\] \(model \[1, 1, 384\]\)', 'pos_emb"):
        load_backbone_weights(net, saved(tmp_path, official_dinov2(ARCHS["base"], depth=1, registers=False)))


@pytest.mark.parametrize(
    "checkpoint_registers, model_registers, match",
    [
        (True, False, "has register tokens .* and the backbone none: use .*vit_base_patch14_reg4_dinov2"),
        (False, True, "the backbone has register tokens and checkpoint .* none: use the timm model without _reg4"),
    ],
)
def test_register_tokens_must_agree(tmp_path, checkpoint_registers, model_registers, match):
    net = timm_dinov2("small", model_registers, depth=1, img_size=224)
    with pytest.raises(ValueError, match=match):
        load_backbone_weights(net, saved(tmp_path, official_dinov2(ARCHS["small"], 1, checkpoint_registers)))


def test_patch_sizes_must_agree(tmp_path):
    """A 16-pixel DINO checkpoint is not resampled into a 14-pixel model (timm's filter would do it silently)."""
    dino = timm.create_model("vit_small_patch16_224", num_classes=0, depth=1).state_dict()
    net = timm_dinov2("small", False, depth=1, img_size=224)
    with pytest.raises(ValueError, match="16-pixel patches, the backbone 14-pixel ones: pick a model.backbone with"):
        load_backbone_weights(net, saved(tmp_path, dino))
