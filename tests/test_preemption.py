"""Preemption (infosieve_fast/training/preemption.py): the stop signals' handlers, and a torchrun launch with restarts
in which one rank is stopped by SIGTERM and later killed by SIGKILL; the restarted groups resume by themselves
(`--resume auto`) and end exactly as an uninterrupted launch.

The single-process signal cases (SIGTERM and SIGUSR1 at random steps, SIGTERM in k-means) are in
tests/test_fault_injection.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from infosieve_fast import cli
from infosieve_fast.config.settings import ConfigError
from infosieve_fast.training.preemption import PREEMPTED_EXIT, StopSignals
from tests.test_fault_injection import assert_same_run

ROOT = Path(__file__).resolve().parents[1]
# 64 samples, 16 per rank and step: 2 steps an epoch on 2 ranks
SMALL = ["schedule.epochs=2", "train.train_subset=64", "data.batch_size=16", "kmeans.n_init=2", "train.device=cpu",
         "model.proj_out_dim=256", "model.proj_hidden_dim=128", "model.proj_bottleneck_dim=64"]  # fmt: skip


def test_stop_signals_are_recorded_in_the_step_loop_and_the_previous_handlers_restored():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    with StopSignals() as stop, stop.deferred():
        assert not stop.requested() and stop.received is None
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered to this (main) thread before kill returns to Python code
        assert stop.requested() and stop.received == "SIGUSR1"
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert PREEMPTED_EXIT not in (0, 1, 2, 130, 128 + signal.SIGTERM, 128 + signal.SIGUSR1)


def test_resume_auto_refuses_a_folder_holding_a_run_of_another_config(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"")  # only its presence is read before the configs are compared
    cli.config_mod.save_config(cli.config_mod.load_config("configs/demo.yaml", ["optim.lr=0.01"]), run / "config.yaml")
    args = cli.build_parser().parse_args(["train", "--config", "configs/demo.yaml", "--out", str(run)])
    with pytest.raises(ConfigError, match=r"holds a run of another config \(optim\.lr: 0\.01 there, 0\.002 now\)"):
        cli._resume_automatically(cli.config_mod.load_config("configs/demo.yaml"), args, run)
    assert not cli._resume_automatically(cli.config_mod.load_config("configs/demo.yaml"), args, tmp_path / "empty")


def torchrun(run: Path, plan: str, restarts: int) -> subprocess.CompletedProcess:
    sets = [a for s in SMALL for a in ("--set", s)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--max-restarts={restarts}", "tests/restart_worker.py", str(run), plan, *sets]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_restarted_torchrun_group_resumes_by_itself_and_ends_as_an_uninterrupted_launch(tmp_path):
    reference = torchrun(tmp_path / "reference", "-", restarts=0)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    # rank 1 gets SIGTERM after its first step (rank 0 none): both stop before step 2 of epoch 1, exit 75; the next
    # launch resumes there by itself, and rank 1 kills itself with SIGKILL after its second step (epoch 2's first); the
    # next resumes from epoch 1's checkpoint and finishes
    done = torchrun(tmp_path / "restarted", "sigterm@1,sigkill@2", restarts=4)  # 2 spare: a slow start can fail
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert (tmp_path / "restarted.plan").read_text() == "sigterm@1\nsigkill@2\n"
    stops = [line for line in output.splitlines() if "preempted: SIGTERM: stopped at epoch 1/2 at step 1;" in line]
    assert len(stops) == 1, output[-6000:]  # rank 0 says so, once: it stopped on rank 1's signal, at its step
    # what torchrun saw end each launch: the stop (the rank that exited first) and rank 1's SIGKILL
    assert re.search(rf"failed \(exitcode: {PREEMPTED_EXIT}\) local_rank: [01] ", output), output[-6000:]
    assert "failed (exitcode: -9) local_rank: 1 " in output, output[-6000:]
    assert_same_run(tmp_path / "reference", tmp_path / "restarted", epochs=2)
