"""Nothing hangs: a stop signal while a run is set up (its shards indexed, downloaded) ends it at once, no worker
process keeps it waiting (the workers forked under the run's stop handler end on SIGTERM:
infosieve_fast/common/worker_processes.py, infosieve_fast/training/preemption.py), and make-shards skips a FIFO among
the images instead of waiting on it. The signal cases inside the step loop are in tests/test_fault_injection.py."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from infosieve_fast.common.worker_processes import reset_stop_signals, stop_signals_blocked
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


@pytest.mark.parametrize("deferred", [False, True])
def test_a_sigterm_before_a_worker_has_reset_its_handlers_still_ends_it(deferred):
    """The window between a worker's fork and its initialiser: a SIGTERM there (Pool.terminate's, when the pool's work
    ended before this worker started) reached the parent's handler, copied into the child, and was swallowed; the
    worker then waited for ever and so did the pool's join. Forked with the stop signals blocked, the worker gets the
    signal once its default action is back, and ends."""
    with StopSignals() as stop, stop.deferred() if deferred else contextlib.nullcontext():
        with stop_signals_blocked():
            pid = os.fork()
            if pid == 0:  # the worker, as multiprocessing runs it (inside the fork): the signal comes first
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    reset_stop_signals()
                finally:
                    os._exit(0)  # only reached if the signal was swallowed
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status


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
from infosieve_fast.common.worker_processes import reset_stop_signals, stop_signals_blocked
from infosieve_fast.data.reading import tar
def slow(path, keys):
    pathlib.Path(sys.argv[1], pathlib.Path(path).name).touch()
    time.sleep(300)
tar.index_shard = slow
from infosieve_fast import cli
sys.exit(cli.main(sys.argv[2:]))
"""


def train_command(
    tmp_path: Path,
    shards: str,
    driver: str = "from infosieve_fast import cli; import sys; sys.exit(cli.main(sys.argv[2:]))",
    marks: Path | None = None,
) -> list[str]:
    """A first `train` of the demo config on `shards`, run by `driver` (sys.argv[1] is `marks`)."""
    return [sys.executable, "-c", driver, str(marks or tmp_path), "train", "--config", "configs/demo.yaml", "--out",
            str(tmp_path / "run"), "--set", "data.source=shards", "--set", f"data.shards={shards}",
            "--set", f"data.intake.index_cache={tmp_path / 'index'}", "--set", f"data.intake.download_cache="
            f"{tmp_path / 'downloads'}", "--set", "train.device=cpu"]  # fmt: skip


def stop_when(command: list[str], ready, target: str = "process") -> tuple[subprocess.CompletedProcess, int]:
    """Run `command` in its own session, send SIGTERM (to the process or its whole group) once `ready()` holds; the
    finished process (within 30 s) and its process group's id."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGTERM) if target == "group" else proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, proc.returncode, out, err), proc.pid


def assert_stopped_in_setup(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == PREEMPTED_EXIT, done.stderr[-3000:]
    assert "preempted: SIGTERM while the run was being set up: stopped at once; it had no checkpoint yet" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def assert_gone(pid: int, group: bool) -> None:
    for _ in range(50):
        try:
            os.killpg(pid, 0) if group else os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"process {'group ' if group else ''}{pid} of the stopped run is still alive")


@pytest.mark.parametrize("target", ["process", "group"])
def test_sigterm_while_a_first_train_indexes_foreign_shards_ends_it_at_once(tmp_path, target):
    """`timeout` signals the whole process group, a scheduler may signal only the run: either way the run ends within
    seconds with the preempted status, naming what to do, and leaves no worker behind."""
    shards = write_foreign_shards(tmp_path / "shards", 4)
    marks = tmp_path / "marks"
    marks.mkdir()
    command = train_command(tmp_path, str(Path(shards[0]).parent), SLOW_INDEX, marks)
    done, pid = stop_when(command, lambda: len(list(marks.iterdir())) >= 2, target)  # both workers inside a shard
    assert_stopped_in_setup(done)
    assert_gone(pid, group=True)  # the workers ended with their parent


class Trickle(http.server.BaseHTTPRequestHandler):
    """A server that announces a shard and then sends one byte a second."""

    asked = threading.Event()

    def do_GET(self):  # noqa: N802 (http.server's name)
        Trickle.asked.set()
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        for _ in range(120):
            try:
                self.wfile.write(b"\0")
                self.wfile.flush()
            except OSError:
                return
            time.sleep(1)

    def log_message(self, *args):
        pass


def test_sigterm_during_a_slow_download_ends_the_run_at_once(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/train-000000.tar"
        done, _ = stop_when(train_command(tmp_path, url), Trickle.asked.is_set)
    finally:
        server.shutdown()
    assert_stopped_in_setup(done)
    assert not list((tmp_path / "downloads").glob("*.tar"))  # nothing half-fetched is kept


def test_sigterm_while_a_pipe_command_fetches_ends_it_and_the_command(tmp_path):
    pid_file = tmp_path / "command.pid"
    pipe = f"pipe:echo $$ > {pid_file}; exec sleep 300"
    done, _ = stop_when(train_command(tmp_path, pipe), pid_file.is_file)
    assert_stopped_in_setup(done)
    assert_gone(int(pid_file.read_text()), group=False)


def test_make_shards_skips_a_fifo_among_the_images_and_names_it(tmp_path):
    root = tmp_path / "images"
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(root / cls / f"{i}.jpg")
    os.mkfifo(root / "a" / "x.jpg")
    code = (
        "import sys; from infosieve_fast.data.writing.shards import make_shards; "
        "make_shards('imagefolder', sys.argv[1], sys.argv[2], resize=16, workers=2, progress=False)"
    )
    command = [sys.executable, "-c", code, str(root), str(tmp_path / "shards")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "x.jpg is a FIFO, not a regular file" in done.stderr
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert [Path(s["source"]).name for s in manifest["skipped"]] == ["x.jpg"]


SLOW_ENCODE = """
import pathlib, sys, time
from infosieve_fast.data.writing import encode, shard_writer
def slow(job):
    pathlib.Path(sys.argv[1], str(job[0])).touch()
    time.sleep(0.5)
    return encode.encode_job(job)
shard_writer.encode_job = slow
from infosieve_fast import cli
sys.exit(cli.main(sys.argv[2:]))
"""


def test_sigterm_to_make_shards_ends_it_and_its_encoders_in_one_line(tmp_path):
    root = tmp_path / "images"
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(20):
            Image.new("RGB", (16, 16), (10 * i, 0, 0)).save(root / cls / f"{i}.jpg")
    marks = tmp_path / "marks"
    marks.mkdir()
    command = [sys.executable, "-c", SLOW_ENCODE, str(marks), "make-shards", "--dataset", "imagefolder", "--root",
               str(root), "--out", str(tmp_path / "shards"), "--workers", "2", "--resize", "16"]  # fmt: skip
    done, pid = stop_when(command, lambda: len(list(marks.iterdir())) >= 2)
    assert done.returncode == PREEMPTED_EXIT, done.stderr[-3000:]
    assert "make-shards: SIGTERM: stopped at once; the finished shards are kept" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]  # each encoder printed a broken pipe's before
    assert_gone(pid, group=True)
