import pytest
import timm
import torch

import infosieve_kernels as kernels
from infosieve_fast.config.settings import ModelConfig
from infosieve_fast.network.model import (
    Backbone,
    InfoSieve,
    Labeller,
    ProjectionHead,
    build_backbone,
    load_backbone_weights,
)

TINY_VIT = dict(backbone="vit_tiny_patch16_224", backbone_kwargs={"depth": 4, "img_size": 32, "patch_size": 8})


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(TINY_VIT, proj_hidden_dim=32, proj_bottleneck_dim=16, proj_out_dim=64, code_length=8)
    base.update(kw)
    return ModelConfig(**base)


def test_grad_from_block_freezes_exactly_the_reference_set():
    backbone = build_backbone(tiny_cfg(grad_from_block=2))
    trainable = {n for n, p in backbone.net.named_parameters() if p.requires_grad}
    frozen = {n for n, p in backbone.net.named_parameters() if not p.requires_grad}
    assert trainable and all(n.startswith(("blocks.2.", "blocks.3.")) for n in trainable)
    assert {n for n in frozen if n.startswith(("blocks.2.", "blocks.3."))} == set()
    # docs/reference.md §2.1: patch_embed, cls_token, pos_embed and the final norm stay frozen
    assert {"cls_token", "pos_embed", "norm.weight", "norm.bias", "patch_embed.proj.weight"} <= frozen
    assert all(n.startswith(("blocks.0.", "blocks.1.")) for n in frozen if n.startswith("blocks."))


def test_split_forward_equals_the_plain_forward_and_frozen_blocks_get_no_grad():
    torch.manual_seed(0)
    backbone = build_backbone(tiny_cfg(grad_from_block=3)).eval()
    x = torch.randn(2, 3, 32, 32)
    out = backbone(x)
    torch.testing.assert_close(out, backbone.net(x), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    for name, p in backbone.net.named_parameters():
        assert (p.grad is not None) == name.startswith("blocks.3."), name


def test_frozen_bf16_runs_the_frozen_prefix_in_bf16_and_trains_the_rest_in_fp32():
    torch.manual_seed(0)
    reference = build_backbone(tiny_cfg(grad_from_block=2)).eval()
    backbone = build_backbone(tiny_cfg(grad_from_block=2), frozen_bf16=True).eval()
    backbone.load_state_dict(reference.state_dict())  # same weights, cast to each side's dtypes
    for name, p in backbone.net.named_parameters():
        trained_part = name.startswith(("blocks.2.", "blocks.3.", "norm."))
        assert p.dtype == (torch.float32 if trained_part else torch.bfloat16), name
    x = torch.randn(2, 3, 32, 32)
    out = backbone(x)
    assert out.dtype == torch.float32  # the trained blocks and the final norm run in fp32 outside autocast
    # bf16 rounding of the frozen blocks' weights and activations only: close to the fp32 forward, not equal
    torch.testing.assert_close(out, reference(x), rtol=0.05, atol=0.05)
    assert not torch.equal(out, reference(x))
    out.sum().backward()
    for name, p in backbone.net.named_parameters():
        assert (p.grad is not None) == name.startswith(("blocks.2.", "blocks.3.")), name
    restored = build_backbone(tiny_cfg(grad_from_block=2))
    restored.load_state_dict(backbone.state_dict())  # a frozen_bf16 checkpoint loads into an fp32 model
    assert all(p.dtype == torch.float32 for p in restored.parameters())


def test_frozen_bf16_needs_a_frozen_prefix():
    with pytest.raises(ValueError, match="needs a frozen block prefix"):
        build_backbone(tiny_cfg(grad_from_block=None), frozen_bf16=True)


def test_grad_from_block_none_trains_everything():
    backbone = build_backbone(tiny_cfg(grad_from_block=None))
    assert all(p.requires_grad for p in backbone.parameters())


def _dino_layout(state: dict) -> dict:
    teacher = {f"backbone.{k}": v for k, v in state.items()}
    teacher["head.mlp.0.weight"] = torch.zeros(3, 3)  # the DINO projection head, not part of the backbone
    return {"teacher": teacher, "student": {}, "epoch": 100}


@pytest.mark.parametrize("layout", ["timm", "dino", "module_prefix"])
def test_local_checkpoint_loads_in_timm_and_dino_layouts(tmp_path, layout):
    source = timm.create_model(TINY_VIT["backbone"], num_classes=0, **TINY_VIT["backbone_kwargs"])
    state = source.state_dict()
    payload = {
        "timm": state,
        "dino": _dino_layout(state),
        "module_prefix": {f"module.{k}": v for k, v in state.items()},
    }
    path = tmp_path / "weights.pth"
    torch.save(payload[layout], path)
    net = timm.create_model(TINY_VIT["backbone"], num_classes=0, **TINY_VIT["backbone_kwargs"])
    load_backbone_weights(net, path)
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)


