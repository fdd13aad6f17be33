"""`train.cuda_graph`: where the step may be captured, and that a captured step trains exactly as the eager one.

A CUDA graph cannot be captured here, so `GraphRecorder` gives the CPU a graph's semantics: a capture runs nothing and
returns the tensors its replays write into; a replay reruns the recorded step on the very input tensors the capture
saw and copies the results into those output tensors. A step that fed a replay stale inputs, or kept a replay's
outputs past the next step, then trains differently from the eager trainer, which the tests compare bit for bit. The
last test captures a real graph and runs where CUDA is (the GPU check's parity step).
"""

import pytest
import torch

from infosieve_fast.config.settings import ConfigError
from infosieve_fast.training.engine import Trainer
from infosieve_fast.training.loss_monitor import NonFiniteLoss
from infosieve_fast.training.step_graph import (
    WARMUP_STEPS,
    GraphedStep,
    GraphPlan,
    StepInputs,
    optimizer_capturable,
    plan,
)
from tests.test_compiling import small_config as compiling_config

FAKE_CUDA = torch.device("cuda")  # only the plan reads the device


def small_config(*extra):
    """test_compiling's small CPU run with 6 steps of 16 an epoch: the warm-up, a capture and replays fit in one."""
    return compiling_config("train.train_subset=96", "train.max_steps_per_epoch=null", *extra)


