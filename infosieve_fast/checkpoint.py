"""Atomic run-folder writes: a crash mid-write never leaves a half-written checkpoint, log or metrics file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT = "checkpoint.pt"


def atomic_write(path: Path, write) -> None:
    """Write `path` through `write(binary file)` into a temporary file, fsynced, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(run_dir: str | Path, state: dict[str, Any]) -> Path:
    path = Path(run_dir) / CHECKPOINT
    atomic_write(path, lambda f: torch.save(state, f))
    return path


def rng_state() -> bytes:
    """torch's CPU generator state as bytes: `map_location` moves tensors (a CUDA resume would put a tensor state on
    the GPU, which `torch.set_rng_state` refuses) but leaves bytes where they are."""
    return torch.get_rng_state().numpy().tobytes()


def restore_rng_state(state: bytes) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


def load_checkpoint(run_dir: str | Path, map_location="cpu") -> dict[str, Any]:
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"no {CHECKPOINT} in {run_dir}: pass the folder of a run that finished an epoch")
    return torch.load(path, map_location=map_location, weights_only=False)


def write_json(path: str | Path, data: Any) -> None:
    atomic_write(Path(path), lambda f: f.write((json.dumps(data, indent=2) + "\n").encode()))


def rewrite_log(path: str | Path, records: list[dict]) -> None:
    """Replace `log.jsonl` with `records` (used on resume to drop epochs the checkpoint does not contain)."""
    atomic_write(Path(path), lambda f: f.write("".join(json.dumps(r) + "\n" for r in records).encode()))


def append_log(path: str | Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_log(path: str | Path) -> list[dict]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
