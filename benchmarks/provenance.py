"""What a benchmark result must name: the commit it ran on, whether the tree was dirty, and the device."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def git_state() -> tuple[str, bool | None]:
    """(commit, dirty) from git, else from INFOSIEVE_COMMIT / INFOSIEVE_DIRTY (gpu_check.sh sets them: the device
    tool copies the tree without .git). dirty is None when nobody knows."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        except OSError:
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    if commit:
        return commit, bool(git("status", "--porcelain"))
    dirty = os.environ.get("INFOSIEVE_DIRTY", "")
    return os.environ.get("INFOSIEVE_COMMIT", "unknown"), {"0": False, "1": True}.get(dirty)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
