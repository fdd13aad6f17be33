"""The files the project reads and writes, whatever the stage: atomic writes (a crash mid-write never leaves a
half-written file, only a temporary `.NAME.*.tmp` beside it), JSON and JSON-lines logs (a kill mid-append can tear the
last line, which `read_log` drops), SHA-256 digests, and tensor files read without running code."""

from __future__ import annotations

import hashlib
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


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _umask() -> int:
    """The process's umask (read by setting it and back: done once, at import, before any thread writes files)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()  # what open() gives a new file; mkstemp's own 0600 would hide the file from others


class DiskWriteError(OSError):
    """A run-folder write the file system refused (a full disk, an I/O error, a read-only folder). The message names
    the file and the error in one line; the file's previous version (or the log's earlier lines) is intact."""

    @classmethod
    def naming(cls, path: Path, err: OSError, kept: str) -> DiskWriteError:
        error = cls(f"cannot write {path}: {err.strerror or err} (errno {err.errno}); {kept}")
        error.errno = err.errno
        return error


def atomic_write(path: Path, write) -> None:
    """Write `path` through `write(binary file)` into a temporary file, fsynced, then renamed over it; the file gets
    the mode an ordinary new file gets (0644 under umask 022). A refused write raises `DiskWriteError`."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        refused = _refused_write(err)
        if refused is not None:
            kept = f"the previous {path.name} is intact" if path.exists() else f"no {path.name} was written"
            raise DiskWriteError.naming(path, refused, kept) from err
        raise


def _refused_write(err: BaseException) -> OSError | None:
    """The OSError behind a failed write: `err` itself, or the one `torch.save` met while writing (it raises a
    RuntimeError of its own, "unexpected pos", with the OSError only as its context); None for any other error."""
    if isinstance(err, DiskWriteError):
        return None
    if isinstance(err, OSError):
        return err
    context = err.__context__ if isinstance(err, RuntimeError) else None
    return context if isinstance(context, OSError) and not isinstance(context, DiskWriteError) else None


class CheckpointError(ValueError):
    """A checkpoint or weights file that is not read (damaged, or holding more than tensors): the message names the
    file and the way out."""


def read_tensors(path: Path, map_location="cpu", *, refused_hint: str, damaged_hint: str, mmap: bool = False) -> Any:
    """`torch.load(path, weights_only=True)`: tensors, dicts, lists, str, bytes and numbers only, so reading a file
    never runs code. A file holding other objects, or one that cannot be read, is a one-line `CheckpointError` naming
    it, what it holds or why it fails, and the hint for the way out."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as err:
        detail = (str(err).splitlines() or ["no detail"])[0].split(". ")[0]
        if isinstance(err, pickle.UnpicklingError) and "weights only" in str(err).lower():
            found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL (\S+)", str(err))  # torch words it both ways
            detail = f"it holds {found.group(1)}" if found else detail
            raise CheckpointError(
                f"{path} holds objects other than tensors, numbers, strings, bytes and containers, so it is not read "
                f"(weights_only=True: reading it could run code). {refused_hint} ({detail})"
            ) from err
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {detail}); {damaged_hint}") from err


def read_pretrained(path: Path) -> Any:
    """A `model.pretrained` weights file, read as `read_tensors` reads it (a training checkpoint that pickles its
    arguments too is refused, with how to keep its weights alone)."""
    return read_tensors(
        path,
        "cpu",
        refused_hint=(
            "If you trust the file, save its weights alone and point model.pretrained at that file: "
            f"torch.save(torch.load({str(path)!r}, weights_only=False)['teacher'], 'weights.pth') (or the entry "
            "'model' or 'state_dict', wherever its weights are)"
        ),
        damaged_hint="model.pretrained must be a PyTorch weights file: download it again, or point it at another",
    )


def write_json(path: str | Path, data: Any) -> None:
    atomic_write(Path(path), lambda f: f.write((json.dumps(data, indent=2) + "\n").encode()))


def rewrite_log(path: str | Path, records: list[dict]) -> None:
    """Replace `log.jsonl` with `records` (used on resume to drop epochs the checkpoint does not contain)."""
    atomic_write(Path(path), lambda f: f.write("".join(json.dumps(r) + "\n" for r in records).encode()))


def append_log(path: str | Path, record: dict) -> None:
    """One line appended to `path` (log.jsonl), fsynced. A refused write raises `DiskWriteError`; it can leave a torn
    last line, which `read_log` drops."""
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise DiskWriteError.naming(Path(path), err, "its earlier lines are intact") from err


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
