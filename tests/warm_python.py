"""A warm Python for the tests that run many short commands: it imports torch, timm and the package once, then runs
each `python -m MODULE ...`, `python -c CODE ...` or `infosieve ...` in a fork of itself, so a
command pays for its own work and not for 3-4 s of imports (tests/test_documented_commands.py runs ~40 commands).

    server = WarmPython.start(env)        # the server, and a folder of shims (python, python3, infosieve)
    env["PATH"] = f"{server.shims}:{env['PATH']}"; env[SOCKET_ENV] = server.socket

A shim runs this file as a client (`python -S`, so it starts in milliseconds). The client sends its argv, working
folder, environment and standard streams (the file descriptors themselves) to the server and exits with the command's
exit status. The server forks a supervisor per command, which forks the command's process: that process takes the
client's streams, folder and environment, the thread count OMP_NUM_THREADS asks for, and a session of its own, then
runs the command as the interpreter would (`runpy` with run_name "__main__", or the console script's `main()`).
A client that dies (a timeout kills it) makes its supervisor kill the command's whole session.

Forking is safe because the server is one thread that has imported modules and run nothing. Modules that are run as
`-m` (those with a `__main__` guard) are not imported by the server, so runpy runs them fresh. A command line the
client does not understand (another interpreter flag) runs in a cold interpreter, as written.
"""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import sys
from pathlib import Path

SOCKET_ENV = "INFOSIEVE_WARM_PYTHON"
ENTRY_POINTS = {"infosieve": "infosieve_fast.cli:main"}  # pyproject.toml's console scripts
_STATUS = struct.Struct("!i")
_LENGTH = struct.Struct("!I")


# ------------------------------------------------------------------------------------------------------------ client
def _command(argv: list[str]) -> list[str] | None:
    """The request for `python argv...` the server understands ([kind, target, *args]), or None."""
    if argv[:1] == ["-u"]:
        argv = argv[1:]
    return argv if len(argv) >= 2 and argv[0] in ("-m", "-c") else None


