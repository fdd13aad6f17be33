"""The own-images route fails where the person can act, and gives one answer per image: a run on shards of
`labelled/` + `unlabelled/` real CIFAR-10 images (no test split) through eval, tree, predict and report; train's
checks before its run folder; shard file modes; the shards' stored size against the crop."""

from __future__ import annotations

import html
import json
import os
import stat

import numpy as np
import pytest
import torch

from infosieve_fast import cli
from infosieve_fast.commands.predict import model_from_run
from infosieve_fast.common.labels import NO_LABEL
from infosieve_fast.config.settings import ConfigError, load_config
from infosieve_fast.data.reading.augment import AugmentConfig, DeviceAugment
from infosieve_fast.data.writing.layout_discovery import read_discovery
from infosieve_fast.data.writing.shards import make_shards
from infosieve_fast.training.run_folder import train
from infosieve_fast.training.trainer_setup import check_config_fits_shards, check_stored_size
from tests.test_engine import SMOKE

KNOWN, NOVEL = ("airplane", "automobile"), ("bird", "cat")


def _link_images(realdata, cls: str, lo: int, hi: int, folder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for src in sorted((realdata / "cifar10_test" / "test" / cls).glob("*.jpg"))[lo:hi]:
        (folder / f"{cls}_{src.name}").symlink_to(src)


def own_images(realdata, base) -> None:
    """base/mine: 12 labelled images of each of 2 known CIFAR-10 classes, a pool of 6 more of each and 18 of each of
    2 novel classes; base/shards: its shards stored at 40 px."""
    for cls in KNOWN:
        _link_images(realdata, cls, 0, 12, base / "mine" / "labelled" / cls)
        _link_images(realdata, cls, 12, 18, base / "mine" / "unlabelled")
    for cls in NOVEL:
        _link_images(realdata, cls, 0, 18, base / "mine" / "unlabelled" / "more")
    make_shards("discovery", base / "mine", base / "shards", resize=40, progress=False)


@pytest.fixture(scope="module")
def pool_run(realdata, tmp_path_factory):
    """A finished 1-epoch run (K = 4) on `own_images` (crop 32)."""
    base = tmp_path_factory.mktemp("ownimages")
    own_images(realdata, base)
    cfg = load_config(
        "configs/demo.yaml",
        [*SMOKE[3:], "schedule.epochs=1", "data.source=shards", f"data.shards={base / 'shards'}",
         "data.batch_size=32", "data.num_workers=0", "model.backbone_kwargs={in_chans: 3}", "kmeans.n_clusters=4",
         "data.mean=[0.5, 0.5, 0.5]", "data.std=[0.25, 0.25, 0.25]", "train.device=cpu"],
    )  # fmt: skip
    train(cfg, base / "run")
    return base, cfg


def test_eval_on_a_run_without_test_split_names_the_fix_and_train_does_not_suggest_it(pool_run, capsys):
    base, _ = pool_run
    assert cli.main(["eval", "--run", str(base / "run"), "--split", "test"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hold no test split" in err and "drop --split test" in err
    from infosieve_fast.training.run_folder import print_next_steps

    print_next_steps(base / "run", test_split=False)
    print_next_steps(base / "run", test_split=True)
    hints = [line for line in capsys.readouterr().out.splitlines() if "infosieve eval" in line]
    assert "--split test" not in hints[0] and "--split test" in hints[1]


def test_the_next_steps_of_a_run_on_your_own_images_go_through_predict_name_and_export(pool_run, capsys, tmp_path):
    """train's "next:" lines follow what the run is for: on your own images predict (the pool folder the shards were
    made of), name and export; without a novel cluster holding a pool image, that no new category was found."""
    from infosieve_fast.evaluation.discovery import nothing_new, pool_section
    from infosieve_fast.training.run_folder import print_next_steps

    base, _ = pool_run
    run, shards = base / "run", str(base / "shards")
    print_next_steps(run, shards=shards)
    steps = capsys.readouterr().out.splitlines()
    assert f"  infosieve predict --run {run} --images {base / 'mine' / 'unlabelled'} --out " \
        f"{run / 'predictions.jsonl'}   # every pool image: its cluster, name and margin" in steps  # fmt: skip
    assert any(f"infosieve name --run {run} novel-K=NAME" in line for line in steps)
    assert any(f"infosieve export --run {run} --out NEW_FOLDER" in line for line in steps)
    print_next_steps(run)  # the shards unknown (a finished run resumed before this change passed them): no guess
    assert "predict" not in capsys.readouterr().out
    # the same run with every pool image in a known class's cluster (K = the known classes): nothing new, said so
    with np.load(run / "clustering.npz") as z:
        clustering = {k: z[k] for k in z.files}
    clustering["preds"] = clustering["preds"] % len(KNOWN)
    np.savez(tmp_path / "clustering.npz", **clustering)
    print_next_steps(tmp_path, shards=shards)
    steps = capsys.readouterr().out.splitlines()
    assert any("infosieve predict" in line for line in steps) and not any("infosieve name" in line for line in steps)
    assert f"  # {nothing_new(len(KNOWN))}" in steps and "No new category was found" in nothing_new(len(KNOWN))
    said = html.escape(nothing_new(len(KNOWN)))
    assert said in pool_section(tmp_path, clustering, list(KNOWN), len(KNOWN))
    assert said not in pool_section(run, {**clustering, "preds": np.full_like(clustering["preds"], 3)},
                                                       list(KNOWN), 4)  # fmt: skip


def test_new_cannot_be_measured_so_eval_and_tree_print_na(pool_run, capsys):
    """The pool has no label: New is n/a in eval's table and in the codes' line of eval and tree, as in train's."""
    base, _ = pool_run
    assert cli.main(["eval", "--run", str(base / "run")]) == 0
    assert cli.main(["tree", "--run", str(base / "run"), "--depth", "3"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("last (train)"))
    assert row.split()[-3:] == ["n/a"] * 3  # no labelled image was held out, so All and Old cannot be measured either
    codes = [line for line in out.splitlines() if line.startswith("codes: SS-k-means")]
    assert len(codes) == 2 and all("New n/a" in line and "0.0000" not in line.split("New")[1] for line in codes)
    tree = json.loads((base / "run" / "tree.json").read_text())
    assert tree["measures"]["new"] is None


def test_predict_gives_the_runs_own_cluster_to_every_image_it_clustered(pool_run, realdata, tmp_path, capsys):
    """Every pool image (by folder, found by content) gets clustering.npz's cluster of its uq; an image the run never
    saw gets its nearest centre, computed here from the checkpoint's model."""
    base, cfg = pool_run
    extra = tmp_path / "new"
    _link_images(realdata, "bird", 30, 34, extra)
    images = base / "mine" / "unlabelled"
    out = tmp_path / "pred.jsonl"
    assert cli.main(["predict", "--run", str(base / "run"), "--images", str(images), "--out", str(out),
                     "--device", "cpu"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    raw = read_discovery(base / "mine")
    uq_of = {name: uq for uq, name in enumerate(raw.train_names)}
    with np.load(base / "run" / "clustering.npz") as z:
        run_cluster = dict(zip(z["uq"].tolist(), z["preds"].tolist(), strict=True))
        pool = int((z["targets"] == NO_LABEL).sum())
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == pool == 48 and f"{pool} of them the run itself clustered" in printed
    for r in records:
        uq = uq_of["unlabelled/" + os.path.relpath(r["path"], images)]
        assert r["cluster"] == run_cluster[uq], r["path"]

    out_new = tmp_path / "new.jsonl"
    assert cli.main(["predict", "--run", str(base / "run"), "--images", str(extra), "--out", str(out_new)]) == 0
    assert "the run itself clustered" not in capsys.readouterr().out
    model, state = model_from_run(base / "run", torch.device("cpu"))
    from PIL import Image

    from infosieve_fast.data.writing.encode import resize_image

    aug = DeviceAugment(AugmentConfig(cfg.data.crop_size, False, tuple(cfg.data.mean), tuple(cfg.data.std)))
    pics = [np.asarray(resize_image(Image.open(p).convert("RGB"), 36)) for p in sorted(extra.iterdir())]
    x = torch.from_numpy(np.stack(pics)).permute(0, 3, 1, 2)  # CIFAR images are square: one size
    with torch.no_grad():
        nearest = torch.cdist(model.features(aug.test_view(x)), state["centers"]).argmin(1)
    assert [json.loads(line)["cluster"] for line in out_new.read_text().splitlines()] == nearest.tolist()


def test_report_says_what_its_pool_columns_count(pool_run, capsys):
    base, _ = pool_run
    assert cli.main(["report", "--run", str(base / "run")]) == 0
    page = (base / "run" / "report.html").read_text()
    assert "pool images and held-out images count the run&#x27;s own final clustering" in page


def test_predict_refuses_an_input_with_no_image_to_sort(pool_run, tmp_path, capsys):
    base, _ = pool_run
    (tmp_path / "empty").mkdir()
    listing = tmp_path / "list.txt"
    listing.write_text("gone/a.jpg\ngone/b.jpg\n")
    for images, says in ((tmp_path / "empty", "holds no images"), (listing, "none of the 2 images")):
        out = tmp_path / "p.jsonl"
        assert cli.main(["predict", "--run", str(base / "run"), "--images", str(images), "--out", str(out)]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[-1].startswith("error: ") and says in err[-1] and str(images) in err[-1]
        assert not out.exists()


def test_train_names_its_run_folder_only_once_the_checks_pass(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--config", "configs/demo.yaml", "--out", str(run), "--set", "data.source=shards"]
    assert cli.main([*argv, "--set", f"data.shards={tmp_path / 'nowhere'}"]) == 2
    out = capsys.readouterr()
    assert "run folder:" not in out.out and not run.exists() and "error:" in out.err


def test_shards_get_the_mode_of_an_ordinary_new_file(pool_run, tmp_path):
    base, _ = pool_run
    ordinary = tmp_path / "ordinary"
    ordinary.write_bytes(b"")  # open() applies the umask to 0666
    want = stat.S_IMODE(ordinary.stat().st_mode)
    shards = base / "shards"
    written = [*shards.glob("*.tar"), shards / "manifest.json", base / "run" / "checkpoint.pt"]
    assert len(written) >= 3 and {stat.S_IMODE(p.stat().st_mode) for p in written} == {want}


def test_stored_size_against_the_crop(capsys):
    """crop 112 is made for 128 px (int(112 / 0.875)): 256 px warns with both sizes and the fix, up to 1.5 x 128
    is quiet, below the crop is refused."""
    check_stored_size(256, 112, "/s")
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "256 px" in err and "data.crop_size 112" in err and "--resize 128" in err
    assert "4.0x the pixels" in err
    for quiet in (128, 192, None):
        check_stored_size(quiet, 112, "/s")
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="store images at 100 px .* smaller than data.crop_size 112"):
        check_stored_size(100, 112, "/s")


def test_the_stored_size_fix_names_what_set_the_size(capsys):
    """A size that data.resize or the foreign shards' default set is not fixed by making the shards again: the line
    says what serves that size and that data.resize changes it."""
    for served_by, what in (("data.resize", "data.resize=256 serves"), ("foreign", "foreign shards /s are served")):
        check_stored_size(256, 112, "/s", served_by)
        err = capsys.readouterr().err.strip()
        assert what in err and err.endswith("the pixels it needs; set data.resize=128") and "--resize" not in err
        with pytest.raises(ConfigError, match=r"at 100 px .*data.crop_size 112: set data.resize=128, or set data"):
            check_stored_size(100, 112, "/s", served_by)


def test_a_paper_config_on_another_paper_datasets_shards_warns(capsys):
    """configs/cub.yaml (or dinov2-cub.yaml) on scars shards: a warning naming both and the config to use; a config
    on its own dataset, on your own images, on foreign shards or on a subset layout is quiet."""
    for name in ("cub", "dinov2-cub"):
        check_config_fits_shards(name, "scars", "/s")
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"the config '{name}' holds the paper's settings for cub" in err
        assert "the shards /s hold scars: train with configs/scars.yaml" in err
    check_config_fits_shards("cub-simgcd", "scars", "/s")  # a method's paper config: the same method's for scars
    err = capsys.readouterr().err.strip()
    assert "the config 'cub-simgcd' holds the paper's settings for cub" in err
    assert "train with configs/scars-simgcd.yaml, or --set name=scars-simgcd" in err
    for name, dataset in (("cub", "cub"), ("dinov2-cub", "discovery"), ("cub100-tree", "cubfiles"), ("demo", None),
                          ("cub", "webdataset"), ("imagenet1k", "imagenet1k"), ("scars-selex", "scars")):  # fmt: skip
        check_config_fits_shards(name, dataset, "/s")
    assert capsys.readouterr().err == ""
