"""`method:` wired through the engine: the config's method sections, the model each method gets (labeller, projection,
heads), the optimiser's groups, and one training step of the Trainer against the published step transcribed in
`benchmarks/published/` on the same model outputs (the method modules themselves are tested in test_methods_*.py)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from PIL import Image

from benchmarks.published.gcd import gcd_loss
from benchmarks.published.simgcd import DistillLoss, simgcd_loss
from infosieve_fast import cli
from infosieve_fast.commands.predict import model_from_run
from infosieve_fast.common.files import read_log
from infosieve_fast.config.settings import ConfigError, load_config
from infosieve_fast.methods import METHODS
from infosieve_fast.methods.simgcd import HEAD
from infosieve_fast.training.checkpoint import load_checkpoint
from infosieve_fast.training.engine import Trainer
from infosieve_fast.training.run_folder import train
from infosieve_fast.training.step_graph import StepInputs
from tests.methods_helpers import assert_close
from tests.test_engine import SMOKE

TINY = [*SMOKE, "train.device=cpu", "train.train_subset=128", "data.batch_size=32"]


def tiny(method: str, *extra: str):
    return load_config("configs/demo.yaml", [*TINY, f"method={method}", *extra])


def test_every_method_is_a_config_choice_and_a_section_of_another_method_is_refused():
    from infosieve_fast.config.checks import CHOICES

    assert CHOICES["method"] == tuple(METHODS)
    assert load_config(None).method == "infosieve"
    assert load_config(None, ["method=gcd", "gcd.sup_con_weight=0.5"]).gcd.sup_con_weight == 0.5
    with pytest.raises(ConfigError, match=r"^simgcd.memax_weight is a setting of method simgcd, .* method gcd"):
        load_config(None, ["method=gcd", "simgcd.memax_weight=4"])
    with pytest.raises(ConfigError, match=r"^selex.smoothing is a setting of method selex, .* method infosieve"):
        load_config(None, ["selex.smoothing=0.5"])
    with pytest.raises(ConfigError, match=r"^method must be one of"):
        load_config(None, ["method=simclr"])


def test_each_method_gets_its_own_model_and_optimiser_groups():
    gcd, simgcd = Trainer(tiny("gcd")), Trainer(tiny("simgcd"))
    cfg = gcd.cfg.model
    assert gcd.model.labeller is None and simgcd.model.labeller is None
    assert not any(k.startswith(("labeller.", "method_heads.")) for k in gcd.model.state_dict())
    # GCD projects through the whole DINOHead; SimGCD's projection is its MLP's bottleneck output, and its prototypes
    # (one per class: the digits' 10) are part of the model, so they are saved and optimised
    assert gcd.model.projection.last_layer is not None and simgcd.model.projection.last_layer is None
    keys = simgcd.model.state_dict()
    assert keys["method_heads.prototypes.last_layer.weight_v"].shape == (10, gcd.model.backbone.feat_dim)
    assert not any(k.startswith("projection.last_layer") for k in keys)
    with torch.no_grad():
        out = simgcd.model(torch.zeros(4, 1, 32, 32))
    assert out.projection.shape == (4, cfg.proj_bottleneck_dim) and out.heads[HEAD].shape == (4, 10)
    assert out.head is None and out.code_feat is None
    optimised = {id(p) for g in simgcd.optimizer.param_groups for p in g["params"]}
    assert id(simgcd.model.method_heads[HEAD].last_layer.weight_v) in optimised
    # SimGCD's published groups: biases and 1-D parameters without weight decay, every other one with it
    names = {id(p): n for n, p in simgcd.model.named_parameters()}
    for group in simgcd.optimizer.param_groups:
        free = [names[id(p)].endswith(".bias") or p.dim() == 1 for p in group["params"]]
        assert all(free) if group["weight_decay"] == 0 else not any(free)
    assert {g["weight_decay"] for g in simgcd.optimizer.param_groups} == {0.0, simgcd.cfg.optim.weight_decay}
    assert {g["weight_decay"] for g in gcd.optimizer.param_groups} == {gcd.cfg.optim.weight_decay}


def _one_step(trainer: Trainer, epoch: int):
    """The trainer's step on its first batch, and (before it) the model's output on the same views."""
    trainer.method.set_epoch(epoch)
    batch = next(iter(trainer.source.train_batches(trainer.cfg.data.batch_size, epoch, trainer.cfg.train.seed)))
    views = trainer.augment.train_views(batch.images, 2, torch.Generator().manual_seed(0), batch.sizes)
    unlabelled = torch.full((trainer.source.n_train,), -1, dtype=torch.long)
    inputs = StepInputs(views, batch.targets, batch.labelled, unlabelled[batch.uq])
    before = copy.deepcopy(trainer.model)  # train mode: the same batch statistics as the step's forward
    out = before(views)
    parts = trainer._step(inputs)
    return out, batch, parts


def test_gcd_step_is_the_published_step_on_the_models_outputs():
    trainer = Trainer(tiny("gcd", "gcd.sup_con_weight=0.4"))
    out, batch, parts = _one_step(trainer, 0)
    assert set(parts) == {"total", "infonce", "supcon"}
    total, want = gcd_loss(out.projection, batch.targets, batch.labelled, sup_con_weight=0.4)
    assert_close(parts["total"], total, 1e-5, "total")
    for name in ("infonce", "supcon"):
        assert_close(parts[name], want[name], 1e-5, name)


@pytest.mark.parametrize("epoch", [0, 7])
def test_simgcd_step_is_the_published_step_on_the_models_outputs(epoch):
    trainer = Trainer(tiny("simgcd", "simgcd.memax_weight=1.0", f"schedule.epochs={epoch + 1}"))
    out, batch, parts = _one_step(trainer, epoch)
    criterion = DistillLoss(30, 30)  # the published schedule (its table needs epochs >= the 30 warm-up epochs)
    logits = out.heads[HEAD]
    total, want = simgcd_loss(out.projection, logits, batch.targets, batch.labelled, epoch, criterion, memax_weight=1.0)
    assert_close(parts["total"], total, 1e-5, "total")
    for name in ("cls", "cluster", "distill", "memax", "infonce", "supcon"):
        assert_close(parts[name], want[name], 1e-5, name)


def test_simgcd_evaluation_scores_the_argmax_of_its_prototypes():
    trainer = Trainer(tiny("simgcd"))
    model = copy.deepcopy(trainer.model).eval()  # as the feature pass runs it
    with torch.no_grad():
        feats = model.backbone(trainer.augment.test_view(trainer.source.images))
        # an untrained network puts every image on one prototype: prototype c is one image's feature instead
        picks = torch.stack([(trainer.source.targets == c).nonzero()[0, 0] for c in range(10)])
        trainer.model.method_heads[HEAD].last_layer.weight_v.copy_(feats[picks])
        logits = trainer.model.method_heads[HEAD](feats)
    ev = trainer.evaluate_full()
    assert torch.equal(ev.clustering.labels, logits.argmax(1))
    assert torch.equal(logits.argmax(1)[picks], torch.arange(10))  # each picked image on its own prototype
    fs = trainer.evaluator.features("test")
    assert trainer.evaluator.k.value == 10 and ev.clustering.centers.shape == (10, trainer.model.backbone.feat_dim)
    unl = ~fs.labelled
    assert ev.metrics == trainer.evaluator.score(fs.targets[unl], logits.argmax(1)[unl])


@pytest.mark.parametrize("method", ["gcd", "simgcd"])
def test_a_short_run_trains_resumes_evaluates_predicts_and_reports(method, tmp_path, capsys):
    cfg = tiny(method, "schedule.epochs=2", "train.max_steps_per_epoch=2")
    fresh = Trainer(cfg)  # the untrained weights, the images and the test view
    full = train(cfg, tmp_path / "full")
    run = tmp_path / "full"
    printed = capsys.readouterr().out
    next_steps = printed.split("next:")[1]
    assert "infosieve eval --run" in next_steps and "infosieve tree" not in next_steps  # a run without codes
    assert "the cluster gallery" in next_steps and "the tree" not in next_steps
    assert "epoch 1/2  loss " in printed and " age " not in printed  # the labeller's schedule: InfoSieve's alone
    log = read_log(run / "log.jsonl")
    terms = {"gcd": {"infonce", "supcon"}, "simgcd": {"cls", "cluster", "distill", "memax", "infonce", "supcon"}}
    assert {k.removeprefix("loss_") for k in log[0] if k.startswith("loss_")} == {"total", *terms[method]}
    assert all(r["kmeans_inertia"] is None and r["seconds_kmeans"] == 0 for r in log)  # no clustering in training
    state = load_checkpoint(run)
    untrained = fresh.model.state_dict()
    assert any(not torch.equal(v, untrained[k]) for k, v in state["model"].items() if v.is_floating_point())

    killed = tmp_path / "killed"
    assert train(cfg, killed, stop_after=lambda epoch: epoch == 0) is None
    assert train(load_config(killed / "config.yaml"), killed, resume=True) == full
    strip = [{k: v for k, v in r.items() if not k.startswith(("seconds", "peak_"))} for r in log]
    assert [
        {k: v for k, v in r.items() if not k.startswith(("seconds", "peak_"))} for r in read_log(killed / "log.jsonl")
    ] == strip

    capsys.readouterr()
    assert cli.main(["eval", "--run", str(run)]) == 0
    assert f"{full['after']['all']:.4f}" in capsys.readouterr().out
    assert cli.main(["tree", "--run", str(run)]) == 2
    assert "learns no codes" in capsys.readouterr().err

    images = tmp_path / "images"
    images.mkdir()
    source = fresh.source
    for uq in range(16):
        Image.fromarray(source.images[uq, 0].numpy()).save(images / f"{uq:04d}.png")
    out = tmp_path / "pred.jsonl"
    assert cli.main(["predict", "--run", str(run), "--images", str(images), "--out", str(out), "--device", "cpu"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    model, state = model_from_run(run, torch.device("cpu"))
    with torch.no_grad():
        x = fresh.augment.test_view(source.images[:16])
        want = torch.cdist(model.features(x), state["centers"]).argmin(1)
        if method == "simgcd":  # the centres are the prototypes: the nearest is the head's argmax
            assert torch.equal(want, model.method_heads[HEAD](model.backbone(x)).argmax(1))
    assert [r["cluster"] for r in records] == want.tolist()
    assert all(r["code"] == r["prefix"] == "" and r["tree_path"] == [] for r in records)
    capsys.readouterr()
    assert cli.main(["report", "--run", str(run)]) == 0
    assert (run / "report.html").is_file()
    assert "infosieve tree" not in capsys.readouterr().out  # no tree to ask for: the method learns no codes


def test_a_head_that_predicts_needs_the_number_of_classes_before_training():
    with pytest.raises(ConfigError, match=r"^method=simgcd predicts with a head .* kmeans.n_clusters=auto") as err:
        Trainer(tiny("simgcd", "kmeans.n_clusters=auto"))
    assert "\n" not in str(err.value)
    assert Trainer(tiny("simgcd", "kmeans.n_clusters=12")).model.method_heads[HEAD].last_layer.weight_v.shape[0] == 12
