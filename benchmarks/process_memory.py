"""Resident memory of a process tree (this process and all its descendants: rank processes, DataLoader workers),
from /proc, or psutil where it is installed.

Per process: RSS (a page shared by several processes, e.g. torch's libraries or a batch in shared memory, counts once
per process, so the tree's sum is an upper bound), anonymous RSS, and PSS (shared pages split among their processes:
the real footprint; costly to read, so sampled less often). `TreeMemory` samples the tree's sums in a background
thread; `memory_mb` reads one process.
"""

from __future__ import annotations

import math
import os
import threading
import time

import numpy as np


def has_psutil() -> bool:
    try:
        import psutil  # noqa: F401
    except ImportError:
        return False
    return True


def _tree_pids(root: int) -> list[int]:
    """`root` and all its descendants (psutil when installed, else /proc/PID/task/TID/children)."""
    try:
        import psutil

        p = psutil.Process(root)
        return [root, *(c.pid for c in p.children(recursive=True))]
    except ImportError:
        pass
    except Exception:
        return []
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(x) for x in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


def _memory_kb(pid: int, pss: bool = True) -> tuple[float, float, float] | None:
    """(rss, anonymous rss, pss) in kB from /proc (psutil's rss where /proc is missing); pss is NaN when not asked
    for or unknown (reading smaps_rollup costs ~10 ms of kernel time per torch process). None if the process is
    gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        rss = float(fields.get("VmRSS", "0 kB").split()[0])
        anon = float(fields.get("RssAnon", "0 kB").split()[0])
        proportional = math.nan
        if pss:
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss:"):
                            proportional = float(line.split()[1])
                            break
            except OSError:
                pass
        return rss, anon, proportional
    except (OSError, ValueError):
        try:
            import psutil

            rss = psutil.Process(pid).memory_info().rss / 1024
            return rss, math.nan, math.nan
        except Exception:
            return None


def memory_mb(pid: int) -> dict | None:
    """{rss, anon, pss} of one process in MiB (/proc's kB / 1024; None where unknown), or None if it is gone."""
    kb = _memory_kb(pid)
    if kb is None:
        return None
    return {k: None if math.isnan(x) else round(x / 1024, 1) for k, x in zip(("rss", "anon", "pss"), kb, strict=True)}


class TreeMemory:
    """Samples the memory of this process's tree in a background thread: (monotonic time, rss, anon, pss, processes)
    per sample, MiB, every `interval` s; pss only every `pss_interval` s (NaN in between: it is costly to read)."""

    def __init__(self, interval: float, pss_interval: float = 2.0):
        self.interval, self.pss_interval, self.samples = interval, pss_interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)

    def _run(self) -> None:
        root, last_pss = os.getpid(), -math.inf
        while not self._stop.is_set():
            now = time.monotonic()
            with_pss = now - last_pss >= self.pss_interval
            last_pss = now if with_pss else last_pss
            tot, procs = np.zeros(3), 0
            for pid in _tree_pids(root):
                m = _memory_kb(pid, with_pss)
                if m is not None:
                    tot += m
                    procs += 1
            self.samples.append((now, *(tot / 1024).tolist(), procs))
            self._stop.wait(self.interval)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peak(self, t0: float = -math.inf, t1: float = math.inf) -> dict:
        """The maxima (MiB) of the samples taken between monotonic times t0 and t1, and how many there were."""
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        arr = np.asarray(s).reshape(-1, 5)

        def top(col: int) -> float | None:
            v = arr[:, col][~np.isnan(arr[:, col])]
            return round(float(v.max()), 1) if len(v) else None

        return {
            "rss_mb": top(1),
            "pss_mb": top(3),
            "anon_mb": top(2),
            "processes": int(arr[:, 4].max()) if len(arr) else None,
            "samples": len(arr),
            "pss_samples": int((~np.isnan(arr[:, 3])).sum()),
        }
