"""`train.compile`: `torch.compile` of the backbone's blocks and the projection head, on by default on CUDA.

The math is unchanged, so `auto` (the default) compiles wherever it works: on CUDA it compiles, then runs a probe
that traces every graph the run will use (the training step's forward and backward; the feature passes' forwards:
backbone features and the codes' pass, on images and on the token cache's frozen-prefix output). The modules of one
class (the blocks; the head) share one forward, so they compile together, one class at a time, each followed by the
probe: if compiling a class fails (in any of the probe's stages), that class goes back to eager and the classes that
compiled stay compiled, and the run goes on. A line on stderr says why; every epoch record holds the path
(`compile`: `compiled`, `partial` or `eager`) and each class's outcome (`compile_graphs`: "compiled", or why it runs
eager, naming the probe stage that failed). `on` raises instead of falling back; `off` never compiles. On the CPU
`auto` stays eager: torch.compile does not pay there, and `on` is refused.

Compiling happens once per process, before the first epoch's feature pass, so its time is reported apart from the
steps' and is not paid again in later epochs: every epoch record holds the path (`compile`) and the compile seconds it
paid (`seconds_compile`, 0 but in the first epoch a process runs). Nothing compiles after the probe: every feature
pass runs its batches at one size (`Evaluator.full_batch` pads the last one), and the probe runs each pass's forwards.

The blocks share one code object, and each way a run calls them (frozen or trained, in a step or a feature pass, on
images or on cached tokens) is one more graph of that object: seven for a split ViT, more for a process that trains
several configurations (bench_train's variants: `frozen_bf16` adds three, `cuda_graph`'s autocast setting seven).
Dynamo compiles at most `recompile_limit` graphs per code object and runs the rest eagerly, without an error, so
compiling raises that limit to `RECOMPILE_LIMIT` where it is lower.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..common.notices import error_line, notice
from ..config.settings import DataConfig
from .model import PrefixTokens

RECOMPILE_LIMIT = 64  # graphs per code object (torch's default: 8); one run's split ViT blocks need 7


COMPILED = "compiled"
CPU_REASON = "train.compile=auto on the CPU: eager (torch.compile does not pay here)"


@dataclass(frozen=True)
class CompileOutcome:
    compiled: bool  # whether any module runs compiled
    reason: str  # why this path ran, one line
    seconds: float  # compile time (the probes'); 0 when eager
    graphs: dict[str, str] = field(default_factory=dict)  # module class -> "compiled", or why it runs eager (a line)

    @property
    def path(self) -> str:
        if not self.compiled:
            return "eager"
        return COMPILED if all(v == COMPILED for v in self.graphs.values()) else "partial"

    def fields(self) -> dict:
        """As a benchmark reports it."""
        return {"compile": self.path, "compile_reason": self.reason, "seconds_compile": self.seconds}


def compiled_modules(model: nn.Module) -> list[nn.Module]:
    """What `train.compile` compiles: every backbone block (frozen and trained blocks share one graph; they differ
    only in grad mode), the projection head and the method's own heads. Compiled in place, so state-dict keys do not
    change."""
    return [*getattr(model.backbone.net, "blocks", []), model.projection, *model.method_heads.values()]


def compiles(setting: str, device: torch.device) -> bool:
    """Whether `train.compile=setting` compiles anything on `device`: on CUDA unless off (the CPU stays eager)."""
    return setting != "off" and device.type == "cuda"


def check_compile_setting(setting: str, device: torch.device) -> None:
    """Refuse `train.compile=on` where it cannot run, before anything is built."""
    if setting == "on" and device.type != "cuda":
        raise ValueError("train.compile=on needs CUDA (torch.compile on the CPU does not pay here): set it auto or off")


class ProbeStageFailed(Exception):
    """A stage of the compile probe failed: `stage` names it, the cause is the error."""

    def __init__(self, stage: str, err: Exception):
        super().__init__(f"{stage}: {error_line(err)}")
        self.stage, self.err = stage, err


@contextmanager
def probe_stage(stage: str) -> Iterator[None]:
    """Name the part of the probe that runs inside (e.g. "the step's backward") in the error it may raise."""
    try:
        yield
    except ProbeStageFailed:
        raise
    except Exception as err:
        raise ProbeStageFailed(stage, err) from err


def failure_line(err: Exception) -> str:
    """What failed, one line: the error, and the probe stage it failed in when known."""
    if isinstance(err, ProbeStageFailed):
        return f"torch.compile failed in {err.stage} ({error_line(err.err)})"
    return f"torch.compile failed ({error_line(err)})"


def by_class(modules: list[nn.Module]) -> dict[str, list[nn.Module]]:
    """`modules` grouped by class name (one forward, so one set of graphs, per class), in first-seen order."""
    groups: dict[str, list[nn.Module]] = {}
    for module in modules:
        groups.setdefault(type(module).__name__, []).append(module)
    return groups


def compile_with_fallback(
    modules: list[nn.Module], setting: str, device: torch.device, probe: Callable[[], None]
) -> CompileOutcome:
    """Compile `modules` in place as `setting` says, one class at a time, and run `probe` after each class to trace
    its graphs now. Under `auto` a class whose compile fails goes back to eager (the others stay compiled) and is
    reported; under `on` the failure is raised."""
    check_compile_setting(setting, device)
    groups = by_class(modules)
    if not compiles(setting, device):
        reason = "train.compile=off" if setting == "off" else CPU_REASON
        return CompileOutcome(False, reason, 0.0, dict.fromkeys(groups, reason))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    start = time.perf_counter()
    graphs = {name: _compile_group(group, setting, probe) for name, group in groups.items()}
    failed = {name: line for name, line in graphs.items() if line != COMPILED}
    if len(failed) == len(graphs):
        torch._dynamo.reset()
        reason = f"train.compile=auto: {next(iter(failed.values()))}; running eager"
        notice(f"WARNING: {reason}")
        return CompileOutcome(False, reason, 0.0, graphs)
    seconds = time.perf_counter() - start
    n = sum(len(groups[name]) for name in graphs if name not in failed)
    reason = f"train.compile={setting}: modules compiled: {n}, in {seconds:.1f} s"
    if failed:
        reason += "; " + "; ".join(f"{name} runs eager: {line}" for name, line in failed.items())
        notice(f"WARNING: {reason}")
    else:
        notice(reason)
    return CompileOutcome(True, reason, seconds, graphs)


def _compile_group(group: list[nn.Module], setting: str, probe: Callable[[], None]) -> str:
    """Compile the modules of one class and trace their graphs with `probe`: "compiled", or (under `auto`) the
    failure that sent them back to eager."""
    for module in group:
        module.compile(dynamic=False)
    try:
        probe()
    except Exception as err:
        if setting == "on":
            raise RuntimeError(
                f"train.compile=on: {failure_line(err)}; set train.compile=auto to fall back to eager, or off"
            ) from err
        for module in group:
            module._compiled_call_impl = None  # what nn.Module.compile set: calls go back to the eager forward
        return failure_line(err)
    return COMPILED


def trace_graphs(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: DataConfig,
    device: torch.device,
    autocast: Callable[[], torch.autocast],
) -> None:
    """The probe: run every graph a run of `model` uses once, at its shapes (`data`'s batch sizes, crop and channels):
    the step's forward and backward (both views of a batch) and the feature passes' forwards, each a named
    `probe_stage`. Parameters, buffers, gradients (`optimizer`'s), the RNG and the training mode are left as they were,
    also when a stage fails (compiling goes on without the failing class)."""
    buffers, training = [b.clone() for b in model.buffers()], model.training
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            shape = (len(data.mean), data.crop_size, data.crop_size)  # the images' channels, as the augmentation checks
            with autocast(), probe_stage("the step's forward"):
                out = model(torch.zeros(2 * data.batch_size, *shape, device=device))
            with probe_stage("the step's backward"):
                (out.projection.sum() + out.backbone.float().sum()).backward()
            model.eval()
            with torch.no_grad(), autocast():
                _trace_feature_passes(model, torch.zeros(data.feature_batch_size, *shape, device=device))
    finally:
        model.train(training)
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), buffers, strict=True):
                buffer.copy_(saved)


def _trace_feature_passes(model: nn.Module, x: torch.Tensor) -> None:
    """The forwards of the feature passes at their one batch size (`Evaluator.full_batch`): backbone features and the
    codes' pass (the whole model), on images and, where the token cache may hold the frozen prefix's output, on that
    output as the cache records and replays it."""
    with probe_stage("the feature passes on images"):
        model.features(x)
        model(x)
    if model.backbone.prefix_is_pure:
        with probe_stage("the feature passes on the token cache's frozen-prefix output"):
            tokens = PrefixTokens(model.backbone.frozen_tokens(x))
            model.features(tokens)
            model(tokens)
