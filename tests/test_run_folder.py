"""The run folder and what a user meets around it (issue 11, items 2, 3, 5, 6): paths in config files, atomic
config.yaml, torn log lines, damaged checkpoints, config drift and `--set` on resume, a run killed before its first
checkpoint, user-error style, the progress a training shows and the make-shards summary."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from infosieve_fast import cli
from infosieve_fast.analysis.run_reader import describe_run
from infosieve_fast.common.files import CheckpointError, read_log
from infosieve_fast.config.settings import ConfigError, config_drift, load_config, save_config
from infosieve_fast.network.model import build_backbone
from infosieve_fast.training import checkpoint as ckpt
from infosieve_fast.training import engine
from infosieve_fast.training.checkpoint import load_checkpoint, save_checkpoint
from infosieve_fast.training.engine import Trainer
from infosieve_fast.training.run_folder import train
from tests.test_engine import SMOKE, smoke_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE_ARGS = [a for s in [*SMOKE, "train.device=cpu"] for a in ("--set", s)]


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


# ---------------------------------------------------------------------------------------------------- config paths
def test_relative_paths_in_a_config_file_resolve_against_its_folder(tmp_path, monkeypatch):
    folder = tmp_path / "project" / "configs"
    folder.mkdir(parents=True)
    (folder / "run.yaml").write_text("model:\n  pretrained: ../weights/w.pth\ndata:\n  shards: shards/cub\n")
    monkeypatch.chdir(tmp_path)  # anywhere else
    cfg = load_config(folder / "run.yaml")
    assert cfg.model.pretrained == str(tmp_path / "project" / "weights" / "w.pth")
    assert cfg.data.shards == str(folder / "shards" / "cub")
    # on the command line a relative path is the working directory's
    cfg = load_config(folder / "run.yaml", ["data.shards=here/cub", "model.pretrained=null"])
    assert cfg.data.shards == str(tmp_path / "here" / "cub") and cfg.model.pretrained is None
    # stored absolute: the run folder's config.yaml means the same from any working directory
    save_config(cfg, tmp_path / "run" / "config.yaml")
    monkeypatch.chdir(folder)
    assert load_config(tmp_path / "run" / "config.yaml") == cfg


def test_a_missing_pretrained_file_names_where_it_looked_and_the_rule():
    cfg = load_config("configs/cub.yaml", ["model.backbone=resnet10t"])  # the shipped path: REPO/weights/...
    expected = ROOT / "weights" / "dino_vitbase16_pretrain.pth"
    assert cfg.model.pretrained == str(expected)
    if expected.exists():
        pytest.skip("the DINO weights are present here")
    with pytest.raises(FileNotFoundError) as err:
        build_backbone(cfg.model)
    assert str(expected) in str(err.value) and "resolved against the file's folder" in str(err.value)


def test_config_yaml_is_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    save_config(smoke_config(), path)
    before = path.read_text()

    def failing_replace(*args):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.os, "replace", failing_replace)  # the last step of an atomic write
    with pytest.raises(OSError, match="disk full"):
        save_config(smoke_config("optim.lr=0.5"), path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_config_drift_names_the_differing_keys():
    saved = smoke_config().to_dict()
    now = smoke_config("optim.lr=0.5", "model.backbone_kwargs={in_chans: 3}").to_dict()
    assert config_drift(saved, now) == {"model.backbone_kwargs": ({"in_chans": 1}, {"in_chans": 3}),
                                        "optim.lr": (0.002, 0.5)}  # fmt: skip
    del saved["train"]["eval_every"]  # a checkpoint from before a key existed holds its default
    assert config_drift(saved, smoke_config().to_dict()) == {}


def test_invalid_yaml_names_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: [0.1\n")
    with pytest.raises(ConfigError, match=f"config file {bad} is not valid YAML"):
        load_config(bad)


# ---------------------------------------------------------------------------------------------------- log, checkpoint
def test_a_torn_last_log_line_is_dropped_with_a_warning(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text('{"epoch": 0, "lr": 0.1}\n{"epoch": 1, "lr": 0.05}\n{"epoch": 2, "l')
    assert read_log(log) == [{"epoch": 0, "lr": 0.1}, {"epoch": 1, "lr": 0.05}]
    assert f"warning: {log}: line 3 is torn" in capsys.readouterr().err


def test_a_damaged_log_line_elsewhere_names_the_file_and_line(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"epoch": 0, "lr": 0.1}\n{"epoch": 1, "l\n{"epoch": 2, "lr": 0.05}\n')
    with pytest.raises(CheckpointError, match=rf"{log}: line 2 is not a log record"):
        read_log(log)


def test_a_truncated_checkpoint_names_its_path_and_the_fix(tmp_path, capsys):
    save_checkpoint(tmp_path, {"epoch": 1, "weight": torch.ones(10_000)})
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"{path} cannot be read .*--resume {tmp_path}"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=rf"{path} cannot be read .*--resume {tmp_path}"):
        describe_run(tmp_path)  # what report and compare read, memory-mapped
    assert cli.main(["eval", "--run", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {path} cannot be read")


def test_checkpoints_load_weights_only(tmp_path):
    """Every value a training checkpoint holds is one `weights_only=True` allows; anything else is refused unread."""
    trainer = Trainer(smoke_config())
    trainer.centers = torch.zeros(3, 4)
    save_checkpoint(tmp_path, trainer.state_dict(1, {"all": 0.5, "old": 0.5, "new": 0.5}))
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == 1 and isinstance(state["torch_rng"], bytes) and state["class_names"][0] == "0"
    torch.save({"epoch": np.int64(1)}, tmp_path / "checkpoint.pt")  # a numpy scalar: a pickled global
    with pytest.raises(CheckpointError, match="holds objects other than tensors.*numpy"):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------------- resume
def test_resume_refuses_drift_records_set_and_never_reads_pretrained(tmp_path, capsys, monkeypatch):
    import timm

    weights = tmp_path / "weights" / "resnet10t.pth"
    weights.parent.mkdir()
    torch.save(timm.create_model("resnet10t", num_classes=0, in_chans=1).state_dict(), weights)
    run = tmp_path / "run"
    assert train(smoke_config(f"model.pretrained={weights}"), run, stop_after=lambda epoch: epoch == 0) is None
    weights.unlink()  # moved away: resuming must not need it (the checkpoint holds every weight)

    text = (run / "config.yaml").read_text()
    assert "  lr: 0.002\n" in text
    (run / "config.yaml").write_text(text.replace("  lr: 0.002\n", "  lr: 0.01\n"))  # edited by hand
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / 'config.yaml'} differs from its checkpoint's config")
    assert "optim.lr: 0.002 in the checkpoint, 0.01 now" in err and f"--resume {run} --set KEY=VALUE" in err
    (run / "config.yaml").write_text(text)
    # a --set that the saved weights cannot follow is refused before anything is written
    assert cli.main(["train", "--resume", str(run), "--set", "model.proj_out_dim=64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set model.proj_out_dim on resume") and "start a new run with --config" in err
    assert not (run / "resumes.jsonl").exists() and (run / "config.yaml").read_text() == text

    # an explicit --set is allowed and recorded before training goes on; stopped before the next checkpoint, the run
    # folder's config.yaml holds the change the checkpoint does not yet, which the record explains
    monkeypatch.setattr(engine.Trainer, "train_epoch", interrupt)
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume", str(run), "--set", "optim.lr=0.001"])
    monkeypatch.undo()
    (record,) = read_log(run / "resumes.jsonl")
    assert {k: record[k] for k in ("epoch", "set", "changed")} == {
        "epoch": 1, "set": ["optim.lr=0.001"], "changed": {"optim.lr": [0.002, 0.001]}
    }  # fmt: skip
    assert load_config(run / "config.yaml").optim.lr == 0.001
    assert load_checkpoint(run)["config"]["optim"]["lr"] == 0.002

    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run)]) == 0
    out, err = capsys.readouterr()
    state = load_checkpoint(run)
    assert state["config"]["optim"]["lr"] == 0.001 and state["config"]["model"]["pretrained"] == str(weights)
    log = read_log(run / "log.jsonl")
    assert [r["epoch"] for r in log] == [0, 1] and log[0]["lr"] == 0.002 and 0 < log[1]["lr"] <= 0.001
    # what the user saw: the stages of an epoch, a bar with a total, and the way on at the end
    assert "epoch 2/2: feature pass (320 samples)" in err and "epoch 2/2: SS-k-means pseudo-labels" in err
    # the bar shows its total from its first draw; a later draw is timed (tqdm's 0.1 s), so a fast epoch shows no other
    assert re.search(r"\d+%\|[^|]*\| [0-5]/5 \[", err), err
    assert "finished in " in out and f"run folder: {run}" in out
    for command in ("eval", "tree", "report"):
        assert f"infosieve {command} --run {run}" in out


def test_a_set_on_a_finished_run_is_refused_unless_it_raises_the_epochs(tmp_path, capsys):
    run = tmp_path / "run"
    train(smoke_config("schedule.epochs=1"), run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    capsys.readouterr()
    # lr alone leaves the finished run nothing to train: refused, and the folder is byte for byte as it was
    assert cli.main(["train", "--resume", str(run), "--set", "optim.lr=0.01"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: --set optim.lr on resume: {run} is finished (its 1 epochs trained")
    assert "--set schedule.epochs=2" in err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    # with more epochs the run goes on, and every change it carries is announced and recorded
    argv = ["train", "--resume", str(run), "--set", "optim.lr=0.001", "--set", "schedule.epochs=2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"resuming {run} at epoch 2/2" in out
    assert f"  --set optim.lr: 0.002 -> 0.001 (recorded in {run / 'resumes.jsonl'})" in out
    assert f"  --set schedule.epochs: 1 -> 2 (recorded in {run / 'resumes.jsonl'})" in out
    (record,) = read_log(run / "resumes.jsonl")
    assert record["epoch"] == 1 and record["changed"] == {"optim.lr": [0.002, 0.001], "schedule.epochs": [1, 2]}
    assert [r["epoch"] for r in read_log(run / "log.jsonl")] == [0, 1] and load_checkpoint(run)["epoch"] == 2


def test_a_run_killed_before_its_first_checkpoint_starts_again(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    save_config(smoke_config(), run / "config.yaml")
    (run / "log.jsonl").write_text('{"epoch": 0, "lr": 0.0')  # what a kill can leave
    (run / ".checkpoint.pt.x1.tmp").write_bytes(b"half a checkpoint")
    monkeypatch.setattr(engine.Trainer, "evaluate", interrupt)  # stop once the run has started again

    with pytest.raises(SystemExit):  # --resume: from scratch
        cli.main(["train", "--resume", str(run)])
    assert f"{run} holds no checkpoint" in capsys.readouterr().out
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "fingerprint.json"]

    fresh = ["train", "--config", "configs/demo.yaml", "--out", str(run), *SMOKE_ARGS]
    with pytest.raises(SystemExit):  # or the same `train --out` again
        cli.main(fresh)
    assert "starting it again" in capsys.readouterr().out

    (run / "checkpoint.pt").write_bytes(b"a run's checkpoint")
    assert cli.main(fresh) == 2
    assert f"run folder {run} holds a run: continue it with `infosieve train --resume {run}`" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- messages
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_refused_at_start(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--config", "configs/demo.yaml", "--out", str(out), "--set", "train.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train.device='cuda' but no CUDA device is available: use train.device=cpu")
    assert not out.exists()


def test_user_errors_share_one_style(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [\n")
    cases = [
        (["train"], "train needs --config FILE"),
        (["train", "--resume", str(tmp_path), "--out", str(tmp_path)], "drop --config/--out"),
        (["train", "--config", str(bad)], "is not valid YAML"),
        (["train", "--config", "configs/demo.yaml", "--out", str(tmp_path / "r"), "--set", "train.device=gpu0"],
         "train.device='gpu0' is not a device"),
        (["estimate-k"], "exactly one of --run RUN_DIR or --features"),
        (["estimate-k", "--features", str(bad)], "--features needs --known-classes"),
    ]  # fmt: skip
    for argv, words in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err, (argv, err)


def test_the_progress_bar_knows_the_steps_of_an_epoch():
    trainer = Trainer(smoke_config())
    assert trainer.steps_per_epoch() == 320 // 64
    trainer.unreadable[:] = [3]  # the evaluator's list, as a feature pass fills it
    assert trainer.steps_per_epoch() == 319 // 64
    trainer.cfg.train.max_steps_per_epoch = 2
    assert trainer.steps_per_epoch() == 2


def test_make_shards_summary_counts_what_was_written(tmp_path, capsys):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, per_class in (("train", 6), ("test", 2)):
        for c in range(4):
            folder = tmp_path / "raw" / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    (tmp_path / "raw" / "train" / "class0" / "zz_broken.png").write_bytes(b"not an image" * 20)
    (tmp_path / "raw" / "test" / "class3" / "zz_broken.png").write_bytes(b"not an image" * 20)
    out = tmp_path / "shards"
    argv = ["make-shards", "--dataset", "imagefolder", "--root", str(tmp_path / "raw"), "--out", str(out),
            "--resize", "16", "--workers", "1", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert summary["skipped"] == 2 and (counts["train"], counts["test"]) == (25, 9)
    assert summary["labelled"] + summary["unlabelled"] == counts["written_train"] == 24
    assert summary["test"] == counts["written_test"] == 8


def test_make_shards_refuses_a_split_with_no_known_class(tmp_path, capsys):
    from PIL import Image

    for i in range(4):
        folder = tmp_path / "raw" / "cat"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((20, 20, 3), 40 * i, np.uint8)).save(folder / f"{i}.png")
    argv = ["make-shards", "--dataset", "imagefolder", "--root", str(tmp_path / "raw"), "--resize", "16",
            "--workers", "1", "--no-progress"]  # fmt: skip
    # one class: its first half, the default known classes, is none; nothing is written
    assert cli.main([*argv, "--out", str(tmp_path / "s1")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the first half of its 1 class(es), are none" in err
    assert "pass --known-classes" in err and not (tmp_path / "s1").exists()
    assert cli.main([*argv, "--out", str(tmp_path / "s2"), "--known-classes", "3-2"]) == 2  # an empty range
    assert "--known-classes names none" in capsys.readouterr().err and not (tmp_path / "s2").exists()
    # the fix the message names works: class 0 known, half of its 4 images labelled (the reference's 0.5)
    assert cli.main([*argv, "--out", str(tmp_path / "s3"), "--known-classes", "0"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["n_old"], summary["labelled"], summary["unlabelled"]) == (1, 2, 2)


def test_a_run_folder_that_is_not_there_and_a_negative_depth_are_named_first(tmp_path, capsys):
    nope, a_file, empty = tmp_path / "nope", tmp_path / "a.txt", tmp_path / "empty"
    a_file.write_text("x")
    empty.mkdir()
    extra = {"predict": ["--images", str(tmp_path), "--out", str(tmp_path / "p.jsonl")], "name": ["novel-3=jay"],
             "export": ["--out", str(tmp_path / "e")]}  # fmt: skip
    for command in ("eval", "tree", "predict", "report", "name", "export", "estimate-k"):
        for run, problem in ((nope, "no such folder"), (a_file, "a file, not a folder")):
            assert cli.main([command, "--run", str(run), *extra.get(command, [])]) == 2, command
            err = capsys.readouterr().err
            assert err.startswith(f"error: --run {run}: {problem}; pass the run folder") and err.count("\n") == 1
    for command in ("tree", "report"):  # checked before the run is read: the empty folder's problem comes later
        assert cli.main([command, "--run", str(empty), "--depth", "-1"]) == 2
        assert capsys.readouterr().err == "error: --depth -1: the deepest code prefix shown must be 0 or more, " \
            "e.g. --depth 4\n"  # fmt: skip
    assert cli.main(["eval", "--run", str(empty)]) == 2
    assert f"no checkpoint.pt in {empty}" in capsys.readouterr().err
