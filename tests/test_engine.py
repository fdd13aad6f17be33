"""End to end on the embedded digits: a short run writes its folder, resumes bit-for-bit, and evaluates."""

import json

import pytest
import torch
import torch.nn.functional as F

from infosieve_fast import cli
from infosieve_fast.common.files import read_log
from infosieve_fast.config.settings import load_config
from infosieve_fast.data.reading.base import Batch
from infosieve_fast.methods.selex_hierarchy import level_sizes
from infosieve_fast.network.model import Backbone
from infosieve_fast.training.checkpoint import load_checkpoint, restore_rng_state, rng_state, save_checkpoint
from infosieve_fast.training.engine import Trainer
from infosieve_fast.training.loss_monitor import LossMonitor, NonFiniteLoss
from infosieve_fast.training.run_folder import train

SMOKE = [
    "schedule.epochs=2", "train.train_subset=320", "data.batch_size=64",
    "kmeans.n_init=2", "model.proj_out_dim=256", "model.proj_hidden_dim=128", "model.proj_bottleneck_dim=64",
]  # fmt: skip


def smoke_config(*extra):
    return load_config("configs/demo.yaml", [*SMOKE, "train.device=cpu", *extra])


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_two_epoch_demo_run_writes_its_folder_and_resume_reproduces_it(tmp_path, device):
    def smoke_config(*extra):  # this device's run, killed and resumed on the same device
        return load_config("configs/demo.yaml", [*SMOKE, f"train.device={device}", *extra])

    full = train(smoke_config(), tmp_path / "full")
    run = tmp_path / "full"
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "log.jsonl", "checkpoint.pt", "metrics.json"}
    assert load_config(run / "config.yaml") == smoke_config()
    log = read_log(run / "log.jsonl")
    assert [r["epoch"] for r in log] == [0, 1]
    for key in ("loss_total", "loss_in", "loss_code", "loss_length", "loss_category", "lr", "age", "base",
                "kmeans_inertia", "seconds", "seconds_features", "seconds_kmeans", "seconds_steps"):  # fmt: skip
        assert key in log[0], key
    assert log[1]["age"] == pytest.approx(20.0) and log[0]["base"] == pytest.approx(2.0)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics == full and metrics["protocol"] == "v2"
    for stage in ("before", "after"):
        assert set(metrics[stage]) == {"all", "old", "new"} and 0 <= metrics[stage]["all"] <= 1

    killed = tmp_path / "killed"
    assert train(smoke_config(), killed, stop_after=lambda epoch: epoch == 0) is None
    assert [r["epoch"] for r in read_log(killed / "log.jsonl")] == [0]
    assert torch.load(killed / "checkpoint.pt", weights_only=True)["epoch"] == 1
    resumed = train(load_config(killed / "config.yaml"), killed, resume=True)
    resumed_log = read_log(killed / "log.jsonl")
    for a, b in zip(log, resumed_log, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(("seconds", "peak_"))} == {
            k: v for k, v in b.items() if not k.startswith(("seconds", "peak_"))
        }
    assert resumed == full
    log_before = (killed / "log.jsonl").read_text()
    assert train(load_config(killed / "config.yaml"), killed, resume=True) == full  # finished: nothing reruns
    assert (killed / "log.jsonl").read_text() == log_before

    assert cli.main(["eval", "--run", str(run)]) == 0
    assert cli.main(["tree", "--run", str(run), "--depth", "3"]) == 0
    tree = json.loads((run / "tree.json").read_text())
    assert tree["n"] == 320 and sum(tree["classes"].values()) == 320  # every train sample sits at the root
    assert sum(c["n"] for c in tree["children"]) + tree["ends"] == 320  # and in exactly one child or ends there


def test_refuses_to_overwrite_a_run_folder(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="is not empty"):
        train(smoke_config(), tmp_path / "run")


