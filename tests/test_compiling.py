"""`train.compile`: on by default where it works (CUDA), eager on the CPU, and a failed compile falls back to eager
under `auto` (raised under `on`). torch.compile itself cannot run usefully here, so `nn.Module.compile` is replaced
by stand-ins that either fail at the first call (as an inductor error does) or count the calls."""

import pytest
import torch
from torch import nn

from infosieve_fast.compiling import compile_with_fallback, compiled_modules
from infosieve_fast.config import ConfigError, load_config
from infosieve_fast.engine import Trainer
from infosieve_fast.model import Backbone

FAKE_CUDA = torch.device("cuda")  # only the setting logic reads the device; the modules stay on the CPU
SMALL = [
    "train.device=cpu",
    "train.train_subset=64",
    "data.batch_size=16",
    "data.feature_batch_size=32",
    "kmeans.n_init=1",
    "model.proj_out_dim=64",
    "model.proj_hidden_dim=32",
    "model.proj_bottleneck_dim=16",
    "train.max_steps_per_epoch=1",
]


def small_config(*extra):
    return load_config("configs/demo.yaml", [*SMALL, *extra])


def batchnorm_trainer() -> Trainer:
    """A trainer whose backbone keeps running statistics (BatchNorm), so a forward in training mode changes a buffer."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return Trainer(small_config(), backbone=Backbone(net, 4, None))


def failing_compile(module, *args, **kwargs):
    def fail(*a, **k):
        raise RuntimeError("inductor: lowering failed\nsecond line")

    module._compiled_call_impl = fail


def counting_compile(calls: dict):
    def compile_(module, *args, **kwargs):
        def run(*a, **k):
            calls[id(module)] = calls.get(id(module), 0) + 1
            return module._call_impl(*a, **k)

        module._compiled_call_impl = run

    return compile_


def test_the_default_is_auto_and_yaml_booleans_read_as_on_and_off():
    assert small_config().train.compile == "auto"
    assert small_config("train.compile=true").train.compile == "on"
    assert small_config("train.compile=false").train.compile == "off"
    with pytest.raises(ConfigError, match=r"train.compile must be one of \('auto', 'on', 'off'\)"):
        small_config("train.compile=always")


def test_compile_on_the_cpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="train.compile=on needs CUDA.*set it auto or off"):
        Trainer(small_config("train.compile=on"))


def test_auto_on_the_cpu_trains_eager_and_the_first_epoch_says_so():
    trainer = Trainer(small_config())
    first, second = trainer.train_epoch(0), trainer.train_epoch(1)
    assert first["compile"] == second["compile"] == "eager"
    assert first["seconds_compile"] == second["seconds_compile"] == 0
    assert "CPU" in trainer.compiled.reason
    assert all(m._compiled_call_impl is None for m in compiled_modules(trainer.model))


def test_a_failed_compile_under_auto_runs_eager_and_gives_the_same_outputs(monkeypatch, capsys):
    trainer = batchnorm_trainer()
    x = torch.rand(4, 3, 8, 8)
    trainer.model.eval()
    expected = trainer.model.features(x)
    monkeypatch.setattr(nn.Module, "compile", failing_compile)
    modules = compiled_modules(trainer.model)
    outcome = compile_with_fallback(modules, "auto", FAKE_CUDA, trainer._trace_graphs)
    assert not outcome.compiled and outcome.seconds == 0.0
    assert "RuntimeError: inductor: lowering failed" in outcome.reason and "second line" not in outcome.reason
    assert outcome.fields() == {"compile": "eager", "compile_reason": outcome.reason, "seconds_compile": 0.0}
    assert "running eager" in capsys.readouterr().err
    assert all(m._compiled_call_impl is None for m in modules)
    assert torch.equal(trainer.model.features(x), expected)


def test_a_failed_compile_under_on_is_raised_with_the_fix(monkeypatch):
    trainer = batchnorm_trainer()
    monkeypatch.setattr(nn.Module, "compile", failing_compile)
    with pytest.raises(RuntimeError, match="train.compile=on: torch.compile failed .*set train.compile=auto"):
        compile_with_fallback(compiled_modules(trainer.model), "on", FAKE_CUDA, trainer._trace_graphs)


def test_off_never_compiles(monkeypatch):
    trainer = batchnorm_trainer()
    monkeypatch.setattr(nn.Module, "compile", failing_compile)
    outcome = compile_with_fallback(compiled_modules(trainer.model), "off", FAKE_CUDA, trainer._trace_graphs)
    assert not outcome.compiled and outcome.reason == "train.compile=off"
    assert all(m._compiled_call_impl is None for m in compiled_modules(trainer.model))


def test_the_probe_runs_every_compiled_module_and_leaves_the_trainer_as_it_was(monkeypatch):
    """The probe traces the step's forward and backward and the feature pass's forward; parameters, BatchNorm
    statistics, gradients and the RNG are unchanged after it, so compiling does not change the run."""
    trainer = batchnorm_trainer()
    calls: dict[int, int] = {}
    monkeypatch.setattr(nn.Module, "compile", counting_compile(calls))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rng = torch.get_rng_state()
    outcome = compile_with_fallback(compiled_modules(trainer.model), "auto", FAKE_CUDA, trainer._trace_graphs)
    assert outcome.compiled and outcome.seconds > 0 and "modules compiled: 1" in outcome.reason

    assert calls == {id(trainer.model.projection): 1}  # the projection runs in the step; features() skips it
    after = trainer.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert before["backbone.net.1.num_batches_tracked"] == 0  # the probe's train-mode forward was undone
    assert all(p.grad is None for p in trainer.model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert trainer.model.training
