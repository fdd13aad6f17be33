"""`train.compile`: on by default where it works (CUDA), eager on the CPU, and a failed compile falls back to eager
under `auto` (raised under `on`). torch.compile itself cannot run usefully here, so `nn.Module.compile` is replaced
by stand-ins that either fail at the first call (as an inductor error does) or count the calls."""

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from infosieve_fast.config.settings import ConfigError, load_config
from infosieve_fast.evaluation.evaluator import epoch_log
from infosieve_fast.network import recompute
from infosieve_fast.network.compiling import RECOMPILE_LIMIT, CompileOutcome, compile_with_fallback, compiled_modules
from infosieve_fast.network.model import Backbone, PrefixTokens
from infosieve_fast.training.engine import Trainer

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
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1), nn.Flatten())  # 1: digits
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
    x = torch.rand(4, 1, 8, 8)
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

    assert calls == {id(trainer.model.projection): 2}  # the step and the codes' pass; features() skips it
    after = trainer.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert before["backbone.net.1.num_batches_tracked"] == 0  # the probe's train-mode forward was undone
    assert all(p.grad is None for p in trainer.model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert trainer.model.training


def test_the_probe_gives_the_network_the_images_channels(monkeypatch):
    """The demo's backbone takes one channel (the digits'): the probe's images have as many channels as the data
    (`data.mean`), so compiling it succeeds instead of falling back on a channel mismatch."""
    trainer = Trainer(small_config())
    monkeypatch.setattr(nn.Module, "compile", counting_compile({}))
    outcome = compile_with_fallback(compiled_modules(trainer.model), "auto", FAKE_CUDA, trainer._trace_graphs)
    assert outcome.compiled, outcome.reason


def dynamo_tracing_only(monkeypatch):
    """`nn.Module.compile` with Dynamo's eager backend: the graphs are traced and cached as under inductor (the same
    guards and limits), without generating code."""
    compile_ = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda module, **kw: compile_(module, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    counters.clear()


def split_vit_config(*extra):
    """A tiny split ViT (10 frozen blocks, 2 trained) on 100 digits: feature batches of 32 end with a batch of 4."""
    return small_config(
        "model.backbone=vit_tiny_patch16_224", 'model.backbone_kwargs={"img_size": 32, "in_chans": 1}',
        "model.grad_from_block=10", "train.train_subset=100", "data.feature_batch_size=32",
        "train.max_steps_per_epoch=2", "train.eval_every=1", *extra,
    )  # fmt: skip


@pytest.mark.slow
def test_after_the_probe_a_run_compiles_nothing_more(monkeypatch):
    """Every graph a run uses is compiled by the probe: the evaluations (recording and replaying the token cache, the
    codes' pass), the epochs' feature passes with their last, smaller batch, and the steps add none, and no code
    object reaches Dynamo's limit (past it, Dynamo would run the forward eagerly without an error)."""
    dynamo_tracing_only(monkeypatch)
    trainer = Trainer(split_vit_config())
    modules = compiled_modules(trainer.model)
    trainer.evaluator.compiled = compile_with_fallback(modules, "auto", FAKE_CUDA, trainer._trace_graphs)
    assert trainer.compiled.compiled, trainer.compiled.reason
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT
    graphs = counters["stats"]["unique_graphs"]
    trainer.evaluate()
    trainer.train_epoch(0)
    epoch_log(trainer.evaluator, trainer.evaluate_full())  # the cache's replay and the codes
    trainer.train_epoch(1)
    assert trainer.token_cache.replay("train") is not None
    assert counters["stats"]["unique_graphs"] == graphs
    assert not any("recompile" in reason.lower() for reason in counters["unimplemented"])


class FailingBackward(torch.autograd.Function):
    """The identity whose backward fails, as a compiled graph's backward that does not lower."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("inductor: backward lowering failed")


def compile_failing_only(class_name: str, where: str):
    """`nn.Module.compile` whose modules of `class_name` fail in the `forward` or the `backward`; the others run as
    compiled stand-ins (their own forward)."""

    def compile_(module, *args, **kwargs):
        if type(module).__name__ != class_name:
            module._compiled_call_impl = module._call_impl
        elif where == "forward":
            failing_compile(module)
        else:
            module._compiled_call_impl = lambda *a, **k: FailingBackward.apply(module._call_impl(*a, **k))

    return compile_


@pytest.mark.parametrize(
    ("failing", "where", "stage"),
    [("ProjectionHead", "forward", "the step's forward"), ("Block", "backward", "the step's backward")],
)
def test_a_class_that_fails_to_compile_runs_eager_and_the_epoch_record_names_it(
    monkeypatch, capsys, failing, where, stage
):
    """One class of compiled modules fails (in its forward, or in the step's backward): under `auto` that class runs
    eager, the other stays compiled, and the epoch record says `partial` with each class's outcome and the failing
    probe stage; the probe left the trainer in training mode with no gradients."""
    monkeypatch.setattr(nn.Module, "compile", compile_failing_only(failing, where))
    trainer = Trainer(split_vit_config("train.eval_every=0"))
    modules = compiled_modules(trainer.model)
    trainer.evaluator.compiled = compile_with_fallback(modules, "auto", FAKE_CUDA, trainer._trace_graphs)
    assert trainer.model.training and all(p.grad is None for p in trainer.model.parameters())
    error = "inductor: backward lowering failed" if where == "backward" else "inductor: lowering failed"
    why = f"torch.compile failed in {stage} (RuntimeError: {error})"
    other = {"ProjectionHead": "Block", "Block": "ProjectionHead"}[failing]
    assert trainer.compiled.graphs == {failing: why, other: "compiled"}
    assert {(type(m).__name__, recompute.is_compiled(m)) for m in modules} == {(failing, False), (other, True)}
    assert f"{failing} runs eager: {why}" in capsys.readouterr().err
    record = trainer.train_epoch(0)
    assert record["compile"] == "partial" and record["compile_graphs"] == {failing: why, other: "compiled"}


def test_the_epoch_record_gives_each_class_the_reason_it_runs_eager():
    record = Trainer(split_vit_config()).compile_once()  # what `train_epoch` puts in its record
    reason = "train.compile=auto on the CPU: eager (torch.compile does not pay here)"
    graphs = {"Block": reason, "ProjectionHead": reason}
    assert record == {"compile": "eager", "compile_graphs": graphs, "seconds_compile": 0}


@pytest.mark.parametrize("tokens", [False, True])
def test_a_smaller_batch_runs_padded_to_the_feature_batch_and_keeps_its_own_rows(tokens):
    """Compiled, the last batch of a pass runs at `data.feature_batch_size` rows (copies of its first row added) and
    its own rows come back: each row is computed alone in evaluation mode, so they equal the unpadded features."""
    torch.manual_seed(0)
    trainer = Trainer(split_vit_config())
    model = trainer.model.eval()
    x = torch.rand(5, 1, 32, 32)
    if tokens:
        x = PrefixTokens(model.backbone.frozen_tokens(x))
    seen = []

    def features(batch):
        seen.append(len(batch.tokens if tokens else batch))
        return model.features(batch)

    with torch.no_grad():
        want = trainer.evaluator.full_batch(features, x)  # eager: as it is
        trainer.evaluator.compiled = CompileOutcome(True, "compiled", 0.0)
        got = trainer.evaluator.full_batch(features, x)
    assert seen == [5, 32]
    assert got.shape == want.shape == (5, model.backbone.feat_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_configurations_of_one_process_all_compile_within_dynamos_limit(monkeypatch):
    """bench_train compiles several trainers in one process, and each configuration adds graphs of the blocks' code
    object: the default, frozen_bf16 (its frozen blocks in bf16) and a CUDA-graph step (autocast without its cast
    cache) together stay within the limit compiling sets, so none runs eagerly unnoticed."""
    dynamo_tracing_only(monkeypatch)
    for extra, autocast_cache in (([], True), (["train.frozen_bf16=true"], True), ([], False)):
        trainer = Trainer(split_vit_config("train.amp=bf16", "train.eval_every=0", *extra))
        trainer._autocast_cache = autocast_cache  # what train.cuda_graph sets on CUDA
        modules = compiled_modules(trainer.model)
        trainer.evaluator.compiled = compile_with_fallback(modules, "auto", FAKE_CUDA, trainer._trace_graphs)
        trainer.train_epoch(0)
        assert trainer.compiled.compiled, trainer.compiled.reason
    assert counters["stats"]["unique_graphs"] > 2 * 9  # the three configurations' graphs (9 each at most) differ
    assert not any("recompile" in reason.lower() for reason in counters["unimplemented"])