class NaNInTraining(torch.nn.Module):
    """Finite features for the feature pass (eval mode), NaN once training starts."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32 * 32, 16)

    def forward(self, x):
        f = self.proj(x.flatten(1))
        return f * float("nan") if self.training else f


def test_non_finite_loss_stops_with_step_terms_and_hint(tmp_path):
    backbone = Backbone(NaNInTraining(), 16, grad_from_block=None)
    with pytest.raises(NonFiniteLoss, match=r"epoch 0, step 0: total=nan.*Hint: lower optim.lr"):
        train(smoke_config(), tmp_path / "nan", backbone=backbone)


def test_cli_reports_config_errors(tmp_path, capsys):
    assert (
        cli.main(["train", "--config", "configs/demo.yaml", "--set", "optim.lr=x", "--out", str(tmp_path / "r")]) == 2
    )
    assert "optim.lr must be float" in capsys.readouterr().err


def _cifar_shards(tmp_path, realdata):
    from infosieve_fast.data.writing.shards import make_shards

    raw = tmp_path / "raw"
    for cls in ("airplane", "automobile", "bird", "cat"):
        (raw / cls).mkdir(parents=True)
        for src in sorted((realdata / "cifar10_test" / "test" / cls).glob("*.jpg"))[:24]:
            (raw / cls / src.name).symlink_to(src)
    manifest = make_shards("imagefolder", raw, tmp_path / "shards", resize=40, known_classes=[0, 1], progress=False)
    assert (manifest["n_old"], manifest["n_classes"]) == (2, 4)
    return load_config(
        "configs/demo.yaml",
        SMOKE[:1] + SMOKE[2:] + [
            "data.source=shards", f"data.shards={tmp_path / 'shards'}", "data.batch_size=32", "data.num_workers=0",
            "model.backbone_kwargs={in_chans: 3}", "data.mean=[0.5, 0.5, 0.5]", "data.std=[0.25, 0.25, 0.25]",
        ],
    )  # fmt: skip


def test_training_runs_from_shards(tmp_path, realdata):
    metrics = train(_cifar_shards(tmp_path, realdata), tmp_path / "run")
    log = read_log(tmp_path / "run" / "log.jsonl")
    assert [r["steps"] for r in log] == [3, 3]  # 96 samples // 32
    assert [r["unreadable"] for r in log] == [0, 0] and not (tmp_path / "run" / "unreadable.json").exists()
    assert load_checkpoint(tmp_path / "run")["class_names"] == ["airplane", "automobile", "bird", "cat"]  # weights_only
    assert all(0 <= metrics[s]["all"] <= 1 for s in ("before", "after"))


@pytest.mark.parametrize("cache", ["off", "cpu"])
def test_an_unreadable_image_is_left_out_and_listed(tmp_path, realdata, cache):
    """A JPEG whose Huffman table is damaged: the run finishes without it, logs the count and lists it."""
    from infosieve_fast.data.reading.tar import index_shards

    cfg = _cifar_shards(tmp_path, realdata)
    shard = sorted((tmp_path / "shards").glob("*-train-*.tar"))[0]
    index, _ = index_shards([str(shard)])
    data = bytearray(shard.read_bytes())
    a, n = int(index.offset[5]), int(index.length[5])
    dht = data.find(b"\xff\xc4", a, a + n)
    data[dht + 4 : dht + 40] = b"\xff" * 36
    shard.write_bytes(bytes(data))
    cfg.data.cache = cache
    metrics = train(cfg, tmp_path / "run")
    log = read_log(tmp_path / "run" / "log.jsonl")
    assert [r["steps"] for r in log] == [2, 2]  # 95 readable samples // 32
    assert [r["unreadable"] for r in log] == [1, 1]
    listed = json.loads((tmp_path / "run" / "unreadable.json").read_text())
    assert listed == {"count": 1, "samples": [{"uq": int(index.uq[5]), "shard": shard.name, "offset": a}]}
    assert all(0 <= metrics[s]["all"] <= 1 for s in ("before", "after"))


def test_rng_state_stays_on_the_cpu_whatever_the_map_location(tmp_path):
    """A CUDA resume loads the checkpoint with map_location=cuda, which moves every tensor; torch.set_rng_state takes
    only a CPU ByteTensor. The state is saved as bytes, which no map_location moves ("meta" stands in for a GPU)."""
    torch.manual_seed(123)
    saved = torch.get_rng_state()
    save_checkpoint(tmp_path, {"torch_rng": rng_state(), "weight": torch.ones(3)})
    expected = torch.rand(5)
    state = load_checkpoint(tmp_path, map_location="meta")
    assert state["weight"].device.type == "meta"  # map_location did move the tensors
    torch.manual_seed(0)
    restore_rng_state(state["torch_rng"])
    assert torch.equal(torch.get_rng_state(), saved) and torch.equal(torch.rand(5), expected)


def test_loss_monitor_reports_the_first_non_finite_step_with_its_terms():
    monitor = LossMonitor(epoch=3)
    for total in (1.0, 2.0, float("inf"), float("nan"), 5.0):
        monitor.record({"total": torch.tensor(total), "in": torch.tensor(total / 2)})
    with pytest.raises(NonFiniteLoss, match=r"epoch 3, step 2: total=inf, in=inf"):
        monitor.check()
    healthy = LossMonitor(epoch=0)
    for total in (1.0, 2.0, 6.0):
        healthy.record({"total": torch.tensor(total), "in": torch.tensor(total / 2)})
    assert healthy.check() == 6.0 and healthy.means() == {"total": 3.0, "in": 1.5}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-sync detection needs CUDA")
@pytest.mark.parametrize("sized", [False, True], ids=["one_size", "different_sizes"])
def test_a_training_step_never_waits_for_the_gpu(sized):
    """`different_sizes`: each image of a batch has its own size (`Batch.sizes`, on the host, as the shard stream and
    the decoded cache serve them; here sizes between the crop and the stored 36 px), so every crop is drawn inside its
    own image's size."""
    trainer = Trainer(load_config("configs/demo.yaml", [*SMOKE, "train.device=cuda"]))
    pseudo = torch.zeros(trainer.source.n_train, dtype=torch.long, device=trainer.device)
    gen = torch.Generator(device=trainer.device).manual_seed(0)
    monitor = LossMonitor(0)
    batches = trainer.source.train_batches(64, epoch=0, seed=0)
    if sized:
        crop, stored = trainer.cfg.data.crop_size, trainer.cfg.data.digits.image_size
        draws = torch.Generator().manual_seed(1)
        batches = (
            Batch(
                b.images, b.targets, b.uq, b.labelled, torch.randint(crop, stored + 1, (len(b.uq), 2), generator=draws)
            )
            for b in batches
        )
    third_step_without_waiting(trainer, batches, pseudo, gen, monitor)


