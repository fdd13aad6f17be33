"""checkpoint.best (issue 22, item 4): the checkpoint you report, chosen without a label of an unlabelled image.

The issue's test: permute the labels of the unlabelled images in the data; the chosen epoch and value (and the kept
weights) must not change, while the All/Old/New the run reports, which do read those labels, do."""

import functools
import json
import shutil
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from infosieve_fast import cli
from infosieve_fast.analysis.run_reader import trainer_from_run
from infosieve_fast.common.files import read_log
from infosieve_fast.config.settings import load_config
from infosieve_fast.data import InMemoryGCD, build_source
from infosieve_fast.data.reading.augment import AugmentConfig, DeviceAugment
from infosieve_fast.evaluation.evaluator import Evaluator
from infosieve_fast.training import run_folder
from infosieve_fast.training.best_checkpoint import (
    BestCheckpoint,
    holdout_accuracy,
    images_held_out_for_selection,
    kmeans_objective,
)
from infosieve_fast.training.checkpoint import load_checkpoint
from infosieve_fast.training.engine import FeatureSet, Trainer
from infosieve_fast.training.run_files import BEST_CHECKPOINT, read_best
from infosieve_fast.training.run_folder import train
from tests.test_engine import smoke_config
from tests.test_engine_ddp import DDP_SMOKE
from tests.test_kmeans_distributed import _free_port

EPOCHS = 3
HOLDOUT = ("checkpoint.best=labelled_holdout", f"schedule.epochs={EPOCHS}")


def digits(cfg, permute_unlabelled: bool = False) -> InMemoryGCD:
    """The smoke run's train set; with `permute_unlabelled`, the unlabelled images' labels shuffled among them."""
    source = build_source(cfg.data, cfg.train)
    targets = source.targets.clone()
    if permute_unlabelled:
        unl = (~source.labelled).nonzero().squeeze(1)
        targets[unl] = targets[unl][torch.randperm(len(unl), generator=torch.Generator().manual_seed(0))]
        assert (targets != source.targets).float().mean() > 0.5 and torch.equal(
            targets[source.labelled], source.targets[source.labelled]
        )
    return InMemoryGCD(source.images, targets, source.labelled, source.n_old, source.labelled_share)


def criterion_values(run, name: str) -> list[float]:
    return [r[f"criterion_{name}"] for r in read_log(run / "log.jsonl")]


def models_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def holdout_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("best") / "run"
    train(smoke_config(*HOLDOUT), run)
    return run


def test_the_best_is_the_logs_best_epoch_and_its_weights_score_it(holdout_run):
    values = criterion_values(holdout_run, "labelled_holdout")
    assert len(values) == EPOCHS and all(0.0 <= v <= 1.0 for v in values)
    first_max = int(np.argmax(values))  # ties keep the earlier epoch
    best = read_best(holdout_run)
    assert best == {"criterion": "labelled_holdout", "epoch": first_max + 1, "value": values[first_max],
                    "higher_is_better": True}  # fmt: skip
    kept = load_checkpoint(holdout_run, name=BEST_CHECKPOINT)
    assert kept["epoch"] == best["epoch"] and kept["best"] == best and "optimizer" not in kept
    assert load_checkpoint(holdout_run)["best"] == best  # the last checkpoint carries it for a resume
    trainer = trainer_from_run(holdout_run, "best")  # the kept weights give the recorded value again
    assert BestCheckpoint(trainer.cfg.checkpoint, trainer.source).score(trainer.evaluator) == best["value"]


def test_the_choice_never_reads_a_label_of_an_unlabelled_image(holdout_run, tmp_path):
    cfg = smoke_config(*HOLDOUT)
    permuted = tmp_path / "permuted"
    train(cfg, permuted, source=digits(cfg, permute_unlabelled=True))
    assert read_best(permuted) == read_best(holdout_run)
    assert criterion_values(permuted, "labelled_holdout") == criterion_values(holdout_run, "labelled_holdout")
    kept = [load_checkpoint(run, name=BEST_CHECKPOINT)["model"] for run in (permuted, holdout_run)]
    assert models_equal(*kept)
    # the permutation is real: what the run reports reads those labels, and changes
    metrics = [json.loads((run / "metrics.json").read_text()) for run in (permuted, holdout_run)]
    assert metrics[0]["before"] != metrics[1]["before"]


