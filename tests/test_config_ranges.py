"""Every setting of the model, loss, optim, schedule, kmeans and method (gcd, simgcd, selex) sections is checked when
the config loads: one bad value per key fails with a one-line ConfigError that starts with the key's dotted name, one
good value loads. The keys come from the dataclasses, so a new setting without a case here (and a check in
config_checks.py) fails."""

import dataclasses
import json

import pytest

from infosieve_fast import cli
from infosieve_fast.config.settings import (
    METHOD_SECTIONS,
    ConfigError,
    GCDConfig,
    KMeansConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
    SelExConfig,
    SimGCDConfig,
    load_config,
)

SECTIONS = {
    "model": ModelConfig,
    "loss": LossConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "kmeans": KMeansConfig,
    "gcd": GCDConfig,
    "simgcd": SimGCDConfig,
    "selex": SelExConfig,
}
KEYS = [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]

# key: (a bad value, a good value other than the default)
CASES = {
    "model.backbone": ("", "vit_base_patch14_dinov2"),
    "model.pretrained": ("", "/weights/dinov2_vitb14_pretrain.pth"),
    "model.backbone_kwargs": ({"img_size": 32}, {"img_size": 224, "depth": 6}),  # img_size must be data.crop_size
    "model.grad_from_block": (-1, 11),
    "model.proj_hidden_dim": (0, 512),
    "model.proj_bottleneck_dim": (0, 128),
    "model.proj_out_dim": (-5, 1024),
    "model.proj_layers": (1, 2),
    "model.code_length": (0, 16),
    "model.labeller_hidden_dim": (0, 64),
    "model.labeller_layers": (-1, 0),
    "loss.alpha": (-0.1, 0.5),
    "loss.beta": (-1.0, 0.5),
    "loss.delta": (float("nan"), 0.0),
    "loss.zeta": (-0.01, 0.1),
    "loss.mu": (float("inf"), 0.0),
    "loss.eta": (-0.01, 1.0),
    "loss.sup_con_weight": (1.5, 0.5),
    "loss.sup_code_weight": (-0.1, 0.6),
    "loss.temperature": (0.0, 0.5),
    "loss.supcon_temperature": (-0.07, 0.1),
    "loss.label_smoothing": (1.1, 0.0),
    "loss.length_weights": ("fresh", "current"),
    "loss.sup_code_input": ("raw", "trunc_code"),
    "loss.code_constraint": ("strict", "paper"),
    "loss.categorizer_loss": ("mse", "ce"),
    "loss.code_distance": ("cosine", "euclidean"),
    "loss.code_temperature": (0.0, 0.2),
    "loss.code_supcon_temperature": (-1.0, 0.2),
    "loss.code_label_smoothing": (2.0, 0.0),
    "loss.code_infonce_input": ("bits", "code"),
    "loss.labeller_grad_stop": ("all", "backbone"),
    "optim.name": ("adam", "adamw"),
    "optim.lr": (0.0, 0.05),
    "optim.momentum": (1.0, 0.5),
    "optim.weight_decay": (-1e-4, 0.0),
    "optim.min_lr_ratio": (1.5, 0.0),
    "optim.backbone_lr_scale": (1.5, 0.1),
    "schedule.epochs": (0, 100),
    "schedule.age_max": (0.0, 10.0),
    "schedule.base_start": (1.0, 3.0),  # the base falls by up to 1: at 1 it would reach 0
    "kmeans.n_init": (0, 3),
    "kmeans.max_iter": (0, 20),
    "kmeans.tol": (-1e-4, 0.0),
    "kmeans.balanced": ("maybe", False),
    "kmeans.balance": ("sinkhorn", "capacity"),
    "kmeans.backend": ("cuml", "torch"),
    "kmeans.eval_balanced": ("sometimes", False),
    "kmeans.distance_precision": ("fp16", "bf16"),
    "kmeans.n_clusters": (1, "auto"),
    "kmeans.k_rule": ("silhouette", "score"),
    "kmeans.cluster_size": (0, 50),
    "kmeans.freeze_labelled_centers": ("always", True),
    "gcd.sup_con_weight": (1.5, 0.5),
    "gcd.temperature": (0.0, 0.5),
    "gcd.supcon_temperature": (-0.07, 0.1),
    "simgcd.memax_weight": (-1.0, 4.0),
    "simgcd.sup_weight": (1.1, 0.5),
    "simgcd.student_temperature": (0.0, 0.2),
    "simgcd.warmup_teacher_temperature": (0.0, 0.05),
    "simgcd.teacher_temperature": (-0.04, 0.05),
    "simgcd.warmup_teacher_epochs": (0, 10),
    "simgcd.temperature": (0.0, 0.5),
    "simgcd.supcon_temperature": (0.0, 0.1),
    "selex.smoothing": (1.5, 0.5),
    "selex.sup_con_weight": (-0.1, 0.5),
    "selex.temperature": (0.0, 0.5),
    "selex.supcon_temperature": (0.0, 0.1),
    "selex.cluster_momentum": (1.5, 0.9),
    "selex.batch_features": ("whitened", "normalized"),
    "selex.level_order": ("sorted", "uq"),
}


