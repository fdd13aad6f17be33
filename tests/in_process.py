"""Run a simple command line (`infosieve ...`, `python -m MODULE ...`, with `NAME=value` prefixes) in this interpreter,
as a cold one would run it: the same arguments, working folder, environment, output and exit status, without paying
for the imports again. What a command changes in the interpreter is put back when it ends (`restored_process_state`).

    call = in_process_call(command)        # None: not a simple command; run it in bash
    status = run_in_process(call, cwd, env, timeout_s)
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import runpy
import shlex
import signal
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from infosieve_fast import cli
from infosieve_fast.training import checkpoint

SHELL_SYNTAX = re.compile(r"[$`*?~{}\[\]!\\]")  # expansions, globs, escapes: bash's job
SHELL_OPERATOR = re.compile(r"[|&;<>()]+")
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=.*")
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGALRM)
FRESH_PACKAGES = ("benchmarks",)  # scripts whose modules may read the environment when imported: imported anew


@dataclass(frozen=True)
class Call:
    env: dict[str, str]  # the command's NAME=value prefixes
    argv: list[str]  # ["infosieve", ...] or ["python", "-m", MODULE, ...]


def in_process_call(command: str) -> Call | None:
    """`command` as a call this module runs, or None when it is not one simple `infosieve` or `python -m` command
    (pipes, lists, redirections, substitutions, other programs: those run in bash)."""
    if SHELL_SYNTAX.search(command):
        return None
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    if any(SHELL_OPERATOR.fullmatch(w) for w in words):
        return None
    env = {}
    while words and ASSIGNMENT.fullmatch(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[:1] == ["infosieve"] or (words[:2] in (["python", "-m"], ["python3", "-m"]) and len(words) > 2):
        return Call(env, words)
    return None


class _TimedOut(BaseException):  # not an Exception: a command's `except Exception` must not swallow it
    pass


def run_in_process(call: Call, cwd: Path, env: dict[str, str], timeout_s: int, monkeypatch) -> int:
    """Run `call` in `cwd` with `env` (and its prefixes) set through `monkeypatch`, and return its exit status. Its
    output goes to this process's standard streams (pytest's capfd captures them). A command still running after
    `timeout_s` is interrupted, with status 124 as `timeout` gives."""
    with monkeypatch.context() as patch, restored_process_state():
        patch.chdir(cwd)
        for name, value in {**env, **call.env}.items():
            patch.setenv(name, value)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count()))  # as a fresh torch reads it
        signal.signal(signal.SIGALRM, _raise_timed_out)
        signal.alarm(timeout_s)
        try:
            status = _exit_status(call.argv, cwd)
        except _TimedOut:
            print(f"timed out after {timeout_s} s", file=sys.stderr)
            status = 124
        finally:
            signal.alarm(0)
        _at_exit()
        sys.stdout.flush()
        sys.stderr.flush()
    return status


def _raise_timed_out(signum, frame):
    raise _TimedOut


def _exit_status(argv: list[str], cwd: Path) -> int:
    """The exit status the interpreter would give: SystemExit's code, 1 (and the traceback) for an exception."""
    try:
        if argv[0] == "infosieve":  # the console script: sys.exit(main())
            sys.argv = [argv[0], *argv[1:]]
            return _code(cli.main(argv[1:]))
        sys.argv = [argv[2], *argv[3:]]
        sys.path.insert(0, str(cwd))  # `python -m` puts the working folder first
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as stop:
        return _code(stop.code)
    except Exception:
        traceback.print_exc()
        return 1


def _code(code: object) -> int:
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)  # sys.exit("message"): printed, status 1
    return 1


def _at_exit() -> None:
    """What the package's atexit hook does when an interpreter ends: finish the background checkpoint write (its
    error printed, the status kept, as CPython does for an atexit hook)."""
    try:
        checkpoint.wait_for_checkpoint()
    except Exception:
        traceback.print_exc()


@contextlib.contextmanager
def restored_process_state():
    """Put back what a command may change in this interpreter: environment, working folder, sys.argv and sys.path,
    signal handlers, torch's threads, fp32 precision switches, default dtype and random generators (with Python's and
    NumPy's), warning filters, the root logger, Dynamo's caches, and the modules of `FRESH_PACKAGES` (removed for the
    command, so that it imports them fresh, then the originals put back)."""
    environ, cwd, argv, path = dict(os.environ), os.getcwd(), list(sys.argv), list(sys.path)
    handlers = {s: signal.getsignal(s) for s in SIGNALS}
    threads, dtype, switches = torch.get_num_threads(), torch.get_default_dtype(), _precision_switches()
    rngs = torch.get_rng_state(), np.random.get_state(), random.getstate()
    filters, root = list(warnings.filters), (list(logging.root.handlers), logging.root.level)
    modules = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] in FRESH_PACKAGES}
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] in FRESH_PACKAGES]:
            del sys.modules[name]
        sys.modules.update(modules)
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.argv[:], sys.path[:] = argv, path
        for s, handler in handlers.items():
            signal.signal(s, handler)
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        for (owner, name), value in switches.items():
            if getattr(owner, name) != value:
                setattr(owner, name, value)
        torch.set_rng_state(rngs[0])
        np.random.set_state(rngs[1])
        random.setstate(rngs[2])
        warnings.filters[:] = filters
        logging.root.handlers[:], logging.root.level = root
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()


def _precision_switches() -> dict[tuple[object, str], object]:
    """torch's fp32 precision switches and their values: the fp32_precision API's (torch >= 2.9), else the legacy
    TF32 flags (reading a legacy flag raises once both APIs were used, so only one kind is read)."""
    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision"):
        owners = [backends, backends.cuda.matmul, backends.cudnn, backends.cudnn.conv, backends.cudnn.rnn,
                  backends.mkldnn, backends.mkldnn.matmul, backends.mkldnn.conv, backends.mkldnn.rnn]  # fmt: skip
        return {(o, "fp32_precision"): o.fp32_precision for o in owners if hasattr(o, "fp32_precision")}
    return {(backends.cuda.matmul, "allow_tf32"): backends.cuda.matmul.allow_tf32,
            (backends.cudnn, "allow_tf32"): backends.cudnn.allow_tf32}  # fmt: skip
