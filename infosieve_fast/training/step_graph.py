"""`train.cuda_graph`: the training step (forward, loss, backward, optimizer update) replayed from a CUDA graph.

A step has the same shapes every time, and at the training shapes its hundreds of kernel launches cost host time a
CUDA graph replaces by one launch. The math is unchanged: a replay runs the kernels the capture recorded, on the
values in the same tensors.

- `off` (the default until a GPU run has measured it): every step runs eagerly.
- `auto`: on CUDA in a single process, the first `WARMUP_STEPS` steps of a process run eagerly on the capture's side
  stream (so library handles, workspaces, the optimizer's state and the kernels' compilation exist before capture),
  the next step is captured and replayed, and every later step is a replay. Where it cannot run (the CPU; torchrun,
  whose DistributedDataParallel reduces gradients outside the graph) or the capture fails, the steps run eagerly: the
  epoch record says which path ran (`cuda_graph`), and a failed capture's warning on stderr says why.
- `on`: as `auto`, but raises instead of running eagerly.

A capture bakes in the values the step reads from the host: the learning rate and the code head's age are arguments of
the kernels it recorded. The trainer passes them as the step's `host_values`; when they change (every epoch) the step
is captured again, and each epoch record holds what its capture took (`seconds_cuda_graph_capture`). What the step
reads from the device it reads at each replay: the views, targets, labelled mask and pseudo-labels are copied into the
graph's input tensors first, and the positional weights are buffers updated in place. Autocast's weight-cast cache is
off in this mode (a capture must not keep casts across replays); the casts it would have kept are recomputed, with
the same values.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ..common.notices import error_line, notice

WARMUP_STEPS = 3  # eager steps before the first capture of a process (what PyTorch's examples use)
StepOutputs = dict[str, Tensor]


@dataclass
class StepInputs:
    """What one step reads from the device: the 2B views and the B targets, labelled flags and pseudo-labels."""

    views: Tensor
    targets: Tensor
    labelled: Tensor
    pseudo: Tensor

    def tensors(self) -> list[Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def same_shapes(self, other: StepInputs) -> bool:
        return all(
            a.shape == b.shape and a.dtype == b.dtype for a, b in zip(self.tensors(), other.tensors(), strict=True)
        )

    def copy_into(self, static: StepInputs) -> None:
        for dst, src in zip(static.tensors(), self.tensors(), strict=True):
            dst.copy_(src, non_blocking=True)

    def clone(self) -> StepInputs:
        return StepInputs(*(t.clone() for t in self.tensors()))


@contextmanager
def optimizer_capturable(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """`optimizer.step()` recordable in a graph: Adam(W) refuses a capture unless its groups say `capturable` (its
    fused kernel reads the step count from the device either way, so the update is the same). The flags go back
    afterwards: a replay never reads them, and an eager step with them set would warn. SGD has no such flag."""
    groups = [g for g in optimizer.param_groups if "capturable" in g]
    saved = [g["capturable"] for g in groups]
    for g in groups:
        g["capturable"] = True
    try:
        yield
    finally:
        for g, value in zip(groups, saved, strict=True):
            g["capturable"] = value


class CudaCapture:
    """Eager steps and the capture on one side stream of `device`; replays on the current stream."""

    def __init__(self, device: torch.device, optimizer: torch.optim.Optimizer):
        self.device, self.optimizer = device, optimizer
        self.stream = torch.cuda.Stream(device)

    def eager(self, run: Callable[[], StepOutputs]) -> StepOutputs:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = run()
        current.wait_stream(self.stream)
        return out

    def capture(self, run: Callable[[], StepOutputs]) -> tuple[Callable[[], None], StepOutputs]:
        """`run` recorded, not executed: (the replay, the tensors each replay writes its outputs into)."""
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        # thread_local: a CUDA call from another thread (a data loader's pinning thread) must not void the capture
        with (
            optimizer_capturable(self.optimizer),
            torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"),
        ):
            outputs = run()
        return graph.replay, outputs


@dataclass(frozen=True)
class GraphPlan:
    """Whether the step may be captured here, and why (one line)."""

    capture: bool
    reason: str


def plan(setting: str, device: torch.device, world_size: int) -> GraphPlan:
    """What `train.cuda_graph` does on `device` with `world_size` processes; `on` where it cannot run is refused."""
    if setting == "off":
        return GraphPlan(False, "train.cuda_graph=off")
    why_not = None
    if device.type != "cuda":
        why_not = "CUDA graphs need CUDA"
    elif world_size > 1:
        why_not = "under torchrun DistributedDataParallel reduces the gradients outside a graph"
    if why_not is None:
        return GraphPlan(True, f"train.cuda_graph={setting}: the step is captured after {WARMUP_STEPS} eager steps")
    if setting == "on":
        raise ValueError(f"train.cuda_graph=on: {why_not}; set it auto (eager where it cannot run) or off")
    return GraphPlan(False, f"train.cuda_graph=auto: eager ({why_not})")


class GraphedStep:
    """Runs a step function as `train.cuda_graph` says: `step(body, inputs, host_values)`.

    `body(inputs)` performs one whole step in place and returns its loss terms. Under a graph the returned tensors
    are the graph's own outputs, overwritten by the next replay: read or copy them before the next step
    (`LossMonitor.record` stacks them into a new tensor at once). `host_values` are the host numbers the body bakes
    into a capture; a change captures again.
    """

    def __init__(self, setting: str, graph_plan: GraphPlan, capturer: CudaCapture | None = None):
        self.setting, self.reason = setting, graph_plan.reason
        self.capturer = capturer if graph_plan.capture else None
        self.eager_steps = 0  # eager steps run so far in this mode (the warm-up)
        self.captures = 0
        self.seconds_capture = 0.0  # since the last `release`
        self._replay: Callable[[], None] | None = None
        self._inputs: StepInputs | None = None  # the graph's input tensors
        self._outputs: StepOutputs | None = None
        self._host_values: Hashable = None

    @classmethod
    def for_setting(
        cls, setting: str, device: torch.device, world_size: int, optimizer: torch.optim.Optimizer
    ) -> GraphedStep:
        graph_plan = plan(setting, device, world_size)
        return cls(setting, graph_plan, CudaCapture(device, optimizer) if graph_plan.capture else None)

    @property
    def active(self) -> bool:
        """Whether steps are (or will be, after the warm-up) replayed from a graph."""
        return self.capturer is not None

    @property
    def path(self) -> str:
        return "graph" if self.active else "eager"

    def fields(self) -> dict:
        """As the epoch record and the benchmarks report it."""
        return {
            "cuda_graph": self.path,
            "cuda_graph_reason": self.reason,
            "cuda_graph_captures": self.captures,
            "seconds_cuda_graph_capture": self.seconds_capture,
        }

    def release(self) -> None:
        """Drop the graph and its memory (the trainer calls this before each epoch's feature pass); the next step
        captures again, and `seconds_capture` counts from here (an epoch's capture time, in the trainer)."""
        self._drop_graph()
        self.seconds_capture = 0.0

    def _drop_graph(self) -> None:
        self._replay = self._outputs = self._host_values = None

    def __call__(
        self, body: Callable[[StepInputs], StepOutputs], inputs: StepInputs, host_values: Hashable
    ) -> StepOutputs:
        if not self.active:
            return body(inputs)
        if self._replay is not None and host_values == self._host_values and inputs.same_shapes(self._inputs):
            inputs.copy_into(self._inputs)
            self._replay()
            return self._outputs
        if self.eager_steps < WARMUP_STEPS or (self._inputs is not None and not inputs.same_shapes(self._inputs)):
            self.eager_steps += 1
            return self.capturer.eager(lambda: body(inputs))
        return self._capture_and_run(body, inputs, host_values)

    def _capture_and_run(
        self, body: Callable[[StepInputs], StepOutputs], inputs: StepInputs, host_values: Hashable
    ) -> StepOutputs:
        self._drop_graph()
        if self._inputs is None:
            self._inputs = inputs.clone()
        else:
            inputs.copy_into(self._inputs)
        start = time.perf_counter()
        try:
            self._replay, self._outputs = self.capturer.capture(lambda: body(self._inputs))
        except Exception as err:
            if self.setting == "on":
                raise RuntimeError(
                    f"train.cuda_graph=on: capturing the step failed ({error_line(err)}); set train.cuda_graph=auto "
                    "to run it eagerly, or off"
                ) from err
            self.capturer = self._inputs = None
            self.reason = f"train.cuda_graph=auto: capturing the step failed ({error_line(err)}); eager"
            notice(f"WARNING: {self.reason}")
            return body(inputs)  # a capture records without running: this step has not run yet
        self.seconds_capture += time.perf_counter() - start
        self.captures += 1
        self._host_values = host_values
        if self.captures == 1:
            notice(f"{self.reason}: captured in {self.seconds_capture:.2f} s")
        self._replay()
        return self._outputs