class GraphRecorder:
    """A CUDA graph's semantics on the CPU (module docstring); counts what it was asked to do."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.eager_steps = self.captures = self.replays = 0

    def eager(self, run):
        self.eager_steps += 1
        return run()

    def capture(self, run):
        if self.fail:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nsecond line")
        self.captures += 1
        outputs: dict = {}  # filled by the first replay, then written in place, as a graph's output memory

        def replay():
            self.replays += 1
            for name, value in run().items():
                if name in outputs:
                    outputs[name].copy_(value)
                else:
                    outputs[name] = value.clone()

        return replay, outputs


def graphed(trainer: Trainer, setting: str = "on", recorder: GraphRecorder | None = None) -> GraphRecorder:
    """`trainer` with its step run by a `GraphRecorder` as `train.cuda_graph=setting` would on CUDA."""
    recorder = recorder or GraphRecorder()
    trainer.step_graph = GraphedStep(setting, GraphPlan(True, "test"), recorder)
    return recorder


def two_epochs(trainer: Trainer) -> list[dict]:
    return [trainer.train_epoch(0), trainer.train_epoch(1)]


def losses(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k.startswith("loss_")} for r in records]


def assert_same_weights(a: Trainer, b: Trainer) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"weights differ: {different[:5]}"


# ---------------------------------------------------------------------------------------------------- the plan
def test_the_default_is_off_and_yaml_booleans_read_as_on_and_off():
    assert small_config().train.cuda_graph == "off"
    assert small_config("train.cuda_graph=true").train.cuda_graph == "on"
    with pytest.raises(ConfigError, match=r"train.cuda_graph must be one of \('auto', 'on', 'off'\)"):
        small_config("train.cuda_graph=always")


def test_where_the_step_may_be_captured():
    assert plan("off", FAKE_CUDA, 1) == GraphPlan(False, "train.cuda_graph=off")
    assert plan("auto", FAKE_CUDA, 1).capture and plan("on", FAKE_CUDA, 1).capture
    on_cpu = plan("auto", torch.device("cpu"), 1)
    assert not on_cpu.capture and "eager (CUDA graphs need CUDA)" in on_cpu.reason
    ddp = plan("auto", FAKE_CUDA, 2)
    assert not ddp.capture and "DistributedDataParallel" in ddp.reason


@pytest.mark.parametrize(("device", "world"), [("cpu", 1), ("cuda", 2)])
def test_on_where_it_cannot_run_is_refused_with_the_fix(device, world):
    with pytest.raises(ValueError, match="train.cuda_graph=on: .*set it auto .* or off"):
        plan("on", torch.device(device), world)


def test_on_for_a_cpu_trainer_is_refused_before_anything_trains():
    with pytest.raises(ValueError, match="train.cuda_graph=on: CUDA graphs need CUDA"):
        Trainer(small_config("train.cuda_graph=on"))


def test_auto_on_the_cpu_trains_eager_and_the_epoch_says_so():
    trainer = Trainer(small_config("train.cuda_graph=auto"))
    record = trainer.train_epoch(0)
    assert record["cuda_graph"] == "eager" and record["seconds_cuda_graph_capture"] == 0.0
    assert trainer._autocast_cache  # eager: autocast keeps its casts as before


# ------------------------------------------------------------------------------------------- a captured step
def test_a_captured_step_trains_exactly_as_the_eager_step_and_is_captured_again_every_epoch():
    torch.manual_seed(0)
    eager = Trainer(small_config())
    torch.manual_seed(0)
    replayed = Trainer(small_config())
    recorder = graphed(replayed)
    want, got = two_epochs(eager), two_epochs(replayed)

    assert_same_weights(eager, replayed)
    assert losses(got) == losses(want)  # each step's terms: a replay's outputs were read before the next replay
    assert [r["steps"] for r in got] == [6, 6]
    # the warm-up once per process, then one capture per epoch (its lr and age are new), every other step a replay
    assert recorder.eager_steps == WARMUP_STEPS
    assert recorder.captures == 2
    assert recorder.replays == 12 - WARMUP_STEPS
    assert [r["cuda_graph"] for r in got] == ["graph", "graph"]
    assert [r["cuda_graph"] for r in want] == ["eager", "eager"]
    assert all(r["seconds_cuda_graph_capture"] > 0 for r in got)


@pytest.mark.parametrize("graph", [False, True])
def test_a_non_finite_replayed_step_is_named_by_its_own_index(graph):
    """The monitor checks its window of unchecked steps later: under a graph it must hold each step's terms, not the
    graph's output tensors that the next replay overwrites."""
    trainer = Trainer(small_config())
    if graph:
        graphed(trainer)
    train_views, calls = trainer.augment.train_views, []

    def nan_at_step_5(images, n_views, *args):
        views = train_views(images, n_views, *args)
        calls.append(n_views)
        return views.fill_(float("nan")) if n_views == 2 and calls.count(2) == 5 else views

    trainer.augment.train_views = nan_at_step_5
    with pytest.raises(NonFiniteLoss, match="non-finite loss at epoch 0, step 4:"):
        trainer.train_epoch(0)


def test_a_failed_capture_under_auto_runs_that_step_and_the_rest_eagerly(capsys):
    torch.manual_seed(0)
    eager = Trainer(small_config())
    torch.manual_seed(0)
    fallback = Trainer(small_config())
    recorder = graphed(fallback, "auto", GraphRecorder(fail=True))
    want, got = two_epochs(eager), two_epochs(fallback)

    assert_same_weights(eager, fallback)
    assert losses(got) == losses(want)  # the step whose capture failed ran once, eagerly
    assert recorder.captures == 0 and recorder.eager_steps == WARMUP_STEPS
    assert [r["cuda_graph"] for r in got] == ["eager", "eager"]
    reason = fallback.step_graph.reason
    assert "capturing the step failed (RuntimeError: CUDA error: operation not permitted" in reason
    assert "second line" not in reason
    assert reason in capsys.readouterr().err


def test_a_failed_capture_under_on_is_raised_with_the_fix():
    trainer = Trainer(small_config())
    graphed(trainer, "on", GraphRecorder(fail=True))
    fix = "train.cuda_graph=on: capturing the step failed .*set train.cuda_graph=auto"
    with pytest.raises(RuntimeError, match=fix):
        trainer.train_epoch(0)


