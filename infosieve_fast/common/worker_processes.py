"""Worker processes that a signal can always end, and that a run's graceful stop does not lose.

A process forked while the run's stop handler (`preemption.StopSignals`) is installed inherits it, so SIGTERM would
only set a flag in the child (or raise there). `multiprocessing.Pool.terminate` ends its workers with SIGTERM and then
joins them with no time limit: a worker that swallows it keeps its parent waiting for ever. So every worker the project
starts begins with one of the two initialisers below. Until its initialiser has run, a worker still has the parent's
handler, and a SIGTERM in that window (a slow start, a pool that finishes its work first) would be swallowed by it: so
workers are started with the stop signals blocked (`stop_signals_blocked`) and unblock them once their default action
is back, when a pending SIGTERM ends them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def reset_stop_signals() -> None:
    """A pool worker's start (the shard index, make-shards' encoders): SIGTERM and SIGUSR1 end it (their default);
    SIGINT is ignored, since Ctrl-C reaches the whole process group and the parent ends its pool itself, without a
    traceback from every worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _default_stop_signals()


def start_reader_worker(_worker_id: int) -> None:
    """A DataLoader worker's start (`worker_init_fn`): its own process group, the stop signals' default action.

    A signal sent to the run's process group (`timeout`, Ctrl-C in a terminal) then reaches the run and not its
    readers: the run stops at its next step with a checkpoint, which it could not do if a reader died under it
    (DataLoader raises in the parent as soon as a worker is killed). The run ends its readers itself, with SIGTERM,
    which ends them at once."""
    os.setpgid(0, 0)
    _default_stop_signals()


def _default_stop_signals() -> None:
    """The stop signals' default action (end the process), then unblocked: one that came while the worker started
    (`stop_signals_blocked`) is delivered now, and ends it."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Within: this thread holds the stop signals back (a signal that comes meanwhile waits, and is then handled as
    before); what it forks, and the threads it starts, begin with them blocked."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def forked_pool(processes: int) -> Iterator[multiprocessing.pool.Pool]:
    """A pool of `processes` forked workers that start with `reset_stop_signals`, terminated on the way out (its join
    then lasts as long as a SIGTERM takes to end a process)."""
    with stop_signals_blocked():  # the pool's workers, and the threads that start any replacement
        pool = multiprocessing.get_context("fork").Pool(processes, initializer=reset_stop_signals)
    try:
        yield pool
    finally:
        pool.terminate()