def test_a_run_killed_and_resumed_keeps_the_same_best(holdout_run, tmp_path):
    """Killed right after the checkpoint of the epoch that ends up best, before its best files were written: the
    resume restores them from the checkpoint, and no later epoch replaces them, as in the uninterrupted run."""
    cfg = smoke_config(*HOLDOUT)
    best = read_best(holdout_run)
    run = tmp_path / "run"
    assert train(cfg, run, stop_after=lambda epoch: epoch + 1 == best["epoch"]) is None
    assert read_best(run) == best
    (run / "best.json").unlink()
    (run / BEST_CHECKPOINT).unlink()
    train(cfg, run, resume=True)
    assert read_best(run) == best
    assert criterion_values(run, "labelled_holdout") == criterion_values(holdout_run, "labelled_holdout")
    assert models_equal(*(load_checkpoint(r, name=BEST_CHECKPOINT)["model"] for r in (run, holdout_run)))


def test_held_out_images_take_no_part_in_the_supervised_training(monkeypatch):
    cfg = smoke_config("checkpoint.best=labelled_holdout", "train.max_steps_per_epoch=3")
    trainer = Trainer(cfg)
    source, labelled = trainer.source, trainer.source.labelled
    held = trainer.best.holdout
    assert int(held.sum()) == round(0.1 * int(labelled.sum())) and not bool((held & ~labelled).any())
    assert torch.equal(held, images_held_out_for_selection(source, 0.1, 0))
    assert not torch.equal(held, images_held_out_for_selection(source, 0.1, 1))

    steps, clustered = [], []
    train_step, cluster = trainer.train_step, trainer.evaluator.cluster
    monkeypatch.setattr(trainer, "train_step", lambda batch, *a: steps.append(batch) or train_step(batch, *a))
    record_labelled = lambda fs, **kw: clustered.append(fs.labelled.clone()) or cluster(fs, **kw)  # noqa: E731
    monkeypatch.setattr(trainer.evaluator, "cluster", record_labelled)
    trainer.train_epoch(0)
    assert len(steps) == 3 and len(clustered) == 1
    drawn = torch.cat([b.uq for b in steps])
    assert bool(held[drawn].any())  # held-out images were drawn, as unlabelled ones
    assert not any(bool((b.labelled & held[b.uq]).any()) for b in steps)
    assert all(torch.equal(b.labelled, labelled[b.uq] & ~held[b.uq]) for b in steps)
    assert torch.equal(clustered[0], labelled & ~held)  # no labelled anchor in the pseudo-label k-means
    assert trainer.source is source and trainer.evaluator.source is source  # evaluations see the labels as they are
    assert torch.equal(torch.cat([b.labelled for b in source.feature_batches(512)]), labelled)
    assert torch.equal(trainer.evaluator.features("test").labelled, labelled)


def fake_trainer(n: int, *overrides: str) -> SimpleNamespace:
    """What the criteria use of an Evaluator: its k-means config and seed and its tables by uq (one process)."""
    cfg = smoke_config(*overrides)
    fake = SimpleNamespace(kmeans=cfg.kmeans, seed=cfg.train.seed, source=SimpleNamespace(n_train=n))
    fake.gather_table = functools.partial(Evaluator.gather_table, fake)
    return fake