# ----------------------------------------------------------------------------------------- GraphedStep alone
def step_inputs(value: float, batch: int = 4) -> StepInputs:
    return StepInputs(
        torch.full((2 * batch, 3), value), torch.arange(batch), torch.ones(batch, dtype=torch.bool), torch.zeros(batch)
    )


def scaled_sum(inputs: StepInputs) -> dict:
    return {"total": inputs.views.sum() * 2}


def warm(step: GraphedStep) -> None:
    for _ in range(WARMUP_STEPS):
        step(scaled_sum, step_inputs(0.0), host_values=(0.1,))


def test_the_same_host_values_replay_and_new_ones_capture_again():
    recorder = GraphRecorder()
    step = GraphedStep("auto", GraphPlan(True, "test"), recorder)
    warm(step)
    assert step(scaled_sum, step_inputs(1.0), (0.1,))["total"].item() == 48.0  # 8 x 3 ones, x 2
    assert step(scaled_sum, step_inputs(2.0), (0.1,))["total"].item() == 96.0
    assert recorder.captures == 1
    assert step(scaled_sum, step_inputs(3.0), (0.2,))["total"].item() == 144.0
    assert recorder.captures == 2
    step.release()
    assert step.seconds_capture == 0.0
    assert step(scaled_sum, step_inputs(1.0), (0.2,))["total"].item() == 48.0
    assert recorder.captures == 3


def test_a_batch_of_another_shape_runs_eagerly_and_keeps_the_graph():
    recorder = GraphRecorder()
    step = GraphedStep("auto", GraphPlan(True, "test"), recorder)
    warm(step)
    step(scaled_sum, step_inputs(1.0), (0.1,))
    assert step(scaled_sum, step_inputs(1.0, batch=2), (0.1,))["total"].item() == 24.0
    assert recorder.eager_steps == WARMUP_STEPS + 1
    assert step(scaled_sum, step_inputs(5.0), (0.1,))["total"].item() == 240.0
    assert recorder.captures == 1 and recorder.replays == 2


def test_off_runs_the_body_directly():
    recorder = GraphRecorder()
    step = GraphedStep("off", GraphPlan(False, "train.cuda_graph=off"), recorder)
    assert step(scaled_sum, step_inputs(1.0), (0.1,))["total"].item() == 48.0
    assert recorder.eager_steps == recorder.captures == 0
    assert step.fields()["cuda_graph"] == "eager"


def test_adamw_may_be_captured_only_inside_the_context_and_sgd_is_left_alone():
    params = [torch.nn.Parameter(torch.zeros(2))]
    adamw, sgd = torch.optim.AdamW(params), torch.optim.SGD(params, lr=0.1)
    with optimizer_capturable(adamw), optimizer_capturable(sgd):
        assert all(g["capturable"] for g in adamw.param_groups)
        assert all("capturable" not in g for g in sgd.param_groups)
    assert not any(g["capturable"] for g in adamw.param_groups)
    with pytest.raises(KeyError), optimizer_capturable(adamw):
        raise KeyError("a failed capture")
    assert not any(g["capturable"] for g in adamw.param_groups)


# --------------------------------------------------------------------------------------------------- on CUDA
@pytest.mark.gpu_parity
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_real_captured_step_on_cuda_trains_as_the_eager_step():
    """The graph replays the eager step's kernels on the same values: the same weights after two epochs."""
    cuda = ["train.device=cuda", "train.compile=off"]
    torch.manual_seed(0)
    eager = Trainer(small_config(*cuda))
    torch.manual_seed(0)
    replayed = Trainer(small_config(*cuda, "train.cuda_graph=on"))
    want, got = two_epochs(eager), two_epochs(replayed)
    assert [r["cuda_graph"] for r in got] == ["graph", "graph"]
    assert replayed.step_graph.captures == 2
    assert losses(got) == losses(want)
    assert_same_weights(eager, replayed)
