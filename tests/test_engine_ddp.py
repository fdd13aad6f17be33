"""Training under torch.distributed: two gloo processes on the CPU run the demo (DDP), write one run folder, agree on
every table and metric, and cluster exactly as one process does."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infosieve_fast import cli
from infosieve_fast.analysis import run_reader
from infosieve_fast.common.files import read_log
from infosieve_fast.config.settings import load_config
from infosieve_fast.evaluation.evaluator import Evaluator
from infosieve_fast.kmeans import semi_supervised_kmeans
from infosieve_fast.network.loss import InfoSieveLoss
from infosieve_fast.network.model import Backbone
from infosieve_fast.training import engine as eng
from infosieve_fast.training import run_folder
from infosieve_fast.training.loss_monitor import NonFiniteLoss
from tests.test_engine import SMOKE, NaNInTraining
from tests.test_kmeans_distributed import _free_port

WORLD = 2
TIMEOUT_S = 240  # the whole two-process session; a hang fails the test instead of blocking CI
# The demo with a small timm ResNet (BatchNorm buffers, which DDP leaves rank-local after each forward).
DDP_SMOKE = [*SMOKE, "model.backbone=test_resnet"]


def ddp_config(*extra):
    return load_config("configs/demo.yaml", DDP_SMOKE + list(extra))


class NaNOnRank1(NaNInTraining):
    """Finite features for the feature pass (eval mode); NaN in training on rank 1 only."""

    def forward(self, x):
        return super().forward(x) if dist.get_rank() == 1 else self.proj(x.flatten(1))


def _spy(calls: list, totals: list) -> None:
    """Record every clustering (this rank's features and the table it got) and every step's loss, in this process."""
    cluster, loss_call = Evaluator.cluster, InfoSieveLoss.__call__

    def spy_cluster(self, fs, seed, balanced, n_clusters=None):
        result = cluster(self, fs, seed, balanced, n_clusters)
        calls.append(
            {
                "fs": vars(fs),
                "seed": seed,
                "balanced": balanced,
                "table": result.labels,
                "inertia": result.inertia,
                "centers": result.centers,
            }
        )
        return result

    def spy_loss(self, *args):
        total, parts = loss_call(self, *args)
        totals.append(float(total))
        return total, parts

    Evaluator.cluster, InfoSieveLoss.__call__ = spy_cluster, spy_loss


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    out_dir = Path(out)
    res: dict = {}
    try:
        calls, totals = [], []
        _spy(calls, totals)
        res["full"] = run_folder.train(ddp_config(), out_dir / "full")
        res["calls"], res["totals"] = list(calls), list(totals)

        killed = out_dir / "killed"
        res["killed"] = run_folder.train(ddp_config(), killed, stop_after=lambda epoch: epoch == 0)
        res["resumed"] = run_folder.train(load_config(killed / "config.yaml"), killed, resume=True)

        try:
            run_folder.train(ddp_config(), out_dir / "nan", backbone=Backbone(NaNOnRank1(), 16, grad_from_block=None))
        except NonFiniteLoss as err:
            res["nan"] = str(err)
        torch.save(res, out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    ctx = mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the {WORLD}-process run did not finish within {TIMEOUT_S} s (a hang between ranks?)")
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_rank0_writes_the_run_folder_once(ddp):
    out, res = ddp
    run = out / "full"
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoint.pt",
        "clustering.npz",
        "config.yaml",
        "fingerprint.json",
        "log.jsonl",
        "metrics.json",
    ]
    assert load_config(run / "config.yaml") == ddp_config()
    log = read_log(run / "log.jsonl")
    assert [r["epoch"] for r in log] == [0, 1]
    assert [r["steps"] for r in log] == [320 // (64 * WORLD)] * 2  # batch_size is per rank
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics == res[0]["full"] == res[1]["full"]
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    assert state["epoch"] == 2 and not any(k.startswith("module.") for k in state["model"])


def test_log_averages_the_loss_over_ranks(ddp):
    out, res = ddp
    log = read_log(out / "full" / "log.jsonl")
    steps = log[0]["steps"]
    for epoch, record in enumerate(log):
        per_rank = [torch.tensor(r["totals"][epoch * steps : (epoch + 1) * steps]).mean() for r in res]
        assert record["loss_total"] == pytest.approx(float(torch.stack(per_rank).mean()), rel=1e-6)
        assert per_rank[0] != per_rank[1]  # the ranks trained on different samples


def test_feature_shares_partition_the_train_set_and_tables_agree(ddp):
    _, res = ddp
    calls = [r["calls"] for r in res]
    assert len(calls[0]) == len(calls[1]) == 4  # before, epoch 0, epoch 1, after
    for c0, c1 in zip(*calls, strict=True):
        uq = torch.cat([c0["fs"]["uq"], c1["fs"]["uq"]])
        assert sorted(uq.tolist()) == list(range(320)) and len(c0["fs"]["uq"]) == len(c1["fs"]["uq"]) == 160
        assert torch.equal(c0["fs"]["all_uq"], uq) and torch.equal(c1["fs"]["all_uq"], uq)
        assert torch.equal(c0["table"], c1["table"]) and c0["inertia"] == c1["inertia"]
        assert torch.equal(c0["centers"], c1["centers"])


def test_two_process_clustering_equals_one_process(ddp):
    """The shards' k-means is the k-means of all features in one process, for every clustering of the run."""
    out, res = ddp
    cfg = ddp_config()
    for c0, c1 in zip(res[0]["calls"], res[1]["calls"], strict=True):
        feats = torch.cat([c0["fs"]["feats"], c1["fs"]["feats"]])
        targets = torch.cat([c0["fs"]["targets"], c1["fs"]["targets"]])
        lab = torch.cat([c0["fs"]["labelled"], c1["fs"]["labelled"]])
        single = semi_supervised_kmeans(
            feats[~lab],
            feats[lab],
            targets[lab],
            10,
            n_init=cfg.kmeans.n_init,
            max_iter=cfg.kmeans.max_iter,
            tol=cfg.kmeans.tol,
            balanced=c0["balanced"],
            balance=cfg.kmeans.balance,
            seed=c0["seed"],
            backend="torch",
        )
        table = torch.empty(320, dtype=torch.long)
        table[lab.nonzero().squeeze(1)] = single.labels[: int(lab.sum())]
        table[(~lab).nonzero().squeeze(1)] = single.labels[int(lab.sum()) :]
        assert torch.equal(table, c0["table"])
        # fp32 features: the ranks' partial sums are added in another order than one process adds them
        assert single.inertia == pytest.approx(c0["inertia"], rel=1e-4)
    inertia = [c["inertia"] for c in res[0]["calls"][1:3]]
    assert [r["kmeans_inertia"] for r in read_log(out / "full" / "log.jsonl")] == inertia


def test_untrained_model_evaluates_as_in_one_process(ddp):
    """Feature pass + k-means + metrics of the same-seed untrained model: one process equals the two-process run."""
    _, res = ddp
    trainer = eng.Trainer(ddp_config())
    fs = trainer.evaluator.features("test")
    before = res[0]["calls"][0]["fs"]
    torch.testing.assert_close(fs.feats, torch.cat([before["feats"], res[1]["calls"][0]["fs"]["feats"]]))
    assert trainer.evaluate() == res[0]["full"]["before"]


def test_resume_and_single_process_eval_of_a_ddp_run(ddp):
    out, res = ddp
    for r in res:
        assert r["killed"] is None and r["resumed"] == r["full"]
    full, resumed = read_log(out / "full" / "log.jsonl"), read_log(out / "killed" / "log.jsonl")
    for a, b in zip(full, resumed, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(("seconds", "peak_"))} == {
            k: v for k, v in b.items() if not k.startswith(("seconds", "peak_"))
        }
    assert run_reader.trainer_from_run(out / "full").evaluate() == res[0]["full"]["after"]
    assert cli.main(["eval", "--run", str(out / "full")]) == 0


def test_non_finite_loss_on_one_rank_stops_every_rank(ddp):
    _, res = ddp
    for rank, r in enumerate(res):
        assert (
            f"epoch 0, step 0 on rank(s) [1] (this is rank {rank})" in r["nan"] and "Hint: lower optim.lr" in r["nan"]
        )
    assert "total=nan" in res[1]["nan"] and "total=nan" not in res[0]["nan"]
