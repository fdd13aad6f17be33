"""The console's status lines say what runs: one line per phase of an epoch (so each line's timer is that phase's
time, as log.jsonl's seconds_features and seconds_kmeans are), and no "compiling" line where nothing compiles."""

import torch

from infosieve_fast.network.compiling import compiles
from infosieve_fast.training import engine
from infosieve_fast.training.engine import Trainer
from tests.test_engine import smoke_config


def test_each_phase_has_its_own_status_line_and_the_cpu_shows_no_compiling(monkeypatch):
    shown = []  # (text the line opened with, the line)

    def recording_status_line(text):
        line = real(text)
        shown.append((text, line))
        return line

    real = engine.status_line
    monkeypatch.setattr(engine, "status_line", recording_status_line)
    trainer = Trainer(smoke_config("schedule.epochs=1", "train.max_steps_per_epoch=1", "train.compile=auto"))
    record = trainer.train_epoch(0)

    # log.jsonl says eager on the CPU, and so does the console: no line claims to compile
    assert record["compile"] == "eager" and record["seconds_compile"] == 0.0
    texts = [text for text, _ in shown]
    assert texts == ["epoch 1/1: feature pass (320 samples)", "epoch 1/1: SS-k-means pseudo-labels"]
    # a line keeps the text it opened with: a relabelled line would carry the previous phase's time in its timer
    assert [line.desc for _, line in shown] == texts and shown[0][1] is not shown[1][1]


def test_only_a_cuda_device_compiles():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [compiles(s, cpu) for s in ("auto", "on", "off")] == [False, False, False]
    assert [compiles(s, cuda) for s in ("auto", "on", "off")] == [True, True, False]
