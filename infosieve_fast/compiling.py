"""`train.compile`: `torch.compile` of the backbone's blocks and the projection head, on by default on CUDA.

The math is unchanged, so `auto` (the default) compiles wherever it works: on CUDA it compiles, then runs a probe
that traces every graph the run will use (the training step's forward and backward; the feature passes' forwards:
backbone features and the codes' pass, on images and on the token cache's frozen-prefix output). If compiling fails,
the modules go back to eager and the run goes on; a line on stderr and the epoch record say which path ran and why.
`on` raises instead of falling back; `off` never compiles. On the CPU `auto` stays eager:
torch.compile does not pay there, and `on` is refused.

Compiling happens once per process, before the first epoch's feature pass, so its time is reported apart from the
steps' and is not paid again in later epochs: every epoch record holds the path (`compile`) and the compile seconds it
paid (`seconds_compile`, 0 but in the first epoch a process runs). Nothing compiles after the probe: every feature
pass runs its batches at one size (`Trainer._full_batch` pads the last one), and the probe runs each pass's forwards.

The blocks share one code object, and each way a run calls them (frozen or trained, in a step or a feature pass, on
images or on cached tokens) is one more graph of that object: seven for a split ViT, more for a process that trains
several configurations (bench_train's variants: `frozen_bf16` adds three, `cuda_graph`'s autocast setting seven).
Dynamo compiles at most `recompile_limit` graphs per code object and runs the rest eagerly, without an error, so
compiling raises that limit to `RECOMPILE_LIMIT` where it is lower.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .notices import error_line, notice

RECOMPILE_LIMIT = 64  # graphs per code object (torch's default: 8); one run's split ViT blocks need 7


@dataclass(frozen=True)
class CompileOutcome:
    compiled: bool
    reason: str  # why this path ran, one line
    seconds: float  # compile time (the probe's); 0 when eager

    @property
    def path(self) -> str:
        return "compiled" if self.compiled else "eager"

    def fields(self) -> dict:
        """As a benchmark reports it."""
        return {"compile": self.path, "compile_reason": self.reason, "seconds_compile": self.seconds}


def compiled_modules(model: nn.Module) -> list[nn.Module]:
    """What `train.compile` compiles: every backbone block (frozen and trained blocks share one graph; they differ
    only in grad mode) and the projection head. Compiled in place, so state-dict keys do not change."""
    return [*getattr(model.backbone.net, "blocks", []), model.projection]


def check_compile_setting(setting: str, device: torch.device) -> None:
    """Refuse `train.compile=on` where it cannot run, before anything is built."""
    if setting == "on" and device.type != "cuda":
        raise ValueError("train.compile=on needs CUDA (torch.compile on the CPU does not pay here): set it auto or off")


def compile_with_fallback(
    modules: list[nn.Module], setting: str, device: torch.device, probe: Callable[[], None]
) -> CompileOutcome:
    """Compile `modules` in place as `setting` says and run `probe` to trace their graphs now. A failure under
    `auto` restores eager modules and is reported; under `on` it is raised."""
    check_compile_setting(setting, device)
    if setting == "off":
        return CompileOutcome(False, "train.compile=off", 0.0)
    if device.type != "cuda":
        return CompileOutcome(False, "train.compile=auto on the CPU: eager (torch.compile does not pay here)", 0.0)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for module in modules:
        module.compile(dynamic=False)
    start = time.perf_counter()
    try:
        probe()
    except Exception as err:
        if setting == "on":
            raise RuntimeError(
                f"train.compile=on: torch.compile failed ({error_line(err)}); set train.compile=auto to fall back to "
                "eager, or off"
            ) from err
        for module in modules:
            module._compiled_call_impl = None  # what nn.Module.compile set: calls go back to the eager forward
        torch._dynamo.reset()
        reason = f"train.compile=auto: torch.compile failed ({error_line(err)}); running eager"
        notice(f"WARNING: {reason}")
        return CompileOutcome(False, reason, 0.0)
    seconds = time.perf_counter() - start
    reason = f"train.compile={setting}: modules compiled: {len(modules)}, in {seconds:.1f} s"
    notice(reason)
    return CompileOutcome(True, reason, seconds)
