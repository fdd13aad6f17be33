"""Smoke size: with INFOSIEVE_BENCH_SMOKE=1 every benchmark runs its documented command's code paths and flags at tiny
shapes, so CI can run each command that README.md and docs/ show (tests/test_documented_commands.py) and a rehearsal
of benchmarks/tools/gpu_check.sh. Each script names its tiny sizes by its defaults; results say `"smoke": true`."""

from __future__ import annotations

import argparse
import os

ENV = "INFOSIEVE_BENCH_SMOKE"


def active() -> bool:
    return os.environ.get(ENV) == "1"


def shrink(args: argparse.Namespace, more_sets: tuple[str, ...] = (), **small) -> argparse.Namespace:
    """`args` with `small`'s values in place of the parsed ones when smoke size is on, and `more_sets` appended to
    `args.set` (after the user's `--set` values, so they win)."""
    if active():
        for name, value in small.items():
            setattr(args, name, value)
        if more_sets:
            args.set = [*args.set, *more_sets]
    return args
