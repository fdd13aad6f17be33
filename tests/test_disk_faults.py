"""Faulty disks: a checkpoint, log or metrics write the file system refuses (ENOSPC, EIO, a read-only folder; injected
by patching the write, rename and fsync calls) leaves the previous file readable and names the path and the error in
one line; a run stopped so continues, once the disk is fixed, exactly as an uninterrupted run. And
`checkpoint.keep_last`'s per-epoch copies."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from infosieve_fast import cli
from infosieve_fast.common import files
from infosieve_fast.training import checkpoint as ckpt
from tests.test_fault_injection import assert_same_run
from tests.test_preemption import SMALL

SETS = [a for s in [*SMALL, "data.batch_size=32", "checkpoint.keep_last=1"] for a in ("--set", s)]  # 2 steps an epoch


def refuse(code: int):
    def refused(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return refused


def test_a_refused_rename_keeps_the_previous_file_and_names_path_and_error(tmp_path, monkeypatch):
    files.write_json(tmp_path / "metrics.json", {"all": 0.5})
    monkeypatch.setattr(ckpt.os, "replace", refuse(errno.EIO))
    with pytest.raises(files.DiskWriteError) as err:
        files.write_json(tmp_path / "metrics.json", {"all": 0.9})
    assert str(err.value) == (
        f"cannot write {tmp_path / 'metrics.json'}: Input/output error (errno 5); the previous metrics.json is intact"
    )
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"all": 0.5}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]  # the temporary file is gone


def test_a_refused_fsync_of_a_log_line_keeps_the_earlier_lines(tmp_path, monkeypatch):
    log = tmp_path / "log.jsonl"
    files.append_log(log, {"epoch": 0})
    monkeypatch.setattr(ckpt.os, "fsync", refuse(errno.ENOSPC))
    with pytest.raises(files.DiskWriteError, match=rf"^cannot write {log}: No space left on device \(errno 28\); its"):
        files.append_log(log, {"epoch": 1})
    monkeypatch.undo()
    assert files.read_log(log)[0] == {"epoch": 0}


def test_a_read_only_folder_is_named_and_its_checkpoint_kept(tmp_path, monkeypatch):
    ckpt.save_checkpoint(tmp_path, {"epoch": 1})
    monkeypatch.setattr(files.tempfile, "mkstemp", refuse(errno.EROFS))  # the folder was remounted read-only
    with pytest.raises(files.DiskWriteError) as err:
        ckpt.save_checkpoint(tmp_path, {"epoch": 2})
    assert str(err.value) == (
        f"cannot write {tmp_path / ckpt.CHECKPOINT}: Read-only file system (errno 30); the previous checkpoint.pt is "
        "intact"
    )
    monkeypatch.undo()
    assert ckpt.load_checkpoint(tmp_path) == {"epoch": 1}


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_stops_the_run_in_one_line_and_resume_ends_exactly(tmp_path, monkeypatch, capsys):
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert cli.main(["train", "--config", "configs/demo.yaml", "--out", str(reference), *SETS]) == 0
    save, saves = torch.save, []

    def full_at_the_second_checkpoint(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and "optimizer" in obj:  # checkpoint.pt's state (the best checkpoint's has none)
            saves.append(obj["epoch"])
            if len(saves) == 2:  # epoch 2's: half of it reaches the disk, then the disk is full
                f.write(b"\0" * 100)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_at_the_second_checkpoint)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", "--config", "configs/demo.yaml", "--out", str(run), *SETS])
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and f"cannot write {run / ckpt.CHECKPOINT}: No space left on device (errno 28)" in lines[0]
    assert f"infosieve train --resume {run}" in lines[0]
    assert ckpt.load_checkpoint(run)["epoch"] == 1  # the previous checkpoint, readable
    assert [r["epoch"] for r in files.read_log(run / "log.jsonl")] == [0, 1]  # epoch 2's line, which resume drops
    assert not list(run.glob(".*.tmp"))
    monkeypatch.undo()  # space freed
    assert cli.main(["train", "--resume", str(run)]) == 0
    assert_same_run(reference, run, epochs=2)
    copies = sorted(p.name for p in run.glob("checkpoint-epoch-*.pt"))
    assert copies == ["checkpoint-epoch-2.pt"]  # keep_last=1: the last epoch's only
    copy, last = torch.load(run / copies[0], weights_only=True), ckpt.load_checkpoint(run)
    assert copy["epoch"] == 2 and all(torch.equal(copy["model"][k], v) for k, v in last["model"].items())
