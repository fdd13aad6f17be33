"""Faults that ended in a traceback (or a silent loss) where one line is promised, each failing before its fix: a
folder that cannot be written (train, make-shards, report, export), torch's RuntimeError for a full disk during a
checkpoint write, an unknown model.backbone_kwargs key, weights that diverged to NaN/inf (saved, then blamed on the
data), predict dropping a whole shard at a damaged tail, and predict reading one image as a list file."""

from __future__ import annotations

import errno
import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from infosieve_fast import cli
from infosieve_fast.commands import predict
from infosieve_fast.common import files
from infosieve_fast.config.settings import load_config
from infosieve_fast.network.model import build_backbone
from infosieve_fast.training import checkpoint as ckpt
from infosieve_fast.training.weight_check import NonFiniteWeights, check_weights
from tests.test_preemption import SMALL


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error: ")]


def read_only(monkeypatch, folder: Path) -> None:
    """`folder` (and anything under it) refuses to be made, as on a read-only mount (root ignores chmod)."""
    mkdir = Path.mkdir

    def refused(self, *args, **kwargs):
        if self == folder or folder in self.parents:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refused)


def test_train_on_a_read_only_out_is_one_line(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ro" / "run"
    read_only(monkeypatch, tmp_path / "ro")
    argv = ["train", "--config", "configs/demo.yaml", "--out", str(out), *(a for s in SMALL for a in ("--set", s))]
    assert cli.main(argv) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert line == f"error: {out}: Read-only file system (errno 30); choose a folder you can write to"


def test_make_shards_on_a_read_only_out_is_one_line(tmp_path, monkeypatch, capsys):
    images = tmp_path / "images"
    for name in ("labelled/a", "labelled/b", "unlabelled"):
        (images / name).mkdir(parents=True)
        Image.new("RGB", (10, 12)).save(images / name / "0.png")
    out = tmp_path / "ro" / "shards"
    read_only(monkeypatch, tmp_path / "ro")
    assert cli.main(["make-shards", "--dataset", "discovery", "--root", str(images), "--out", str(out)]) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: {out}: Read-only file system (errno 30)")


class FullDisk(io.FileIO):
    """A file on a disk that fills after 1000 bytes (what torch.save meets as the OSError of a write)."""

    def write(self, data):
        if self.tell() + len(data) > 1000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def test_a_full_disk_during_the_background_checkpoint_write_is_a_disk_write_error(tmp_path, monkeypatch):
    ckpt.save_checkpoint(tmp_path, {"epoch": 1})
    monkeypatch.setattr(ckpt.os, "fdopen", lambda fd, mode: FullDisk(fd, "wb"))
    ckpt.save_checkpoint_in_background(tmp_path, {"epoch": 2, "w": torch.zeros(10_000)})
    with pytest.raises(files.DiskWriteError) as err:  # torch raised RuntimeError("unexpected pos ...")
        ckpt.wait_for_checkpoint()
    assert str(err.value) == (
        f"the background checkpoint write failed: cannot write {tmp_path / ckpt.CHECKPOINT}: No space left on device "
        "(errno 28); the previous checkpoint.pt is intact"
    )
    monkeypatch.undo()
    assert ckpt.load_checkpoint(tmp_path) == {"epoch": 1} and not list(tmp_path.glob(".*.tmp"))


def test_a_runtime_error_of_another_kind_is_not_called_a_disk_error(tmp_path):
    def fails(f):
        raise RuntimeError("a bug, not the disk")

    with pytest.raises(RuntimeError, match="a bug, not the disk"):
        files.atomic_write(tmp_path / "x", fails)


def test_an_unknown_backbone_kwargs_key_names_the_key_and_the_backbone():
    cfg = load_config(None, ["model.backbone=resnet18", "model.backbone_kwargs={colour_channels: 3}"]).model
    with pytest.raises(ValueError) as err:
        build_backbone(cfg)
    assert str(err.value) == (
        "model.backbone_kwargs.colour_channels is not an argument of the backbone 'resnet18': drop it, or check its "
        "name against the backbone's constructor"
    )


# ---- weights that diverged --------------------------------------------------------------------------------------


def test_non_finite_weights_are_named_with_the_setting_to_change():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    check_weights(model, 0, 0.1)  # finite: nothing raised
    with torch.no_grad():
        model[0].bias[2] = float("inf")
        model[1].running_mean[0] = float("nan")
    with pytest.raises(NonFiniteWeights) as err:
        check_weights(model, 4, 1e308)
    message = str(err.value)
    assert message.startswith("training diverged in epoch 5: 2 of 6 weight tensors are NaN or inf (first: 0.bias)")
    assert "lower optim.lr (now 1e+308)" in message and "\n" not in message


@pytest.mark.slow
def test_a_diverged_epoch_writes_no_checkpoint_and_says_so_in_one_line(tmp_path, capsys):
    """One step per epoch at lr 1e308: the step's loss is finite, the weights it leaves are not. Before: checkpoint.pt
    held them, and the final evaluation failed with "u_feats contains NaN or inf values ... clean or drop those
    rows"."""
    sets = [*SMALL, "schedule.epochs=1", "train.max_steps_per_epoch=1", "optim.lr=1e308"]
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        argv = ["train", "--config", "configs/demo.yaml", "--out", str(out)]
        cli.main([*argv, *(a for s in sets for a in ("--set", s))])
    [line] = error_lines(capsys.readouterr().err)
    assert stopped.value.code == 1 and line.startswith("error: training diverged in epoch 1: ")
    assert "lower optim.lr (now 1e+308)" in line
    assert not (out / ckpt.CHECKPOINT).exists()


def test_report_on_a_read_only_run_is_one_line(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    sets = [*SMALL, "schedule.epochs=1", "train.max_steps_per_epoch=1"]
    argv = ["train", "--config", "configs/demo.yaml", "--out", str(out)]
    assert cli.main([*argv, *(a for s in sets for a in ("--set", s))]) == 0
    capsys.readouterr()
    read_only(monkeypatch, out / "report")  # the run folder was remounted read-only
    assert cli.main(["report", "--run", str(out)]) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert line == f"error: {out / 'report'}: Read-only file system (errno 30); choose a folder you can write to"
    assert not (out / "report.html").exists()


# ---- predict ----------------------------------------------------------------------------------------------------


def jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((10 + i, 12, 3), 40 * i, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_predict_keeps_the_samples_before_a_damaged_tail_and_names_the_damage(tmp_path, capsys):
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(4):
            data = jpeg(i)
            info = tarfile.TarInfo(f"k{i}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:
        third = tar.getmembers()[2]
    path.write_bytes(path.read_bytes()[: third.offset_data + 100])  # cut inside the third member's data
    items = predict.image_items(path, ("jpg",))
    assert [name for name, _ in items] == ["s.tar/k0", "s.tar/k1"]
    sizes = [tuple(predict._load(src, 16, 3, None)[0].shape[1:]) for _, src in items]
    assert sizes == [(16, 19), (16, 17)]  # 10 x 12 and 11 x 12, the shorter side resized to 16
    err = capsys.readouterr().err
    assert f"{path}: member at byte" in err and "the samples after the damage are unreadable" in err


def test_predict_takes_one_image_file(tmp_path):
    image = tmp_path / "one.jpg"
    image.write_bytes(jpeg(2))
    assert predict.image_items(image) == [(str(image), image)]
    listing = tmp_path / "list.bin"
    listing.write_bytes(b"\xff\xfe not text")
    with pytest.raises(ValueError, match=r"^--images .*list.bin is neither an image .* nor a list of image paths"):
        predict.image_items(listing)
