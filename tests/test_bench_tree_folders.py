"""bench_tree reuses a run folder only for the same config and never overwrites one that holds another config's run;
bench_tree_ablation refuses a `--set` that its cached backbone features would ignore."""

import pytest

from benchmarks.bench_tree import refuse_other_config
from infosieve_fast.config.settings import load_config, save_config


def test_a_folder_of_another_config_is_refused_and_left_as_it_was(tmp_path):
    run = tmp_path / "tree-seed1"
    run.mkdir()
    save_config(load_config("configs/demo-tree.yaml", ["train.seed=1"]), run / "config.yaml")
    before = (run / "config.yaml").read_bytes()
    refuse_other_config(load_config("configs/demo-tree.yaml", ["train.seed=1"]), run)  # the same: reused
    refuse_other_config(load_config("configs/demo-tree.yaml", ["train.seed=1"]), tmp_path / "absent")  # new folder
    with pytest.raises(
        SystemExit,
        match=r"tree-seed1 holds a run of another config \(loss.code_supcon_temperature: "
        r"None there, 0.2 now; train.seed: 1 there, 2 now\)",
    ):
        refuse_other_config(
            load_config("configs/demo-tree.yaml", ["train.seed=2", "loss.code_supcon_temperature=0.2"]), run
        )
    assert (run / "config.yaml").read_bytes() == before


def test_each_species_range_has_its_own_shard_folder(tmp_path):
    from benchmarks.bench_tree import subset_folder

    assert subset_folder(tmp_path, 20, 0) == tmp_path / "cub20"  # the folder the first species always had
    assert subset_folder(tmp_path, 20, 60) == tmp_path / "cub60-79"
    ranges = [(classes, first) for classes in (1, 2, 20, 60, 80) for first in (0, 1, 20, 60) if first + classes <= 100]
    folders = {subset_folder(tmp_path, classes, first) for classes, first in ranges}
    assert len(folders) == len(ranges)  # two ranges never share shards


@pytest.mark.parametrize("item", ["data.crop_size=64", "model.backbone=vit_small_patch16_224", "train.frozen_bf16=1"])
def test_the_ablation_refuses_a_setting_its_cached_features_fix(item, capsys):
    from benchmarks.bench_tree_ablation import main

    with pytest.raises(SystemExit) as exit_:
        main(["--set", "loss.zeta=10.0", "--set", item, "--out", "/nonexistent/never-written"])
    assert exit_.value.code == 2
    assert f"--set {item}: the variants train on cached features" in capsys.readouterr().err
