"""Atomic run-folder writes: a crash mid-write never leaves a half-written checkpoint, config or metrics file (only a
temporary `.NAME.*.tmp` beside it); a kill mid-append can tear the last line of `log.jsonl`, which `read_log` drops."""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
import tempfile
import zipfile
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


class CheckpointError(ValueError):
    """A run-folder file that cannot be read: the message names the file and the way out."""


def load_checkpoint(run_dir: str | Path, map_location="cpu") -> dict[str, Any]:
    """The run's last checkpoint, read with `weights_only=True` (tensors, dicts, lists, str, bytes, numbers only: a
    checkpoint never runs code when it is read)."""
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"no {CHECKPOINT} in {run_dir}: pass the folder of a run that finished an epoch")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as err:
        detail = (str(err).splitlines() or ["no detail"])[0].split(". ")[0]
        if isinstance(err, pickle.UnpicklingError) and "weights only" in str(err).lower():
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
            detail = f"it holds {found.group(1)}" if found else detail
            raise CheckpointError(
                f"{path} holds objects other than tensors, numbers, strings, bytes and containers, so it is not read "
                f"(weights_only=True: reading it could run code). Was it written by another program? ({detail})"
            ) from err
        raise CheckpointError(
            f"{path} cannot be read ({type(err).__name__}: {detail}); "
            f"checkpoints are written atomically, so it was damaged afterwards (a copy cut short, a full disk): "
            f"restore it from a copy, or start the run again (delete {path} and run `infosieve train --resume "
            f"{path.parent}` to train it from epoch 1)"
        ) from err


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
    """`log.jsonl`'s records. A torn last line (a kill mid-append leaves one; its epoch is not in the checkpoint) is
    dropped with a warning; a damaged line anywhere else is an error naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a {type(record).__name__}, not a JSON object")
        except ValueError as err:
            if i == last:
                print(f"warning: {path}: line {i + 1} is torn (a kill mid-write left it): dropped", file=sys.stderr)
                break
            raise CheckpointError(
                f"{path}: line {i + 1} is not a log record ({err}); only the last line can be torn by a kill: "
                f"repair or delete that line (the epochs after the checkpoint's are trained again on resume)"
            ) from None
        records.append(record)
    return records


def remove_temporary_files(run_dir: str | Path) -> None:
    """Drop the temporary files a kill mid-write leaves (`.NAME.*.tmp`, never renamed over NAME)."""
    for tmp in Path(run_dir).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