def override(key: str, value) -> list[str]:
    """`--set key=value` as typed on the command line (JSON is YAML; NaN and Infinity are read as floats), after
    `method=<the section>` for a method's own setting."""
    section = key.split(".")[0]
    return [f"method={section}"] * (section in METHOD_SECTIONS) + [f"{key}={json.dumps(value)}"]


def test_every_setting_has_a_case():
    assert sorted(CASES) == sorted(KEYS), "give every new setting a bad and a good value here, and its check"


@pytest.mark.parametrize("key", KEYS)
def test_a_bad_value_fails_at_load_naming_the_key(key):
    assert key in CASES, f"{key}: add a bad and a good value to CASES and a check in config_checks.py"
    with pytest.raises(ConfigError) as err:
        load_config(None, override(key, CASES[key][0]))
    message = str(err.value)
    assert message.startswith(key + " ") or message.startswith(key + "."), message
    assert "\n" not in message


@pytest.mark.parametrize("key", KEYS)
def test_a_good_value_loads(key):
    good = CASES[key][1]
    assert good != getattr(SECTIONS[key.split(".")[0]](), key.split(".")[1])  # not the default: the value is read
    cfg = load_config(None, override(key, good))
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == good


@pytest.mark.parametrize(
    "override_, message",
    [
        ("loss.temperature=.inf", "loss.temperature must be > 0, got inf"),
        ("loss.label_smoothing=nan", r"loss.label_smoothing must lie in \[0, 1\], got nan"),
        ("loss.code_temperature=0", r"loss.code_temperature must be > 0 \(or null: loss.temperature\), got 0.0"),
        ("optim.momentum=1", r"optim.momentum must lie in \[0, 1\), got 1.0: set --set optim.momentum=<a value in"),
        ("model.code_length=0", r"model.code_length must be >= 1, got 0: set --set model.code_length=<a value >= 1>"),
    ],
)
def test_messages_state_the_range(override_, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override_])


def test_null_is_allowed_where_it_has_a_meaning():
    cfg = load_config(
        None,
        [
            f"{key}=null"
            for key in ("loss.code_temperature", "model.grad_from_block", "kmeans.cluster_size", "model.pretrained")
        ],
    )
    assert (cfg.loss.code_temperature, cfg.model.grad_from_block, cfg.kmeans.cluster_size) == (None, None, None)


def test_backbone_image_size_follows_the_crop():
    square = load_config(None, ["data.crop_size=112", "model.backbone_kwargs={img_size: [112, 112]}"])
    assert square.model.backbone_kwargs["img_size"] == [112, 112]
    dynamic = load_config(None, ["model.backbone_kwargs={img_size: 518, dynamic_img_size: true}"])
    assert dynamic.model.backbone_kwargs["img_size"] == 518  # a dynamic-size ViT takes any crop
    with pytest.raises(ConfigError, match=r"model.backbone_kwargs.img_size \(518\) must equal data.crop_size \(224\)"):
        load_config(None, ["model.backbone_kwargs={img_size: 518}"])


def test_the_issues_two_commands_stop_before_any_data_is_read(tmp_path, capsys):
    """`--set model.code_length=0` used to train until step 0 (NonFiniteLoss), `--set model.proj_out_dim=-5` to end in
    a torch traceback. Both now stop at load: the shards folder named does not exist and no run folder is made."""
    for bad, message in (
        ("model.code_length=0", "model.code_length must be >= 1"),
        ("model.proj_out_dim=-5", "model.proj_out_dim must be >= 1"),
    ):
        out = tmp_path / "run"
        argv = ["train", "--config", "configs/cub.yaml", "--data.shards", str(tmp_path / "no-shards"), "--set", bad]
        assert cli.main([*argv, "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()
