"""Evaluation during and after training: `train.eval_every`, `eval --split test`, TensorBoard scalars."""

import json

import pytest
import torch

from infosieve_fast import cli
from infosieve_fast.commands.predict import model_from_run
from infosieve_fast.config.settings import load_config
from infosieve_fast.data.reading.augment import AugmentConfig, DeviceAugment
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
from infosieve_fast.data.writing.shards import make_shards
from infosieve_fast.evaluation.metrics import evaluate_split
from infosieve_fast.training.run_folder import train
from tests.test_engine import SMOKE


@pytest.fixture(scope="module")
def shard_run(realdata, tmp_path_factory):
    """A 2-epoch run from real CIFAR-10 shards with a test split, evaluated every epoch, with TensorBoard."""
    base = tmp_path_factory.mktemp("evallog")
    for split, lo, hi in (("train", 0, 24), ("test", 24, 32)):
        for cls in ("airplane", "automobile", "bird", "cat"):
            (base / "raw" / split / cls).mkdir(parents=True)
            for src in sorted((realdata / "cifar10_test" / "test" / cls).glob("*.jpg"))[lo:hi]:
                (base / "raw" / split / cls / src.name).symlink_to(src)
    make_shards("imagefolder", base / "raw", base / "shards", resize=40, known_classes=[0, 1], progress=False)
    cfg = load_config(
        "configs/demo.yaml",
        SMOKE[:1]
        + SMOKE[2:]
        + [
            "data.source=shards",
            f"data.shards={base / 'shards'}",
            "data.batch_size=32",
            "data.num_workers=0",
            "model.backbone_kwargs={in_chans: 3}",
            "data.mean=[0.5, 0.5, 0.5]",
            "data.std=[0.25, 0.25, 0.25]",
            "train.eval_every=1",
            "train.tensorboard=true",
        ],
    )
    metrics = train(cfg, base / "run")
    return base, cfg, metrics


def test_eval_every_logs_train_and_test_accuracy(shard_run):
    base, _, metrics = shard_run
    log = [json.loads(line) for line in (base / "run" / "log.jsonl").read_text().splitlines()]
    assert all(set(r["eval"]) == set(r["eval_test"]) == {"all", "old", "new"} for r in log)
    assert log[-1]["eval"] == metrics["after"]  # the same model, the same deterministic evaluation


def test_eval_on_the_test_split_is_the_nearest_final_centre(shard_run, capsys):
    base, cfg, _ = shard_run
    assert cli.main(["eval", "--run", str(base / "run"), "--split", "test"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("last (test)"))
    printed = [float(v) for v in line.split()[-3:]]
    model, state = model_from_run(base / "run", torch.device("cpu"))
    test = ShardSource(base / "shards", ReadOptions(split="test", num_workers=0))
    aug = DeviceAugment(AugmentConfig(cfg.data.crop_size, False, tuple(cfg.data.mean), tuple(cfg.data.std)))
    ys, ps = [], []
    with torch.no_grad():
        for b in test.feature_batches(64):
            feats = model.features(aug.test_view(b.images, b.sizes))
            ps.append(torch.cdist(feats, state["centers"]).argmin(1))
            ys.append(b.targets)
    y, p = torch.cat(ys), torch.cat(ps)
    assert len(y) == 32
    want = evaluate_split(y, p, y < 2, "v2")
    assert printed == pytest.approx([want["all"], want["old"], want["new"]], abs=5e-5)


def test_tensorboard_holds_the_log(shard_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    base, _, _ = shard_run
    log = [json.loads(line) for line in (base / "run" / "log.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(base / "run" / "tensorboard"))
    acc.Reload()
    for key, pick in (
        ("loss_total", lambda r: r["loss_total"]),
        ("lr", lambda r: r["lr"]),
        ("eval_test/all", lambda r: r["eval_test"]["all"]),
    ):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2]
        assert [e.value for e in events] == pytest.approx([pick(r) for r in log], rel=1e-6)


def test_tensorboard_without_the_package_is_refused_at_config_load(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ValueError, match="pip install tensorboard"):
        load_config("configs/demo.yaml", ["train.tensorboard=true"])
