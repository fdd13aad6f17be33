"""What a benchmark result must name: the commit it ran on, whether the tree was dirty, a hash of the code that ran,
the device and the versions of what ran it; benchmarks take these from here only. The commit and the tree hash come
from `infosieve_fast/common/source_tree.py` (run folders record the same).

`python -m benchmarks.tools.provenance --commit C` prints the hash of commit C's code, to check a result's `tree_hash`
against the commit it names.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import platform
from pathlib import Path

import torch

from benchmarks import smoke
from infosieve_fast.common.files import atomic_write
from infosieve_fast.common.source_tree import ROOT, commit_tree_hash, git_state, tree_hash  # noqa: F401 (ROOT: re-exported)


def stamp() -> dict:
    """The provenance fields every result JSON carries, read once per process: a benchmark writes its JSON after every
    step, and the code that ran is the code it started with."""
    return dict(_stamp())


@functools.cache
def _stamp() -> dict:
    commit, dirty = git_state()
    return {"commit": commit, "dirty": dirty, "tree_hash": tree_hash(), **({"smoke": True} if smoke.active() else {})}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def versions(*modules: str) -> dict[str, str]:
    """The versions of python, torch and each of `modules` (imported: a module that does not import is reported as
    "unavailable: <error>", a finding rather than a crash)."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for module in modules:
        try:
            out[module] = importlib.import_module(module).__version__
        except Exception as exn:
            out[module] = f"unavailable: {type(exn).__name__}: {exn}"
    return out


def emit_json(result: dict, path: str | Path | None, indent: int = 1, echo: bool = True) -> None:
    """The benchmark's result as JSON, with `stamp()`'s fields where it lacks them: printed (`echo`) and, when `path`
    is given, written there too, atomically (a temporary file renamed over it): a benchmark killed by a time limit
    while it writes leaves the previous complete JSON, never a torn one."""
    result = {**stamp(), **result} if "tree_hash" not in result else result
    text = json.dumps(result, indent=indent)
    if path:
        atomic_write(Path(path), lambda f: f.write((text + "\n").encode()))
    if echo:
        print(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="print the tree hash of the working tree or of a commit")
    parser.add_argument("--commit", help="hash this commit's code instead of the working tree's")
    args = parser.parse_args(argv)
    print(commit_tree_hash(args.commit) if args.commit else tree_hash())


if __name__ == "__main__":
    main()
