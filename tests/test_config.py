import dataclasses
from pathlib import Path

import pytest
import yaml

from infosieve_fast.config.settings import (
    Config,
    ConfigError,
    config_drift,
    from_dict,
    from_saved,
    load_config,
    save_config,
)

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_every_shipped_config_loads_and_round_trips(tmp_path):
    assert {p.stem for p in CONFIGS} >= {
        "cub",
        "scars",
        "aircraft",
        "pets",
        "herbarium19",
        "cifar10",
        "cifar100",
        "imagenet100",
        "demo",
        "dinov2-cub",
        "dinov2-scars",
        "dinov2-aircraft",
        "dinov2-pets",
    }
    for path in CONFIGS:
        cfg = load_config(path)
        save_config(cfg, tmp_path / "c.yaml")
        assert load_config(tmp_path / "c.yaml") == cfg, path


def test_paper_values_in_dataset_configs():
    cub, cifar10, herb = (
        load_config(p) for p in ("configs/cub.yaml", "configs/cifar10.yaml", "configs/herbarium19.yaml")
    )
    assert (cub.schedule.epochs, cub.data.batch_size, cub.optim.lr, cub.optim.momentum) == (200, 128, 0.1, 0.9)
    assert (cub.model.code_length, cub.model.grad_from_block, cifar10.model.grad_from_block) == (40, 10, 11)
    assert (cub.loss.label_smoothing, cifar10.loss.label_smoothing, herb.loss.label_smoothing) == (1.0, 0.0, 0.1)
    assert (cub.loss.delta, cub.loss.zeta, cub.loss.mu, cub.loss.eta, cub.loss.sup_con_weight) == (
        0.1,
        0.01,
        0.01,
        0.01,
        0.35,
    )
    assert herb.kmeans.balanced is False and cub.kmeans.balanced is True


@pytest.mark.parametrize("dataset", ["cub", "scars", "aircraft", "pets"])
def test_dinov2_configs_change_only_the_backbone(dataset):
    """DINOv2 ViT-B/14 at 224-pixel crops (timm's model is built at 518 unless told), the GCD papers' DINO
    optimisation, and every other value InfoSieve's DINO one."""
    dino, dinov2 = load_config(f"configs/{dataset}.yaml"), load_config(f"configs/dinov2-{dataset}.yaml")
    m = dinov2.model
    assert (m.backbone, m.backbone_kwargs, Path(m.pretrained).name) == (
        "vit_base_patch14_dinov2",
        {"img_size": 224},
        "dinov2_vitb14_pretrain.pth",
    )
    d, o, s = dinov2.data, dinov2.optim, dinov2.schedule
    assert (d.crop_size, o.lr, s.epochs, d.batch_size) == (224, 0.1, 200, 128)
    backbone = {"backbone": dino.model.backbone, "backbone_kwargs": {}, "pretrained": dino.model.pretrained}
    assert dataclasses.replace(dinov2, name=dataset, model=dataclasses.replace(m, **backbone)) == dino


@pytest.mark.parametrize("method", ["gcd", "simgcd", "selex"])
def test_cub100_heldout_method_configs_share_all_but_the_method(method):
    """docs/methods.md's cub100 held-out table: each method's config is cub100-heldout's backbone, data, optimiser,
    schedule, k-means and evaluation with that method's published CUB settings (docs/reference.md §12)."""
    infosieve, other = load_config("configs/cub100-heldout.yaml"), load_config(f"configs/cub100-heldout-{method}.yaml")
    assert other.method == method and other.name == f"cub100-heldout-{method}"
    for section in ("data", "optim", "schedule", "kmeans", "train"):
        assert getattr(other, section) == getattr(infosieve, section), section
    shared = ("backbone", "pretrained", "grad_from_block", "proj_hidden_dim", "proj_bottleneck_dim", "proj_layers")
    assert [getattr(other.model, k) for k in shared] == [getattr(infosieve.model, k) for k in shared]
    cub = {"gcd": {"sup_con_weight": 0.35, "temperature": 1.0, "supcon_temperature": 0.07},
           "simgcd": {"memax_weight": 2.0, "sup_weight": 0.35, "warmup_teacher_epochs": 30},
           "selex": {"smoothing": 1.0, "sup_con_weight": 0.35}}[method]  # fmt: skip
    assert {k: getattr(getattr(other, method), k) for k in cub} == cub


