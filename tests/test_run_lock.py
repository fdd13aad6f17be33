"""One run per folder (issue 42): a training run holds RUN/.lock for its life; a second `train` on the folder is
refused in one line naming the holder's PID, before it writes anything; a killed holder leaves no stale lock, even
while a process it forked (a data worker) lives on.

Before the fix a second `train` started 2 s after the first on one --out ran to the end as well: config.yaml was the
second's, the checkpoint and metrics the first's, log.jsonl both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from infosieve_fast import cli
from infosieve_fast.training.run_lock import LOCK, RunFolderBusy, held_run_folder

ROOT = Path(__file__).resolve().parents[1]
# takes the folder's lock as a run does, forks a child that outlives it (as a data worker can), says so, and waits
HOLDER = """
import os, sys, time
from pathlib import Path
from infosieve_fast.training.run_lock import held_run_folder
with held_run_folder(Path(sys.argv[1])):
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
"""


@pytest.fixture
def holder(tmp_path):
    """A process holding tmp_path/run, and the PID of the child it forked."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "run")], env=env, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    child = int(proc.stdout.readline())
    yield proc, child
    for pid in (proc.pid, child):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def test_a_second_train_on_a_held_folder_is_refused(holder, tmp_path, capsys):
    proc, _ = holder
    run = tmp_path / "run"
    argv = ["train", "--config", "configs/demo.yaml", "--out", str(run), "--set", "train.device=cpu"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        f"error: run folder {run} is in use by another run (PID {proc.pid}): wait for it to end, stop it, or choose "
        "another --out\n"
    )
    assert sorted(p.name for p in run.iterdir()) == [LOCK]  # the holder's lock only: nothing written
    assert cli.main(["train", "--resume", str(run), "--set", "train.device=cpu"]) == 2  # no config.yaml yet
    assert capsys.readouterr().err.startswith(f"error: --resume {run}: no config.yaml there")


def test_the_home_folder_is_expanded_in_out(holder, tmp_path, monkeypatch, capsys):
    """`--out ~/run` (as a launcher passes it, unexpanded) is HOME/run, here the held folder: not a folder named ~."""
    proc, _ = holder
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--config", str(ROOT / "configs/demo.yaml"), "--out", "~/run"]) == 2
    assert f"(PID {proc.pid})" in capsys.readouterr().err and not (tmp_path / "~").exists()


def test_a_killed_holder_leaves_no_stale_lock(holder, tmp_path):
    proc, child = holder
    run = tmp_path / "run"
    with pytest.raises(RunFolderBusy, match=rf"\(PID {proc.pid}\)"):
        with held_run_folder(run):
            pass
    proc.kill()
    proc.wait()
    os.kill(child, 0)  # the forked child still lives: it never held the lock
    assert (run / LOCK).read_text() == f"{proc.pid}\n"  # the dead holder's file is still there ...
    with held_run_folder(run):  # ... and the folder is free at once
        assert (run / LOCK).read_text() == f"{os.getpid()}\n"
    assert run.is_dir() and not (run / LOCK).exists()  # the file goes with the lock; the folder was there


def test_a_folder_the_lock_made_is_removed_when_the_run_is_refused(tmp_path, capsys):
    run = tmp_path / "new" / "run"
    argv = ["train", "--config", "configs/demo.yaml", "--out", str(run), "--set", "train.device=cpu"]
    assert cli.main([*argv, "--set", "data.batch_size=100000"]) == 2  # refused once the data is open
    assert "lower data.batch_size" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
