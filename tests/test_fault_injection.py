"""SIGKILL at ten seeded random moments, `train --resume` after each: the run folder ends as an uninterrupted run's.
The same for SIGTERM and SIGUSR1 at random steps (and SIGTERM during k-means): each stops the run at a step boundary
with a mid-epoch checkpoint and the preempted exit status, and the resumed run ends bit for bit as the uninterrupted
one.

The moments include mid-step, mid-checkpoint-write, mid-log-append and during k-means (tests/fault_injection_driver.py
says how each is reached; the package has no test hook). "Equal" means: metrics.json byte for byte, every log.jsonl
record equal in every key except the wall-clock timings (`seconds`, `seconds_features`, `seconds_kmeans`,
`seconds_steps`) and the peak memory (`peak_rss_bytes`, `peak_gpu_bytes`), clustering.npz's arrays and the
checkpoint's weights equal, and no temporary file left behind.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from infosieve_fast.common.files import read_log
from infosieve_fast.training.checkpoint import load_checkpoint
from infosieve_fast.training.preemption import PREEMPTED_EXIT

ROOT = Path(__file__).resolve().parents[1]
SEED = 11  # the kill moments are drawn from this seed; attempts.json in the failure message lists them
REQUIRED = {"mid-step", "mid-checkpoint-write", "mid-log-append", "kmeans"}


def flat(state) -> list[torch.Tensor]:
    """Every tensor of a nested state (the optimizer's), in a fixed order; numbers as tensors."""
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in flat(state[k])]
    if isinstance(state, list | tuple):
        return [t for v in state for t in flat(v)]
    if isinstance(state, str | None):
        return [torch.tensor(list(str(state).encode()))]
    return [state if isinstance(state, torch.Tensor) else torch.tensor(float(state))]


def without_timings(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("seconds", "peak_"))}


@pytest.mark.slow
def test_ten_sigkills_and_resumes_end_as_the_uninterrupted_run(tmp_path):
    driver = [sys.executable, str(ROOT / "tests" / "fault_injection_driver.py"), str(tmp_path), str(SEED), "10"]
    done = subprocess.run(driver, cwd=ROOT, capture_output=True, text=True, timeout=900)
    listing = (tmp_path / "attempts.json").read_text() if (tmp_path / "attempts.json").exists() else "(none)"
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\nattempts: {listing}"
    attempts = json.loads(listing)
    kills = [a for a in attempts if a["kind"] is not None]
    assert len(kills) == 10 and all(a["killed"] for a in kills), listing
    assert REQUIRED <= {a["kind"] for a in kills}, listing
    assert_same_run(tmp_path / "reference", tmp_path / "killed", epochs=3)


@pytest.mark.slow
def test_signals_at_random_steps_stop_with_a_mid_epoch_checkpoint_and_resume_bit_for_bit(tmp_path):
    driver = [sys.executable, str(ROOT / "tests" / "fault_injection_driver.py"), str(tmp_path), str(SEED), "3"]
    driver.append("signals")
    done = subprocess.run(driver, cwd=ROOT, capture_output=True, text=True, timeout=900)
    listing = (tmp_path / "attempts.json").read_text() if (tmp_path / "attempts.json").exists() else "(none)"
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\nattempts: {listing}"
    attempts = json.loads(listing)
    stops = [a for a in attempts if a["kind"] is not None]
    assert len(stops) == 3 and all(a["exit"] == PREEMPTED_EXIT for a in stops), listing
    assert {a["kind"] for a in stops[:2]} == {"sigterm", "sigusr1"}, listing
    assert stops[1]["position"]["mid_epoch"] and stops[1]["position"]["step"] > 0, listing  # resumed mid-epoch
    last_epoch = stops[2]["position"]["epoch"] == 1  # no k-means round left to signal in
    assert stops[2]["kind"] == "sigterm-kmeans" or last_epoch, listing
    assert_same_run(tmp_path / "reference", tmp_path / "killed", epochs=2)


def assert_same_run(reference: Path, killed: Path, epochs: int) -> None:
    """The interrupted run's folder holds what the uninterrupted one's does (the module docstring's "equal")."""
    assert (killed / "metrics.json").read_bytes() == (reference / "metrics.json").read_bytes()
    ref_log, log = read_log(reference / "log.jsonl"), read_log(killed / "log.jsonl")
    assert [r["epoch"] for r in log] == list(range(epochs))
    assert [without_timings(r) for r in log] == [without_timings(r) for r in ref_log]
    with np.load(reference / "clustering.npz") as a, np.load(killed / "clustering.npz") as b:
        assert set(a.files) == set(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)
    ref_state, state = load_checkpoint(reference), load_checkpoint(killed)
    assert state["epoch"] == ref_state["epoch"] == epochs and state["before"] == ref_state["before"]
    assert "mid_epoch" not in state
    assert all(torch.equal(state["model"][k], v) for k, v in ref_state["model"].items())
    assert torch.equal(state["centers"], ref_state["centers"])
    assert all(torch.equal(a, b) for a, b in zip(flat(state["optimizer"]), flat(ref_state["optimizer"]), strict=True))
    resumed = {"fingerprint-resumes.jsonl"}  # each resume's environment: what only the killed run has
    assert sorted(p.name for p in killed.iterdir() if p.name not in resumed) == sorted(
        p.name for p in reference.iterdir()
    )  # no .tmp left