def client(argv: list[str]) -> int:
    """Run `argv` (what follows the shim: `python`'s arguments, or `--entry NAME` and a console script's) on the
    server, or cold where there is no server or the arguments are not understood."""
    entry = argv[1] if argv[:1] == ["--entry"] else None
    command = ["entry", entry, *argv[2:]] if entry else _command(argv)
    path = os.environ.get(SOCKET_ENV)
    if command is None or not path:
        program = os.path.join(os.path.dirname(sys.executable), entry) if entry else sys.executable
        os.execv(program, [program, *(argv[2:] if entry else argv)])
    unbuffered = argv[:1] == ["-u"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    request = {"argv": command, "cwd": os.getcwd(), "env": dict(os.environ), "unbuffered": unbuffered}
    payload = json.dumps(request).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        socket.send_fds(conn, [_LENGTH.pack(len(payload))], [0, 1, 2])
        conn.sendall(payload)
        status = _recv_exactly(conn, _STATUS.size)
    if status is None:
        print(f"warm python: the server at {path} closed the connection before the command ended", file=sys.stderr)
        return 1
    code = _STATUS.unpack(status)[0]
    return 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N


def _recv_exactly(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# ------------------------------------------------------------------------------------------------------------ server
def _preload() -> None:
    """Import what the commands import (a module with a `__main__` guard excepted: runpy must run it fresh)."""
    import importlib
    import pkgutil

    packages = ("infosieve_fast", "infosieve_kernels")
    for name in ("numpy", "scipy.optimize", "PIL.Image", "torch", "torchvision", "timm", *packages):
        importlib.import_module(name)
    for package in map(sys.modules.get, packages):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            spec = info.module_finder.find_spec(info.name)
            source = spec.origin if spec and spec.origin and spec.origin.endswith(".py") else None
            if source and '__name__ == "__main__"' not in Path(source).read_text():
                importlib.import_module(info.name)


def serve(path: str) -> None:
    import gc
    import signal

    _preload()
    gc.freeze()  # a fork's collections (its exit's above all) skip the imported objects instead of copying their pages
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _supervise(conn)  # returns only in the command's process
            return
        conn.close()


def _supervise(conn: socket.socket) -> None:
    """In the supervisor: receive one command, fork its process, report its exit status (or kill it when the client
    goes away). Returns only in the command's process, once the command has run."""
    import select
    import signal

    header, fds, _, _ = socket.recv_fds(conn, _LENGTH.size, 3)
    header += _recv_exactly(conn, _LENGTH.size - len(header)) or b""
    request = json.loads(_recv_exactly(conn, _LENGTH.unpack(header)[0]))
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(request, fds)
        return
    for fd in fds:
        os.close(fd)
    process = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([conn, process], [], [])
        if process in ready:
            _, status = os.waitpid(pid, 0)
            conn.sendall(_STATUS.pack(os.waitstatus_to_exitcode(status)))
            os._exit(0)
        if not conn.recv(1):  # the client is gone: so is its command, and everything the command started
            for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    kill()
                except ProcessLookupError:
                    pass
            os.waitpid(pid, 0)
            os._exit(0)


def _run(request: dict, fds: list[int]) -> None:
    """In the command's process: become the command, then run it the way the interpreter would. Its exit (an
    exception, SystemExit, or the end) unwinds to the top of this file, so the interpreter exits as after a cold run."""
    import runpy
    import types

    import torch

    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _standard_streams(request["unbuffered"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count()))
    kind, target, *args = request["argv"]
    sys.path[:] = [os.getcwd() if kind == "-m" else "", *_python_path(), *_BASE_PATH]
    if kind == "-m":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "-c":
        sys.argv = ["-c", *args]
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        exec(compile(target, "<string>", "exec"), main.__dict__)
    else:  # a console script, as pip's launcher runs it
        module, function = ENTRY_POINTS[target].split(":")
        sys.argv = [os.path.join(os.path.dirname(sys.executable), target), *args]
        sys.exit(getattr(__import__(module, fromlist=[function]), function)())


def _standard_streams(unbuffered: bool) -> None:
    """stdout as the interpreter sets it up for the command's fd 1: line-buffered on a terminal, else buffered; with
    -u or PYTHONUNBUFFERED, stdout and stderr unbuffered."""
    if not unbuffered:
        sys.stdout.reconfigure(line_buffering=os.isatty(1))
        return
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), encoding=old.encoding,
                                  errors=old.errors, write_through=True)  # fmt: skip
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


# --------------------------------------------------------------------------------------------------------- lifecycle
class WarmPython:
    """A running server (`start`) and its shims; `stop()` ends it."""

    def __init__(self, process, folder: str):
        self.process, self.folder = process, folder
        self.socket, self.shims = os.path.join(folder, "socket"), os.path.join(folder, "bin")

    @classmethod
    def start(cls, env: dict[str, str]) -> WarmPython:
        import subprocess
        import tempfile

        folder = tempfile.mkdtemp(prefix="warm-python-")
        os.mkdir(os.path.join(folder, "bin"))
        me = os.path.abspath(__file__)
        for name, extra in (("python", ""), ("python3", ""), *((n, f"--entry {n} ") for n in ENTRY_POINTS)):
            shim = os.path.join(folder, "bin", name)
            with open(shim, "w") as f:
                f.write(f'#!/bin/sh\nexec {sys.executable} -S {me} {extra}"$@"\n')
            os.chmod(shim, 0o755)
        server = subprocess.Popen([sys.executable, me, "--serve", os.path.join(folder, "socket")], env=env,
                                  stdout=subprocess.PIPE, text=True, cwd=folder)  # fmt: skip
        if server.stdout.readline().strip() != "ready":
            server.kill()
            raise RuntimeError(f"the warm python server did not start (exit {server.wait()})")
        return cls(server, folder)

    def stop(self) -> None:
        import shutil

        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _python_path() -> list[str]:
    return [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


_BASE_PATH = [p for p in sys.path[1:] if p not in _python_path()]  # the standard library and site-packages

if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1:]))