def test_unknown_keys_are_rejected_by_full_name():
    with pytest.raises(ConfigError, match=r"optim\.learning_rate"):
        from_dict({"optim": {"learning_rate": 0.1}})
    with pytest.raises(ConfigError, match="bogus"):
        from_dict({"bogus": 1})


def test_overrides_parse_yaml_values_and_reject_bad_ones(tmp_path):
    cfg = load_config("configs/cub.yaml", ["optim.lr=0.05", "kmeans.balanced=false", "data.labelled_share=0.5"])
    assert (cfg.optim.lr, cfg.kmeans.balanced, cfg.data.labelled_share) == (0.05, False, 0.5)
    assert load_config(None, ["model.grad_from_block=null"]).model.grad_from_block is None
    with pytest.raises(ConfigError, match="optim.lr must be float"):
        load_config(None, ["optim.lr=fast"])
    with pytest.raises(ConfigError, match="loss.length_weights must be one of"):
        load_config(None, ["loss.length_weights=fresh"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["optim.lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_defaults_are_the_reference_behaviour():
    cfg = Config()
    assert (cfg.loss.length_weights, cfg.loss.sup_code_input, cfg.loss.code_constraint, cfg.loss.categorizer_loss) == (
        "stale",
        "code",
        "reference",
        "bce",
    )
    assert (cfg.loss.label_smoothing, cfg.optim.weight_decay, cfg.data.color_jitter) == (1.0, 1e-4, 0.0)


def test_values_people_type_are_read_as_meant():
    cfg = load_config(None, ["train.amp=off", "optim.lr=1e-3", "optim.weight_decay=5e-5"])
    assert (cfg.train.amp, cfg.optim.lr, cfg.optim.weight_decay) == ("off", 0.001, 5e-5)
    with pytest.raises(ConfigError, match="train.amp must be str"):
        load_config(None, ["train.amp=on"])  # "on" is not one of its choices: still an error, naming the key


@pytest.mark.parametrize(
    "override, match",
    [
        ("schedule.epochs=-1", "schedule.epochs must be >= 1"),
        ("data.batch_size=0", "data.batch_size must be >= 2"),
        ("train.check_every=0", "train.check_every must be >= 1"),
        ("data.labelled_share=1.5", r"data.labelled_share must lie in \[0, 1\]"),
        ("kmeans.cluster_size=0", "kmeans.cluster_size must be >= 1"),
    ],
)
def test_out_of_range_values_fail_at_load(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_cluster_size_needs_a_balanced_round():
    with pytest.raises(ConfigError, match="kmeans.balanced and kmeans.eval_balanced are both false"):
        load_config("configs/herbarium19.yaml", ["kmeans.cluster_size=50", "kmeans.eval_balanced=false"])
    assert load_config("configs/cub.yaml", ["kmeans.cluster_size=50"]).kmeans.cluster_size == 50


def test_digits_settings_live_under_data_digits_and_old_run_folders_still_load(tmp_path):
    with pytest.raises(ConfigError, match="data.known_classes is now data.digits.known_classes"):
        load_config("configs/demo.yaml", ["data.known_classes=3"])
    with pytest.raises(ConfigError, match=r"data.digits.known_classes must lie in 1..9"):
        load_config("configs/demo.yaml", ["data.digits.known_classes=0"])
    with pytest.raises(ConfigError, match=r"data.digits.image_size \(20\) must be >= data.crop_size \(32\)"):
        load_config("configs/demo.yaml", ["data.digits.image_size=20"])
    # a run folder written before the move: its keys sat directly under data
    cfg = load_config("configs/demo.yaml", ["data.digits.known_classes=3", "data.digits.image_size=40"])
    old = cfg.to_dict()
    old["data"].update(old["data"].pop("digits"))
    assert "known_classes" in old["data"] and "digits" not in old["data"]
    assert from_saved(old) == cfg
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert load_config(tmp_path / "config.yaml", saved=True) == cfg
    assert config_drift(old, cfg.to_dict()) == {}


# The methods' published per-dataset settings, transcribed by hand from their repositories (not from the configs):
# CVMI-Lab/SimGCD scripts/run_*.sh; SarahRastegar/SelEx README.md and contrastive_training.py's argparse defaults;
# sgvaze/generalized-category-discovery bash_scripts/contrastive_train.sh and k_means.sh (one script for every dataset).
SIMGCD_MEMAX = {"cub": 2.0, "cifar100": 4.0}  # 1.0 for every other dataset
SELEX_SMOOTHING = {"cub": 1.0, "scars": 1.0, "aircraft": 0.5, "pets": 0.5, "herbarium19": 1.0}  # 0.1 generic
# herbarium19: the argparse default (the README names no value for it)
METHOD_DATASETS = ("cub", "scars", "aircraft", "herbarium19", "cifar10", "cifar100", "imagenet100")


def published_settings(method: str, dataset: str) -> dict:
    """{dotted key: value} that the method's repository sets for `dataset`."""
    shared = {"optim.name": "sgd", "optim.lr": 0.1, "optim.momentum": 0.9, "optim.min_lr_ratio": 1e-3,
              "schedule.epochs": 200, "data.batch_size": 128, "model.proj_hidden_dim": 2048,
              "model.proj_bottleneck_dim": 256, "train.eval_protocol": "v2"}  # fmt: skip
    if method == "gcd":
        return shared | {"gcd.sup_con_weight": 0.35, "model.grad_from_block": 11, "optim.weight_decay": 5e-5,
                         "kmeans.n_init": 100, "kmeans.max_iter": 200, "kmeans.balanced": False,
                         "kmeans.balance": "capacity", "kmeans.eval_balanced": False}  # fmt: skip
    if method == "simgcd":
        return shared | {"simgcd.memax_weight": SIMGCD_MEMAX.get(dataset, 1.0), "simgcd.sup_weight": 0.35,
                         "model.grad_from_block": 11, "optim.weight_decay": 5e-5,
                         "simgcd.warmup_teacher_temperature": 0.07, "simgcd.teacher_temperature": 0.04,
                         "simgcd.warmup_teacher_epochs": 30}  # fmt: skip
    balanced = dataset != "herbarium19"  # --unbalanced 1 for the long-tailed Herbarium19
    return shared | {"selex.smoothing": SELEX_SMOOTHING.get(dataset, 0.1), "selex.sup_con_weight": 0.35,
                     "selex.level_order": "published", "optim.weight_decay": 1e-4,
                     "model.grad_from_block": 9 if dataset == "scars" else 10,
                     "kmeans.balanced": balanced, "kmeans.eval_balanced": balanced}  # fmt: skip


@pytest.mark.parametrize("dataset", [*METHOD_DATASETS, "pets"])
def test_each_methods_paper_config_holds_its_published_settings_on_the_datasets_data(dataset):
    """configs/<dataset>-<method>.yaml: the method's published values, and the data, backbone and split of
    configs/<dataset>.yaml (what makes the methods' runs comparable); only SelEx publishes a Pets setting."""
    base = load_config(f"configs/{dataset}.yaml")
    methods = ("gcd", "simgcd", "selex") if dataset != "pets" else ("selex",)
    shipped = {p.stem for p in CONFIGS if p.stem.startswith(f"{dataset}-")}
    assert shipped - {f"dinov2-{dataset}"} == {f"{dataset}-{m}" for m in methods}
    for method in methods:
        cfg = load_config(f"configs/{dataset}-{method}.yaml")
        assert (cfg.name, cfg.method, cfg.data) == (f"{dataset}-{method}", method, base.data)
        assert (cfg.model.backbone, cfg.model.pretrained) == (base.model.backbone, base.model.pretrained)
        values = cfg.to_dict()
        for key, want in published_settings(method, dataset).items():
            section, name = key.split(".")
            assert values[section][name] == want, f"{dataset}-{method}: {key}"
