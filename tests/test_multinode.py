"""Two nodes: `torchrun --nnodes=2` launched twice on this machine (node ranks 0 and 1, one gloo rank each, static
rendezvous on 127.0.0.1), training from shards on a path both see into one run folder. The run must equal the same
two ranks launched as one node (`--nnodes=1 --nproc_per_node=2`): the same global ranks read the same shares, so the
exact k-means, every log line but its timings, the metrics and the checkpoint's weights must be identical. Node 1's
rank never writes the run folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infosieve_fast.common.files import read_log
from infosieve_fast.data.writing.shards import make_shards
from tests.test_kmeans_distributed import _free_port

TIMEOUT_S = 300
CLASSES = ("airplane", "automobile", "bird", "cat")
TRAIN = [
    "-m", "infosieve_fast.cli", "train", "--config", "configs/demo.yaml",
    "--set", "schedule.epochs=2", "--set", "kmeans.n_init=2", "--set", "data.batch_size=16",
    "--set", "model.proj_out_dim=128", "--set", "model.proj_hidden_dim=64", "--set", "model.proj_bottleneck_dim=32",
    "--set", "model.backbone=test_resnet", "--set", "model.backbone_kwargs={in_chans: 3}",
    "--set", "data.mean=[0.5, 0.5, 0.5]", "--set", "data.std=[0.25, 0.25, 0.25]", "--set", "data.num_workers=0",
    "--set", "train.device=cpu", "--set", "data.source=shards",
]  # fmt: skip


def torchrun(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("torchrun")), *args]


def launch(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_all(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the launches did not finish within {TIMEOUT_S} s (a hang between nodes?)")
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def runs(realdata, tmp_path_factory):
    shared = tmp_path_factory.mktemp("shared")  # the folder both "nodes" see: shards and run folders
    for cls in CLASSES:
        (shared / "raw" / "train" / cls).mkdir(parents=True)
        for src in sorted((realdata / "cifar10_test" / "test" / cls).glob("*.jpg"))[:24]:
            (shared / "raw" / "train" / cls / src.name).symlink_to(src)
    make_shards("imagefolder", shared / "raw", shared / "shards", resize=40, known_classes=[0, 1], progress=False)
    train = [*TRAIN, "--data.shards", str(shared / "shards")]

    one_node = shared / "one-node"
    port = _free_port()
    cmd = torchrun("--nnodes=1", "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}")
    logs = [shared / "one-node.log"]
    wait_all([launch([*cmd, *train, "--out", str(one_node)], logs[0])], logs)

    two_nodes = shared / "two-nodes"
    port = _free_port()
    logs = [shared / f"node{rank}.log" for rank in (0, 1)]
    procs = [
        launch(torchrun("--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                        f"--master_port={port}", *train, "--out", str(two_nodes)), logs[rank])
        for rank in (0, 1)
    ]  # fmt: skip
    wait_all(procs, logs)
    return one_node, two_nodes, logs


def without_timings(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("seconds", "peak_"))}


def test_two_nodes_train_exactly_as_two_ranks_on_one_node(runs):
    one, two, _ = runs
    assert json.loads((two / "metrics.json").read_text()) == json.loads((one / "metrics.json").read_text())
    log_one, log_two = read_log(one / "log.jsonl"), read_log(two / "log.jsonl")
    assert [r["steps"] for r in log_two] == [96 // (16 * 2)] * 2  # batch_size per rank, two ranks
    assert [without_timings(r) for r in log_two] == [without_timings(r) for r in log_one]
    a = torch.load(one / "checkpoint.pt", weights_only=False)
    b = torch.load(two / "checkpoint.pt", weights_only=False)
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert torch.equal(a["centers"], b["centers"])


def test_only_node_0_writes_the_run_folder(runs):
    one, two, logs = runs
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    assert "run folder" in logs[0].read_text() and "run folder" not in logs[1].read_text()
