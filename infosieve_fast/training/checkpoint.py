"""The run's checkpoint: RUN/checkpoint.pt written atomically (`common/files.py`), its epoch copies, the random
generators' states, and the checkpoint read back (tensors only: reading it never runs code).

A checkpoint can also be written in the background (`save_checkpoint_in_background`): the state is copied to host
memory at once, then serialised, fsynced and renamed into place by a writer thread while training goes on. At most one
such write is pending: the next checkpoint write or read in the process waits for it first, and an error of the
writer is raised there (or at exit)."""

from __future__ import annotations

import atexit
import os
import threading
from pathlib import Path
from typing import Any

import torch

from ..common.files import DiskWriteError, atomic_write, read_tensors

CHECKPOINT = "checkpoint.pt"
EPOCH_COPY = "checkpoint-epoch-{epoch}.pt"  # `checkpoint.keep_last`'s copies


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


def remove_temporary_files(run_dir: str | Path) -> None:
    """Drop the temporary files a kill mid-write leaves (`.NAME.*.tmp`, never renamed over NAME)."""
    for tmp in Path(run_dir).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
