"""The warm Python (tests/warm_python.py) runs a command as a cold interpreter would: the same output, exit status,
arguments, paths, streams and buffering, and a timeout still kills the command."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.warm_python import SOCKET_ENV, WarmPython

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    """(cold, warm) environments for `bash -c`, with a package `pkg` of the test's on PYTHONPATH."""
    lib = tmp_path_factory.mktemp("lib")
    (lib / "pkg").mkdir()
    (lib / "pkg" / "__init__.py").write_text("")
    (lib / "pkg" / "show.py").write_text(
        "import os, sys\n"
        "print(__name__, sys.argv[1:], os.path.basename(sys.argv[0]), sys.path[0] == os.getcwd())\n"
        "if __name__ == '__main__':\n"
        "    sys.exit(int(os.environ.get('SHOW_EXIT', '0')))\n"
    )
    cold = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "PYTHONPATH": f"{lib}:{ROOT}", "OMP_NUM_THREADS": "1"}  # fmt: skip
    cold.pop("PYTHONUNBUFFERED", None)
    server = WarmPython.start(cold)
    yield cold, {**cold, "PATH": f"{server.shims}:{cold['PATH']}", SOCKET_ENV: server.socket}, lib
    server.stop()


def run(command: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_a_warm_command_runs_in_the_server_with_its_imports_done(envs):
    cold, warm, lib = envs
    probe = "python -c 'import sys; print(\"torch\" in sys.modules)'"
    assert run(probe, cold, lib).stdout == "False\n"
    assert run(probe, warm, lib).stdout == "True\n"


@pytest.mark.parametrize(
    "command",
    [
        "python -m pkg.show a --b 'c d'",
        "SHOW_EXIT=3 python3 -m pkg.show",
        "python -c 'import sys; print(__name__, sys.argv, repr(sys.path[0]))' x y",
        "cd pkg && python -m pkg.show",
        "printf 'in\\nput' | python -c 'import sys; print(sys.stdin.read().upper())'",
        "FOO=bar python -c 'import os, torch; print(os.environ[\"FOO\"], torch.get_num_threads(), os.getcwd())'",
        # buffering: stdout to a pipe is flushed at exit, stderr is not buffered; -u and PYTHONUNBUFFERED write through
        "python -c 'import sys; print(1); print(2, file=sys.stderr); print(3)' 2>&1",
        "python -u -c 'import sys; print(1); print(2, file=sys.stderr); print(3)' 2>&1",
        "PYTHONUNBUFFERED=1 python -c 'import sys; print(1); print(2, file=sys.stderr); print(3)' 2>&1",
        "python -c 'raise ValueError(\"boom\")' 2>&1 | tail -n 1",
        "python -W error -c 'import warnings; warnings.warn(\"as an error\")' 2>&1 | tail -n 1",  # a flag: run cold
        "python -c 'print(__name__, sorted(k for k in globals() if not k.startswith(\"__\")))'",
        "infosieve --help",
        "infosieve train --no-such-flag 2>&1 | tail -n 1",
    ],
)
def test_a_warm_command_prints_and_exits_as_a_cold_one(envs, command):
    cold, warm, lib = envs
    expected, got = run(command, cold, lib), run(command, warm, lib)
    assert (got.returncode, got.stdout) == (expected.returncode, expected.stdout)
    assert expected.stdout  # every case prints something to compare


def test_a_timeout_kills_the_warm_command(envs, tmp_path):
    _, warm, lib = envs
    pid_file = tmp_path / "pid"
    sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    done = run(f'timeout 3 python -c "{sleeper}"', warm, lib)
    assert done.returncode == 124
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), "the command outlived its client"
