"""A stop signal while a run is set up (its shards indexed, downloaded) ends it at once, and no worker process keeps it
waiting: the workers forked under the run's stop handler end on SIGTERM (infosieve_fast/common/worker_processes.py,
infosieve_fast/training/preemption.py). The signal cases inside the step loop are in tests/test_fault_injection.py."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from infosieve_fast.data.reading import tar
from infosieve_fast.training.preemption import PREEMPTED_EXIT, StoppedAtOnce, StopSignals

ROOT = Path(__file__).resolve().parents[1]


def write_foreign_shards(folder: Path, shards: int, per_shard: int = 3) -> list[str]:
    """Standard WebDataset shards (.jpg + .cls members, no manifest), as other tools write them."""
    folder.mkdir(parents=True)
    for s in range(shards):
        with tarfile.open(folder / f"train-{s:06d}.tar", "w") as out:
            for i in range(per_shard):
                image = io.BytesIO()
                Image.new("RGB", (16, 16), (20 * i, 10 * s, 0)).save(image, format="JPEG")
                for name, data in ((f"s{s}-{i}.jpg", image.getvalue()), (f"s{s}-{i}.cls", b"%d" % (i % 2))):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    out.addfile(info, io.BytesIO(data))
    return sorted(str(p) for p in folder.glob("*.tar"))


def handler_in_worker(path: str, keys: tar.SampleKeys) -> tuple[np.ndarray, list[str]]:
    """`index_shard`'s stand-in: no rows, and the worker's SIGTERM handler as its one problem."""
    return np.zeros((0, 4 + len(keys.fields)), np.int64), [repr(signal.getsignal(signal.SIGTERM))]


@pytest.mark.parametrize("deferred", [False, True])
def test_index_workers_forked_under_the_stop_handler_end_on_sigterm(tmp_path, monkeypatch, deferred):
    paths = write_foreign_shards(tmp_path / "shards", 4)
    monkeypatch.setattr(tar, "index_shard", handler_in_worker)
    with StopSignals() as stop:
        if deferred:
            with stop.deferred():
                problems = tar.index_rows(paths, processes=2)[2]
        else:
            problems = tar.index_rows(paths, processes=2)[2]
    # the default action: Pool.terminate's SIGTERM ends the worker (an inherited recording handler swallowed it and
    # left the pool's join waiting for ever)
    assert problems == [repr(signal.SIG_DFL)] * 4


def test_a_signal_outside_the_step_loop_or_a_second_one_stops_at_once():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        with pytest.raises(StoppedAtOnce, match="^SIGTERM: stopped at once$"):
            os.kill(os.getpid(), signal.SIGTERM)
        with stop.deferred():
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.requested() and stop.received == "SIGUSR1"
            with pytest.raises(StoppedAtOnce, match="^SIGTERM again: stopped at once$"):
                os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == before


SLOW_INDEX = """
import pathlib, sys, time
from infosieve_fast.data.reading import tar
def slow(path, keys):
    pathlib.Path(sys.argv[1], pathlib.Path(path).name).touch()
    time.sleep(300)
tar.index_shard = slow
from infosieve_fast import cli
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("target", ["process", "group"])
def test_sigterm_while_a_first_train_indexes_foreign_shards_ends_it_at_once(tmp_path, target):
    """`timeout` signals the whole process group, a scheduler may signal only the run: either way the run ends within
    seconds with the preempted status, naming what to do, and leaves no worker behind."""
    shards = write_foreign_shards(tmp_path / "shards", 4)
    marks = tmp_path / "marks"
    marks.mkdir()
    command = [sys.executable, "-c", SLOW_INDEX, str(marks), "train", "--config", "configs/demo.yaml", "--out",
               str(tmp_path / "run"), "--set", "data.source=shards", "--set", f"data.shards={Path(shards[0]).parent}",
               "--set", f"data.intake.index_cache={tmp_path / 'index'}", "--set", "train.device=cpu"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(list(marks.iterdir())) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # both index workers are inside a shard
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGTERM) if target == "group" else proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    assert "preempted: SIGTERM while the run was being set up: stopped at once; it had no checkpoint yet" in err
    assert "Traceback" not in err, err[-3000:]
    for _ in range(50):  # the workers ended with their parent
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("a worker of the stopped run is still alive")
