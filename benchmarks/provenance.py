"""What a benchmark result must name: the commit it ran on, whether the tree was dirty, and the device."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def git_state() -> tuple[str, bool | None]:
    """(commit, dirty): INFOSIEVE_COMMIT / INFOSIEVE_DIRTY when set (gpu_check.sh sets them from the caller, who knows
    the commit: the device copy of the tree may carry a stale .git, which named the session's starting commit in the
    H200 runs of fc982c1 and 71b264b), else git. dirty is None when nobody knows."""
    if os.environ.get("INFOSIEVE_COMMIT"):
        return os.environ["INFOSIEVE_COMMIT"], {"0": False, "1": True}.get(os.environ.get("INFOSIEVE_DIRTY", ""))

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        except OSError:
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    return (commit, bool(git("status", "--porcelain"))) if commit else ("unknown", None)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def emit_json(result: dict, path: str | Path | None, indent: int = 1, echo: bool = True) -> None:
    """The benchmark's result as JSON: printed (`echo`) and, when `path` is given, written there too."""
    text = json.dumps(result, indent=indent)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    if echo:
        print(text)