def test_holdout_accuracy_of_a_hand_made_case():
    """Three tight clusters A, B, C (uq 0-3, 4-7, 8-11). Held out: uq 1, 2 (class 0, in A), 3 (class 1, but in A) and
    5 (class 1, in B). The best map sends A to 0 and B to 1: 3 of the 4 held-out images are right."""
    centres = torch.eye(3)
    offsets = torch.tensor([[0.01, 0, 0], [0, 0.01, 0], [0, 0, 0.01], [-0.01, 0, 0]])
    feats = torch.cat([c + offsets for c in centres])
    targets = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 7, 9, 8, 6])  # uq 8-11: unlabelled, labels never to be read
    labelled = torch.tensor([True] * 8 + [False] * 4)
    held = torch.zeros(12, dtype=torch.bool)
    held[[1, 2, 3, 5]] = True
    trainer = fake_trainer(12)
    uq = torch.arange(12)
    values = []
    for order in ([8, 9, 10, 11], [11, 10, 9, 8], [9, 8, 11, 10]):  # the unlabelled labels permuted
        y = targets.clone()
        y[8:] = targets[order]
        values.append(holdout_accuracy(trainer, FeatureSet(feats, y, labelled, uq, uq), 3, held))
    assert values == [0.75, 0.75, 0.75]


def test_kmeans_objective_of_a_hand_made_case():
    """Two pairs 2 apart, far from each other: k-means with K=2 leaves each point 1 from its centre, inertia 4."""
    feats = torch.tensor([[0.0, 0.0], [0.0, 2.0], [10.0, 0.0], [10.0, 2.0]])
    uq = torch.arange(4)
    fs = FeatureSet(feats, torch.tensor([0, 1, 2, 3]), torch.zeros(4, dtype=torch.bool), uq, uq)
    assert kmeans_objective(fake_trainer(4), fs, 2) == pytest.approx(4.0, rel=1e-6)


def test_kmeans_objective_keeps_the_lowest_and_reads_no_label(tmp_path):
    cfg = smoke_config("checkpoint.best=kmeans_objective")  # two epochs
    train(cfg, tmp_path / "run")
    values = criterion_values(tmp_path / "run", "kmeans_objective")
    first_min = int(np.argmin(values))
    assert read_best(tmp_path / "run") == {"criterion": "kmeans_objective", "epoch": first_min + 1,
                                           "value": values[first_min], "higher_is_better": False}  # fmt: skip
    # training never reads those labels (the labelled_holdout runs above show it); the score does not either
    scores = []
    for permute in (False, True):
        trainer = Trainer(cfg, digits(cfg, permute_unlabelled=permute))
        scores.append(BestCheckpoint(trainer.cfg.checkpoint, trainer.source).score(trainer.evaluator))
    assert scores[0] == scores[1]


