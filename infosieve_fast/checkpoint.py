"""Atomic run-folder writes: a crash mid-write never leaves a half-written checkpoint, config or metrics file (only a
temporary `.NAME.*.tmp` beside it); a kill mid-append can tear the last line of `log.jsonl`, which `read_log` drops.

A checkpoint can also be written in the background (`save_checkpoint_in_background`): the state is copied to host
memory at once, then serialised, fsynced and renamed into place by a writer thread while training goes on. At most one
such write is pending: the next checkpoint write or read in the process waits for it first, and an error of the
writer is raised there (or at exit)."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import pickle
import re
import sys
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT = "checkpoint.pt"
EPOCH_COPY = "checkpoint-epoch-{epoch}.pt"  # `checkpoint.keep_last`'s copies


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


def save_checkpoint(run_dir: str | Path, state: dict[str, Any], keep_last: int | None = None) -> Path:
    """RUN/checkpoint.pt; with `keep_last`, an end-of-epoch state is also kept by `keep_epoch_copy`."""
    wait_for_checkpoint()
    path = Path(run_dir) / CHECKPOINT
    atomic_write(path, lambda f: torch.save(state, f))
    if keep_last is not None and state.get("mid_epoch") is None:
        keep_epoch_copy(path, state["epoch"], keep_last)
    return path


def keep_epoch_copy(path: Path, epoch: int, keep_last: int) -> None:
    """RUN/checkpoint-epoch-E.pt for the checkpoint `path` of E epochs trained: a hard link to its file (the next
    checkpoint is renamed over checkpoint.pt, so the link keeps this one; a copy where links are refused), then the
    copies older than the last `keep_last` removed."""
    copy = path.with_name(EPOCH_COPY.format(epoch=epoch))
    copy.unlink(missing_ok=True)  # a resumed run writes its epoch again
    try:
        os.link(path, copy)
    except OSError:  # a file system without hard links
        atomic_write(copy, lambda f: f.write(path.read_bytes()))
    kept = sorted(path.parent.glob(EPOCH_COPY.format(epoch="*")), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    for old in kept[:-keep_last]:
        old.unlink(missing_ok=True)


class _BackgroundWrite:
    """The pending background checkpoint write of this process (at most one) and the error it ended with."""

    thread: threading.Thread | None = None
    error: BaseException | None = None


def host_copy(obj: Any) -> Any:
    """`obj` with every tensor copied to host memory (a copy even of a CPU tensor, so that training may change the
    original) and every dict, list and tuple rebuilt: a snapshot nothing else holds."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = type(obj)((k, host_copy(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # a module state_dict's versions, read by load_state_dict
            out._metadata = host_copy(obj._metadata)
        return out
    if isinstance(obj, list | tuple):
        return type(obj)(host_copy(v) for v in obj)
    return obj  # numbers, strings, bytes, None: immutable


def save_checkpoint_in_background(run_dir: str | Path, state: dict[str, Any], keep_last: int | None = None) -> None:
    """`save_checkpoint` of a host snapshot of `state` in a writer thread. Waits for (and raises the error of) the
    previous background write first, so that checkpoints reach the disk in order."""
    wait_for_checkpoint()
    snapshot = host_copy(state)

    def write() -> None:
        try:
            save_checkpoint(run_dir, snapshot, keep_last)
        except BaseException as err:  # raised in the training thread at its next wait
            _BackgroundWrite.error = err

    _BackgroundWrite.thread = threading.Thread(target=write, name="checkpoint-writer")
    _BackgroundWrite.thread.start()


def wait_for_checkpoint() -> None:
    """Block until the pending background checkpoint write (if any) is durable; raise its error if it failed."""
    thread = _BackgroundWrite.thread
    if thread is threading.current_thread():
        return  # the writer's own save_checkpoint call
    if thread is not None:
        thread.join()
        _BackgroundWrite.thread = None
    error, _BackgroundWrite.error = _BackgroundWrite.error, None
    if isinstance(error, DiskWriteError):
        raise DiskWriteError(f"the background checkpoint write failed: {error}") from error
    if error is not None:
        raise RuntimeError(f"the background checkpoint write failed ({type(error).__name__}: {error})") from error


atexit.register(wait_for_checkpoint)


def rng_state() -> bytes:
    """torch's CPU generator state as bytes: `map_location` moves tensors (a CUDA resume would put a tensor state on
    the GPU, which `torch.set_rng_state` refuses) but leaves bytes where they are."""
    return torch.get_rng_state().numpy().tobytes()


def restore_rng_state(state: bytes) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


class CheckpointError(ValueError):
    """A checkpoint or weights file that is not read (damaged, or holding more than tensors): the message names the
    file and the way out."""


def load_checkpoint(
    run_dir: str | Path, map_location="cpu", name: str = CHECKPOINT, mmap: bool = False
) -> dict[str, Any]:
    """The run's last checkpoint (or the file `name`, e.g. the best one), read with `weights_only=True` (tensors, dicts,
    lists, str, bytes, numbers only: a checkpoint never runs code when it is read). A pending background write is
    waited for first. `mmap`: the tensors stay on disk until used (for reading only its records)."""
    wait_for_checkpoint()
    path = Path(run_dir) / name
    if not path.is_file():
        raise FileNotFoundError(f"no {name} in {run_dir}: pass the folder of a run that finished an epoch")
    return read_tensors(
        path,
        map_location,
        mmap=mmap,
        refused_hint="Was it written by another program?",
        damaged_hint=(
            "checkpoints are written atomically, so it was damaged afterwards (a copy cut short, a full disk): "
            f"restore it from a copy, or start the run again (delete {path} and run `infosieve train --resume "
            f"{path.parent}` to train it from epoch 1)"
        ),
    )


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


def remove_temporary_files(run_dir: str | Path) -> None:
    """Drop the temporary files a kill mid-write leaves (`.NAME.*.tmp`, never renamed over NAME)."""
    for tmp in Path(run_dir).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
