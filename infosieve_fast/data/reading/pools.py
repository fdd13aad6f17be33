"""Process-wide CPU worker threads and reusable CPU buffers, shared by the augmentation and the batch loaders."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

_THREAD_POOLS: dict[tuple[int, int], ThreadPoolExecutor | None] = {}  # (pid, n): a forked child makes its own
_THREAD_POOLS_LOCK = threading.Lock()


def cpu_threads(n: int) -> ThreadPoolExecutor | None:
    """`n` Python threads (per process, shared) whose torch ops run single-threaded: the CPU view loop, the in-memory
    batch prefetch.

    Splitting the views over threads instead of running every per-view op on torch's intra-op (OpenMP) team: one
    fork-join per op is fine on an idle machine but collapses when another process holds a core (each of the ~770
    parallel regions per batch then waits for a descheduled team member);
    independent threads degrade gracefully. The threads' own OpenMP team size is set to 1 once, at start (torch reads
    its global setting lazily per thread: set it to 1, make the thread read it, then restore the caller's value).
    None if the threads cannot be started (the caller then works alone).
    """
    key = (os.getpid(), n)
    with _THREAD_POOLS_LOCK:
        if key not in _THREAD_POOLS:
            saved = torch.get_num_threads()
            started = threading.Barrier(n, timeout=30)

            def init() -> None:
                torch.set_num_threads(1)
                torch.get_num_threads()  # this thread's lazy init happens now, with 1
                started.wait()  # all n threads exist and are initialised before the caller's setting is restored

            pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
                n, thread_name_prefix="infosieve-views", initializer=init
            )
            try:
                for f in [pool.submit(int) for _ in range(n)]:
                    f.result()
            except Exception:  # pragma: no cover - threads unavailable
                pool.shutdown(wait=False)
                pool = None
            finally:
                torch.set_num_threads(saved)
            _THREAD_POOLS[key] = pool
        return _THREAD_POOLS[key]


class BufferPool:
    """Reusable CPU tensors for large per-batch outputs (views, gathered batches).

    A fresh large tensor costs more than filling it (the kernel maps and zeroes every page). The pool keeps up to
    `size` buffers and hands one out again only when nothing but the pool refers to its storage (no tensor, view,
    slice or numpy array made from an earlier result is alive), so a caller never sees a result it still holds
    overwritten. With `size=2` the usual loop (`x = f(...)` while the previous `x` is still bound) reuses its buffers;
    a caller that keeps many results just gets fresh ones.
    """

    def __init__(self, size: int = 2):
        self.size = size
        self._bufs: list[tuple[Tensor, int]] = []  # (buffer, storage use count when only the pool holds it)
        self._lock = threading.Lock()  # get() may be called from a prefetch thread

    @staticmethod
    def _uses(t: Tensor) -> int | None:
        try:
            return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))
        except Exception:  # pragma: no cover - private API missing in this torch: never reuse
            return None

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialised CPU tensor of `shape` and `dtype` that no live tensor shares memory with."""
        shape = tuple(int(d) for d in shape)
        with self._lock:
            for i, (buf, idle) in enumerate(self._bufs):
                if buf.shape == shape and buf.dtype == dtype and self._uses(buf) == idle:
                    self._bufs.append(self._bufs.pop(i))  # most recently used last
                    return buf.view(shape)
            buf = torch.empty(shape, dtype=dtype)
            idle = self._uses(buf)
            if idle is None:
                return buf
            self._bufs.append((buf, idle))
            if len(self._bufs) > self.size:
                self._bufs.pop(0)
            return buf.view(shape)
