"""How a pass starts its DataLoader worker processes: forked while CUDA is not initialised, from a forkserver after."""

from __future__ import annotations

import multiprocessing
import sys
import types

import torch


def worker_start_method(cuda_initialised: bool) -> str | None:
    """How a pass starts its DataLoader workers (None: the platform's default).

    Each pass starts its own workers, so they must start fast: forked ones start in milliseconds, spawned ones
    re-import torch (seconds per pass). But a fork copies the whole parent, and once CUDA is initialised the parent
    holds the driver's threads and state: a forked child must never touch CUDA (torch refuses: "Cannot re-initialize
    CUDA in forked subprocess"), and a lock that one of those threads held at the fork stays locked in the child. So
    after CUDA is initialised the workers come from a forkserver instead: a fresh single-threaded process that never
    initialises CUDA, with the dataset's module (torch with it) and the main script's imports imported once
    (`worker_context`), so its forks still start fast.
    """
    methods = multiprocessing.get_all_start_methods()
    if not cuda_initialised and "fork" in methods:
        return "fork"
    return "forkserver" if "forkserver" in methods else None


def worker_context(preload: str) -> multiprocessing.context.BaseContext | None:
    """The multiprocessing context of a pass's DataLoader workers (`worker_start_method`); a forkserver imports the
    module `preload` (the one that defines the workers' dataset) and the main script's imports once."""
    method = worker_start_method(torch.cuda.is_initialized())
    if method == "forkserver":  # the server imports these once, when it starts (the first pass after CUDA's start)
        multiprocessing.set_forkserver_preload([preload, *main_script_imports()])
    return multiprocessing.get_context(method) if method else None


def main_script_imports() -> list[str]:
    """The modules the main script's names come from. Every worker started from a forkserver runs the main script
    again (multiprocessing does, so that what it defines can be unpickled; the forkserver's own preload of "__main__"
    never takes effect: CPython hands it the script's path under a key it does not read). With these imported by the
    server, that rerun takes milliseconds instead of seconds."""
    names = set()
    for value in vars(sys.modules["__main__"]).values():
        module = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(module, str) and module in sys.modules and module not in ("__main__", "__mp_main__"):
            names.add(module)  # imported here, so importable there
    return sorted(names)
