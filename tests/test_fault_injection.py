"""SIGKILL at ten seeded random moments, `train --resume` after each: the run folder ends as an uninterrupted run's.

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

from infosieve_fast.checkpoint import load_checkpoint, read_log

ROOT = Path(__file__).resolve().parents[1]
SEED = 11  # the kill moments are drawn from this seed; attempts.json in the failure message lists them
REQUIRED = {"mid-step", "mid-checkpoint-write", "mid-log-append", "kmeans"}


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

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    assert (killed / "metrics.json").read_bytes() == (reference / "metrics.json").read_bytes()
    ref_log, log = read_log(reference / "log.jsonl"), read_log(killed / "log.jsonl")
    assert [r["epoch"] for r in log] == [0, 1, 2]
    assert [without_timings(r) for r in log] == [without_timings(r) for r in ref_log]
    with np.load(reference / "clustering.npz") as a, np.load(killed / "clustering.npz") as b:
        assert set(a.files) == set(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)
    ref_state, state = load_checkpoint(reference), load_checkpoint(killed)
    assert state["epoch"] == ref_state["epoch"] == 3 and state["before"] == ref_state["before"]
    assert all(torch.equal(state["model"][k], v) for k, v in ref_state["model"].items())
    assert torch.equal(state["centers"], ref_state["centers"])
    resumed = {"fingerprint-resumes.jsonl"}  # each resume's environment: what only the killed run has
    assert sorted(p.name for p in killed.iterdir() if p.name not in resumed) == sorted(
        p.name for p in reference.iterdir()
    )  # no .tmp left
