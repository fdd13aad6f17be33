"""A run folder from someone else runs nothing and fetches nothing (issue 42): a checkpoint read with
`weights_only=True` whose config names `pipe:` shards (a shell command), `http://` shards or a Hugging Face Hub
backbone. Every command that reads a run back refuses it in one line naming the recorded value and the way to allow
it, before anything runs; the source is used only when the command line names it (`--data.shards`).

Before the fix `eval`, `tree`, `estimate-k`, `report --checkpoint best`, `predict --checkpoint best` and
`train --resume` ran the recorded command (the MARK file appeared) or tried the recorded host."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch

from infosieve_fast import cli
from infosieve_fast.config.settings import load_config, save_config

COMMANDS = {  # every command that rebuilds a run's train set, with what else it needs
    "eval": [],
    "tree": [],
    "estimate-k": [],
    "report": ["--checkpoint", "best"],
    "predict": ["--checkpoint", "best", "--images", "IMAGES", "--out", "OUT/p.jsonl"],
}


def hostile_run(folder: Path, overrides: list[str]) -> Path:
    """A run folder whose config.yaml and checkpoints (last and best) record `overrides`; no weights are needed,
    because the refusal must come before anything is built."""
    cfg = load_config("configs/demo.yaml", ["train.device=cpu", "data.source=shards", *overrides])
    folder.mkdir(parents=True)
    save_config(cfg, folder / "config.yaml")
    (folder / "log.jsonl").write_text("")
    state = {"config": cfg.to_dict(), "epoch": 1, "best": {"criterion": "kmeans_objective", "epoch": 1}}
    torch.save(state, folder / "checkpoint.pt")
    torch.save(state, folder / "checkpoint-best.pt")
    return folder


def run_command(command: str, run: Path, tmp_path: Path, extra: list[str] = ()) -> int:
    (tmp_path / "images").mkdir(exist_ok=True)
    args = [a.replace("IMAGES", str(tmp_path / "images")).replace("OUT", str(tmp_path)) for a in COMMANDS[command]]
    return cli.main([command, "--run", str(run), *args, *extra])


@pytest.fixture
def piped(tmp_path):
    mark = tmp_path / "MARK"
    shards = f"pipe:touch {shlex.quote(str(mark))}; cat {tmp_path / 'a.tar'}"
    run = hostile_run(tmp_path / "run", [f"data.shards={shards}", f"data.intake.download_cache={tmp_path / 'cache'}"])
    return run, mark, shards


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_recorded_pipe_source_runs_nothing(command, piped, tmp_path, capsys):
    run, mark, shards = piped
    assert run_command(command, run, tmp_path) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {run} records data.shards={shards!r}, a shell command that reading the run would start: a run folder "
        "runs and fetches nothing on its own. To use that source, name it yourself on this command line: "
        f"--data.shards {shlex.quote(shards)} (or --data.shards a local copy of the shards)\n"
    )
    assert not mark.exists()


def test_resume_runs_no_recorded_command(piped, capsys):
    run, mark, shards = piped
    assert cli.main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run} records data.shards={shards!r}, a shell command") and err.count("\n") == 1
    assert not mark.exists()


def test_a_recorded_url_is_not_fetched(tmp_path, capsys):
    url = "http://127.0.0.1:9/train-{000..003}.tar"  # the discard port: a fetch would fail, not hang
    run = hostile_run(tmp_path / "run", [f"data.shards={url}", f"data.intake.download_cache={tmp_path / 'cache'}"])
    for command in ("eval", "tree"):
        assert run_command(command, run, tmp_path) == 2
        err = capsys.readouterr().err
        assert f"records data.shards={url!r}, a download that reading the run would start" in err
        assert err.count("\n") == 1
    assert not (tmp_path / "cache").exists()


def test_a_source_in_a_list_is_found(tmp_path, capsys):
    local, remote = str(tmp_path / "local"), "https://example.invalid/x.tar"
    run = hostile_run(tmp_path / "run", [f"data.shards=[{local}, {remote}]"])
    assert run_command("eval", run, tmp_path) == 2
    assert f"records data.shards={remote!r}, a download" in capsys.readouterr().err


def test_a_hub_backbone_is_not_fetched(tmp_path, capsys):
    run = hostile_run(tmp_path / "run", ["model.backbone=hf-hub:someone/model", f"data.shards={tmp_path}"])
    for command in ("eval", "predict"):
        extra = ["--images", str(tmp_path), "--out", str(tmp_path / "p.jsonl")] if command == "predict" else []
        assert cli.main([command, "--run", str(run), *extra]) == 2
        err = capsys.readouterr().err
        assert "records model.backbone='hf-hub:someone/model', which timm would fetch" in err
        assert err.count("\n") == 1


def test_the_source_named_on_the_command_line_is_used(piped, tmp_path):
    """The way the message names: the person types the source, and then it runs (here the command then fails to
    write a shard: `cat` finds no a.tar, which is reported as before)."""
    run, mark, shards = piped
    with pytest.raises(RuntimeError, match=r"the command exited with status 1: cat: .*a\.tar: No such file"):
        run_command("eval", run, tmp_path, ["--data.shards", shards])
    assert mark.exists()
