"""Each epoch's checkpoint written in a background thread while the next epoch runs (`train.background_checkpoint`):
the run folder ends exactly as with synchronous writes, the checkpoint holds the state of the moment it was asked for,
the end of training waits for the write, and a failed write is raised at the next wait."""

import threading

import pytest
import torch

from infosieve_fast.common import files as common_files
from infosieve_fast.common.files import read_log
from infosieve_fast.training import checkpoint as ckpt
from infosieve_fast.training.checkpoint import load_checkpoint
from infosieve_fast.training.run_folder import train
from tests.test_engine import smoke_config


def without_timings(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("seconds", "peak_"))}


def test_background_checkpoints_end_as_synchronous_ones(tmp_path, monkeypatch):
    writers = []  # the thread of every checkpoint write
    save = ckpt.save_checkpoint
    monkeypatch.setattr(ckpt, "save_checkpoint", lambda *a: writers.append(threading.current_thread().name) or save(*a))
    sync = train(smoke_config("train.background_checkpoint=false"), tmp_path / "sync")
    assert writers == ["MainThread"] * 3  # two epochs and the final evaluation's
    writers.clear()
    background = train(smoke_config(), tmp_path / "background")
    assert writers == ["checkpoint-writer"] * 2 + ["MainThread"]
    assert background == sync
    a, b = load_checkpoint(tmp_path / "sync"), load_checkpoint(tmp_path / "background")
    assert a["epoch"] == b["epoch"] == 2 and a["torch_rng"] == b["torch_rng"]
    assert torch.equal(a["centers"], b["centers"])
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
    torch.testing.assert_close(a["optimizer"], b["optimizer"], rtol=0, atol=0)
    logs = [read_log(tmp_path / run / "log.jsonl") for run in ("sync", "background")]
    assert [without_timings(r) for r in logs[0]] == [without_timings(r) for r in logs[1]]


def test_a_run_stopped_early_has_its_checkpoint_on_disk_when_train_returns(tmp_path):
    assert train(smoke_config(), tmp_path / "run", stop_after=lambda epoch: epoch == 0) is None
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["epoch"] == 1  # read without waiting
    assert ckpt._BackgroundWrite.thread is None


def test_the_checkpoint_holds_the_state_of_the_moment_it_was_asked_for(tmp_path, monkeypatch):
    release, write = threading.Event(), common_files.atomic_write

    def held_write(path, writer):
        release.wait(timeout=30)
        write(path, writer)

    monkeypatch.setattr(ckpt, "atomic_write", held_write)
    weights = torch.arange(4.0)
    state = {"model": torch.nn.Linear(2, 2).state_dict(), "w": weights, "lr": [0.5]}
    ckpt.save_checkpoint_in_background(tmp_path, state)
    weights.add_(10)  # training goes on while the write waits
    state["lr"][0] = 0.1
    release.set()
    saved = load_checkpoint(tmp_path)  # waits for the write
    assert saved["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and saved["lr"] == [0.5]
    assert all(torch.equal(v, state["model"][k]) for k, v in saved["model"].items())
    assert saved["model"]._metadata == state["model"]._metadata  # module versions kept for load_state_dict


def test_a_failed_background_write_is_raised_at_the_next_wait(tmp_path, monkeypatch):
    def full_disk(path, writer):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "atomic_write", full_disk)
    ckpt.save_checkpoint_in_background(tmp_path, {"w": torch.zeros(2)})  # returns: the writer fails later
    with pytest.raises(RuntimeError, match=r"background checkpoint write failed \(OSError: .*No space left"):
        ckpt.wait_for_checkpoint()
    ckpt.wait_for_checkpoint()  # raised once
    ckpt.save_checkpoint_in_background(tmp_path, {"w": torch.zeros(2)})
    with pytest.raises(RuntimeError, match="background checkpoint write failed"):
        ckpt.save_checkpoint(tmp_path, {"w": torch.ones(2)})  # the next checkpoint raises it too


def test_a_failed_background_write_stops_the_training_run(tmp_path, monkeypatch):
    write = common_files.atomic_write

    def failing_checkpoints(path, writer):
        if path.name == ckpt.CHECKPOINT:
            raise OSError(28, "No space left on device")
        write(path, writer)

    monkeypatch.setattr(ckpt, "atomic_write", failing_checkpoints)
    with pytest.raises(RuntimeError, match="background checkpoint write failed"):
        train(smoke_config(), tmp_path / "run")
    assert not (tmp_path / "run" / ckpt.CHECKPOINT).exists()