def test_missing_or_mismatched_checkpoint_gives_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        build_backbone(tiny_cfg(pretrained=str(tmp_path / "dino_vitbase16_pretrain.pth")))
    torch.save({"teacher": {"backbone.not_a_key": torch.zeros(1)}}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="does not match the backbone"):
        build_backbone(tiny_cfg(pretrained=str(tmp_path / "bad.pth")))
    with pytest.raises(ValueError, match="not a timm model"):
        build_backbone(tiny_cfg(backbone="no_such_model_xyz"))


def test_projection_head_matches_dinohead_layout_and_math():
    head = ProjectionHead(24, 32, 16, 64)
    keys = set(head.state_dict())
    assert keys == {f"mlp.{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")} | {
        "last_layer.weight_g",
        "last_layer.weight_v",
    }
    assert head.last_layer.weight_g.shape == (64, 1) and not head.last_layer.weight_g.requires_grad
    x = torch.randn(5, 24)
    h = torch.nn.functional.normalize(head.mlp(x), dim=-1)
    v = head.last_layer.weight_v
    torch.testing.assert_close(head(x), h @ (v / v.norm(dim=1, keepdim=True)).T)
    assert head.mlp[0].bias.abs().sum() == 0 and head.mlp[0].weight.std() < 0.03  # trunc_normal(0.02), bias 0


def test_labeller_keys_buffers_and_forward_match_the_reference():
    torch.manual_seed(0)
    lab = Labeller(in_dim=64, code_length=8, n_classes=3)
    keys = set(lab.state_dict())
    for part, n_out in (("coder", 8), ("masker", 8), ("categorizer", 3)):
        assert {f"{part}.{i}.weight" for i in (0, 2, 4, 6)} <= keys
        assert getattr(lab, part)[6].out_features == n_out
    assert {"age", "code_weight", "length_weight"} <= keys  # saved with checkpoints (the reference loses them)
    lab.set_schedule(age=1.5, base=1.6, length_base=2.0)
    torch.testing.assert_close(lab.code_weight, 1.6 ** -torch.arange(8.0))
    x = torch.randn(6, 64)
    code_feat, head = lab(x, backend="torch")
    z = torch.tanh(1.5 * lab.coder(x))
    m = (torch.tanh(lab.masker(x) + 1 / 2.5) + 1) / 2
    torch.testing.assert_close(code_feat, lab.coder(x))
    torch.testing.assert_close(head.code_raw, z)
    torch.testing.assert_close(head.mask, m)
    torch.testing.assert_close(head.trunc_code, m * z * 1.6 ** -torch.arange(8.0))
    torch.testing.assert_close(head.length, (m * 2 ** torch.arange(8.0)).sum() / (2**8 - 1))
    restored = Labeller(in_dim=64, code_length=8, n_classes=3)
    restored.load_state_dict(lab.state_dict())
    assert float(restored.age) == 1.5 and torch.equal(restored.code_weight, lab.code_weight)


def test_infosieve_accepts_any_backbone_module():
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 10))
    model = InfoSieve(tiny_cfg(), n_old=2, backbone=Backbone(net, 10, grad_from_block=None))
    out = model(torch.randn(4, 3, 2, 2))
    assert out.projection.shape == (4, 64) and out.category_logits.shape == (4, 2)
    torch.testing.assert_close(out.projection.norm(dim=1), torch.ones(4))
    assert isinstance(out.head, kernels.CodeHead)


def test_code_block_runs_in_fp32_under_autocast():
    lab = Labeller(in_dim=16, code_length=8, n_classes=3, hidden_dim=8)
    x = torch.nn.functional.normalize(torch.randn(6, 16), dim=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, head = lab(x, backend="torch")
    assert all(t.dtype == torch.float32 for t in head), [t.dtype for t in head]
