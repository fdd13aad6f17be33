"""One run per folder: a training run holds RUN/.lock for its whole life, so a second `train` (or `--resume`) on the
same folder is refused in one line naming the holder's PID, before it reads or writes anything there.

The lock is an OS record lock (`fcntl.lockf`), which the kernel drops when its process ends however it ends: a killed
run leaves no stale lock, and its `--resume` (or torchrun's restart of it) takes the folder at once. A record lock
belongs to the process, not to the open file, so the data workers and index pools a run forks do not inherit it and
cannot keep a dead run's folder locked. Under torchrun only rank 0, the process that writes the folder, takes it; the
other ranks learn its answer. The file is removed when the run ends; a folder that the lock alone created (a run
refused before it wrote anything) is removed with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from ..common import distributed as dist

LOCK = ".lock"


class RunFolderBusy(FileExistsError):
    """Another live process holds the run folder."""


@contextlib.contextmanager
def held_run_folder(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir`'s lock for the block (rank 0 takes it; every rank raises `RunFolderBusy` when it is held)."""
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # innermost first: removed again if left empty
    fd, problem = None, None
    if dist.is_main_process():
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = _take(run_dir)
        except RunFolderBusy as err:
            problem = str(err)
    problem = dist.broadcast_object(problem)
    if problem:
        raise RunFolderBusy(problem)
    try:
        yield
    finally:
        if fd is not None:
            (run_dir / LOCK).unlink(missing_ok=True)  # before the lock goes: see `_take`
            os.close(fd)
            for folder in made:
                with contextlib.suppress(OSError):  # not empty: the run wrote there
                    folder.rmdir()


def _take(run_dir: Path) -> int:
    """The open, locked RUN/.lock holding this PID. A holder removes the file before it lets the lock go, so a lock
    taken on a file that is no longer the one at the path is let go and taken again on the new one."""
    path = run_dir / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EAGAIN or EACCES: another process holds it
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunFolderBusy(
                f"run folder {run_dir} is in use by another run (PID {holder}): wait for it to end, stop it, or "
                "choose another --out"
            ) from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)
