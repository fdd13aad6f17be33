"""tests/in_process.py runs a simple command as a cold interpreter would (the same output and exit status, a cold
`bash -c` being the reference), leaves every other command line to bash, and puts back what a command changed."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.in_process import Call, in_process_call, run_in_process

SHOW = """import os, sys
print(__name__, sys.argv[1:], os.path.basename(sys.argv[0]), sys.path[0] == os.getcwd(), os.environ.get("SHOW_ENV"))
if sys.argv[1:2] == ["boom"]:
    raise ValueError("boom")
sys.exit(sys.argv[2] if sys.argv[1:2] == ["message"] else int(os.environ.get("SHOW_EXIT", "0")))
"""
# changes every kind of interpreter state the runner restores
MESS = """import logging, os, signal, sys, warnings, torch
print(torch.get_num_threads())
os.environ["MESS"] = "1"; os.environ.pop("SHOW_ENV"); os.chdir("/"); sys.path.append("/nowhere")
torch.set_num_threads(1); torch.set_default_dtype(torch.float64); torch.manual_seed(0)
torch.backends.cuda.matmul.fp32_precision = "tf32"
signal.signal(signal.SIGUSR1, lambda *_: None); warnings.simplefilter("error"); logging.basicConfig()
import benchmarks.smoke
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> Path:
    """A folder holding the package `inproc_pkg` with the modules `show` and `mess`."""
    lib = tmp_path_factory.mktemp("lib")
    (lib / "inproc_pkg").mkdir()
    (lib / "inproc_pkg" / "__init__.py").write_text("")
    (lib / "inproc_pkg" / "show.py").write_text(SHOW)
    (lib / "inproc_pkg" / "mess.py").write_text(MESS)
    return lib


def cold(command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("command", "call"),
    [
        ("python -m m --k 'a b' c", Call({}, ["python", "-m", "m", "--k", "a b", "c"])),
        ("A=1 B='x y' python3 -m m", Call({"A": "1", "B": "x y"}, ["python3", "-m", "m"])),
        (
            'infosieve name --run R novel-7="Blue Jay"',
            Call({}, ["infosieve", "name", "--run", "R", "novel-7=Blue Jay"]),
        ),
        ("python -m m | tail -n 1", None),
        ("python -m m > out.txt", None),
        ("infosieve train --config c && infosieve eval --run R", None),
        ("X=$(git rev-parse HEAD) python -m m", None),
        ("python -m m --out runs/*", None),
        ("python -c 'print(1)'", None),
        ("python -u -m m", None),
        ("bash benchmarks/gpu_check.sh", None),
        ("timeout 5 infosieve train --config c", None),
        ("torchrun --nproc_per_node=2 -m infosieve_fast.cli train", None),
    ],
)
def test_only_a_simple_infosieve_or_python_m_command_runs_in_process(command, call):
    assert in_process_call(command) == call


@pytest.mark.parametrize(
    "command",
    [
        "python -m inproc_pkg.show a --b 'c d'",
        "SHOW_EXIT=3 SHOW_ENV=x python3 -m inproc_pkg.show",
        "python -m inproc_pkg.show message 'stopped here'",
        "python -m inproc_pkg.show boom",
        "infosieve train --no-such-flag",
    ],
)
def test_a_command_prints_and_exits_as_in_a_cold_interpreter(command, lib, monkeypatch, capfd):
    expected = cold(command, lib)
    status = run_in_process(in_process_call(command), lib, {}, 60, monkeypatch)
    out, err = capfd.readouterr()
    assert (status, out) == (expected.returncode, expected.stdout)
    assert err.splitlines()[-1:] == expected.stderr.splitlines()[-1:]  # the error, the message, the exception
    assert expected.stdout or expected.stderr


def observed() -> tuple:
    return (dict(os.environ), os.getcwd(), list(sys.argv), list(sys.path), signal.getsignal(signal.SIGUSR1),
            torch.get_num_threads(), torch.get_default_dtype(), torch.backends.cuda.matmul.fp32_precision,
            torch.get_rng_state().tolist(), list(warnings.filters), list(logging.root.handlers),
            sys.modules.get("benchmarks.smoke"))  # fmt: skip


def test_what_a_command_changes_in_the_interpreter_is_put_back(lib, monkeypatch, capfd):
    before = observed()
    status = run_in_process(in_process_call("SHOW_ENV=y python -m inproc_pkg.mess"), lib, {"OMP_NUM_THREADS": "3"},
                            60, monkeypatch)  # fmt: skip
    assert (status, capfd.readouterr().out) == (0, "3\n")  # it ran with the thread count OMP_NUM_THREADS asks for
    assert observed() == before


def test_a_command_past_its_time_is_stopped_with_the_status_timeout_gives(lib, monkeypatch, capfd):
    (lib / "inproc_pkg" / "sleeper.py").write_text("import time\ntime.sleep(30)\n")
    status = run_in_process(in_process_call("python -m inproc_pkg.sleeper"), lib, {}, 1, monkeypatch)
    assert (status, capfd.readouterr().err) == (124, "timed out after 1 s\n")