def test_eval_and_report_say_which_checkpoint_they_read(holdout_run, tmp_path, capsys):
    best = read_best(holdout_run)
    said = f"best (labelled_holdout, epoch {best['epoch']})"
    assert cli.main(["eval", "--run", str(holdout_run), "--checkpoint", "best"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"checkpoint: {said}\n") and "best (train)" in out
    assert cli.main(["eval", "--run", str(holdout_run)]) == 0
    assert capsys.readouterr().out.startswith(f"checkpoint: last, epoch {EPOCHS}\n")

    run = tmp_path / "run"
    shutil.copytree(holdout_run, run)
    assert cli.main(["report", "--run", str(run), "--checkpoint", "best"]) == 0
    page = (run / "report.html").read_text()
    assert f"checkpoint: <b>{said}</b>" in page and f"<td>{said}</td>" in page
    assert page.count("data:image/png;base64,") == 5  # the best's confusion matrix and tree, computed
    assert cli.main(["report", "--run", str(run)]) == 0
    assert f"checkpoint: <b>last, epoch {EPOCHS}</b>" in (run / "report.html").read_text()


def test_tree_reads_the_best_into_its_own_file_as_a_folder_whose_last_it_is_would(holdout_run, tmp_path, capsys):
    run, as_last = tmp_path / "run", tmp_path / "as_last"
    shutil.copytree(holdout_run, run)
    as_last.mkdir()
    shutil.copy(holdout_run / BEST_CHECKPOINT, as_last / "checkpoint.pt")
    (run / "tree.json").write_text("the last checkpoint's tree")
    assert cli.main(["tree", "--run", str(run), "--checkpoint", "best"]) == 0
    said = f"best (labelled_holdout, epoch {read_best(holdout_run)['epoch']})"
    assert capsys.readouterr().out.startswith(f"checkpoint: {said}\n")
    assert (run / "tree.json").read_text() == "the last checkpoint's tree"  # not overwritten
    tree = json.loads((run / "tree-best.json").read_text())
    assert cli.main(["tree", "--run", str(as_last), "--json", str(tmp_path / "t.json")]) == 0
    same = json.loads((tmp_path / "t.json").read_text())
    assert tree.pop("checkpoint") == said and same.pop("checkpoint").startswith("last, epoch")
    assert tree == same


def test_predict_with_the_best_assigns_to_its_weights_clustering(holdout_run, tmp_path, capsys):
    cfg = load_config(holdout_run / "config.yaml")
    images = build_source(cfg.data, cfg.train).images[:24]
    (tmp_path / "images").mkdir()
    for i, image in enumerate(images):
        Image.fromarray(image[0].numpy()).save(tmp_path / "images" / f"{i:02d}.png")
    out = tmp_path / "pred.jsonl"
    assert cli.main(["predict", "--run", str(holdout_run), "--images", str(tmp_path / "images"), "--out", str(out),
                     "--device", "cpu", "--checkpoint", "best"]) == 0  # fmt: skip
    assert f"checkpoint: best (labelled_holdout, epoch {read_best(holdout_run)['epoch']})" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    best = trainer_from_run(holdout_run, "best")  # independently: its weights, its train clustering, nearest centre
    centers = best.evaluate_full().clustering.centers
    aug = DeviceAugment(AugmentConfig(cfg.data.crop_size, False, tuple(cfg.data.mean), tuple(cfg.data.std)))
    with torch.no_grad():
        feats = best.model.eval().features(aug.test_view(images))
    assert [r["cluster"] for r in records] == torch.cdist(feats, centers).argmin(1).tolist()


def test_misuse_is_refused_with_the_way_out(holdout_run, tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(holdout_run / "checkpoint.pt", plain / "checkpoint.pt")  # a run that keeps no best
    assert cli.main(["eval", "--run", str(plain), "--checkpoint", "best"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no {BEST_CHECKPOINT} in {plain}") and "--set checkpoint.best=" in err

    run = tmp_path / "run"
    shutil.copytree(holdout_run, run)
    assert cli.main(["train", "--resume", str(run), "--set", "checkpoint.best=kmeans_objective"]) == 2
    assert capsys.readouterr().err.startswith("error: --set checkpoint.best on resume")

    few = SimpleNamespace(labelled=np.array([True, True, False, True]), n_train=4)
    with pytest.raises(ValueError, match=r"checkpoint.holdout_fraction=0.9 holds out 3 of the 3 labelled images"):
        images_held_out_for_selection(few, 0.9, 0)


def _ddp_worker(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: a run with checkpoint.best=labelled_holdout; saves the values this rank scored."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))  # fmt: skip
    torch.set_num_threads(1)
    try:
        scored, judge = [], BestCheckpoint.judge

        def spy(self, trainer, record):
            judge(self, trainer, record)
            scored.append(record["criterion_labelled_holdout"])

        BestCheckpoint.judge = spy
        cfg = load_config("configs/demo.yaml", [*DDP_SMOKE, "checkpoint.best=labelled_holdout"])
        run_folder.train(cfg, Path(out) / "run")
        torch.save(scored, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_under_ddp_every_rank_scores_alike_and_one_process_agrees(tmp_path):
    """The criterion's k-means runs on the ranks' shares together and its labels are gathered by sample: both ranks
    get the value rank 0 logs, and one process scoring the kept weights gets it too."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(_ddp_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail("the two-process run did not finish within 240 s (a hang between ranks?)")
    run = tmp_path / "run"
    scored = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert scored[0] == scored[1] == criterion_values(run, "labelled_holdout") and len(scored[0]) == 2
    best = read_best(run)
    assert best["value"] == max(scored[0])
    trainer = trainer_from_run(run, "best")
    assert BestCheckpoint(trainer.cfg.checkpoint, trainer.source).score(trainer.evaluator) == best["value"]