def third_step_without_waiting(trainer: Trainer, batches, pseudo, gen, monitor: LossMonitor) -> None:
    """Two steps (kernel compilation and allocator growth outside the check), then a third under
    `set_sync_debug_mode("error")`, which raises if anything in it waits for the GPU; its loss is then read."""
    for batch in (next(batches), next(batches)):
        trainer.train_step(batch, pseudo, gen, monitor)
    batch = next(batches)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.train_step(batch, pseudo, gen, monitor)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert monitor.check() > 0 and monitor.steps == 3


def step_labels(trainer: Trainer) -> torch.Tensor:
    """The per-sample labels (by uq) a step of the trainer's method reads: a pseudo-label each, or (SelEx) one per
    level of a hierarchy of random unit centres set on the method, sized as `selex_hierarchy.level_sizes` halves the
    data's known and novel classes."""
    n, n_old, device = trainer.source.n_train, trainer.source.n_old, trainer.device
    gen = torch.Generator().manual_seed(0)
    if trainer.method.labels != "hierarchy":
        return torch.zeros(n, dtype=torch.long, device=device)
    sizes = [old + new for old, new in level_sizes(n_old, trainer.source.n_classes - n_old)]
    feat_dim = trainer.model.backbone.feat_dim
    trainer.method.set_hierarchy([F.normalize(torch.randn(k, feat_dim, generator=gen), dim=1) for k in sizes])
    return torch.stack([torch.randint(0, k, (n,), generator=gen) for k in sizes]).to(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-sync detection needs CUDA")
@pytest.mark.parametrize("method", ["gcd", "simgcd", "selex"])
def test_each_methods_step_runs_without_a_host_sync(method):
    """GCD's cosine terms, SimGCD's prototype cross-entropy, distillation and entropy, SelEx's confusion, soft-target
    InfoNCE and level SupCons (the fused kernels): the whole step, as `test_a_training_step_never_waits_for_the_gpu`
    checks InfoSieve's (gpu_check.sh's `methods-sync` step, run when named: the first calls compile the methods'
    kernels, which the `resume` step's limit has no room for)."""
    trainer = Trainer(load_config("configs/demo.yaml", [*SMOKE, "train.device=cuda", f"method={method}"]))
    trainer.method.set_epoch(0)
    pseudo = step_labels(trainer)
    gen = torch.Generator(device=trainer.device).manual_seed(0)
    batches = trainer.source.train_batches(64, epoch=0, seed=0)
    third_step_without_waiting(trainer, batches, pseudo, gen, LossMonitor(0))


def test_cli_errors_name_the_input_and_the_fix(tmp_path, capsys):
    assert cli.main(["train", "--resume", str(tmp_path / "nonexistent")]) == 2
    assert "no config.yaml there" in capsys.readouterr().err
    assert cli.main(["train", "--config", "configs/demo.yaml", "--out", str(tmp_path / "big"),
                     "--set", "data.batch_size=100000", "--set", "train.device=cpu"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "data.batch_size=100000" in err and "1797 train samples" in err and "lower data.batch_size" in err
    assert not (tmp_path / "big").exists()  # refused before any work or folder
    commands = "train | eval | tree | predict | report | name | export | estimate-k | make-shards"
    assert commands in " ".join(cli.build_parser().format_help().split())  # the help wraps its lines


def test_ctrl_c_ends_with_the_resume_command(tmp_path, monkeypatch, capsys):
    import infosieve_fast.training.run_folder as run_folder

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_folder, "train", interrupted)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--config", "configs/demo.yaml", "--out", str(tmp_path / "run")])
    assert exit_.value.code == 130  # the shell's status for Ctrl-C
    assert f"infosieve train --resume {tmp_path / 'run'}" in capsys.readouterr().err
