"""The GPU issues' targets against what one gpu_check.sh run measured: one row per target with the measured value,
the result file and key it comes from, and whether it holds ("owed" where the run has no value for it).

    python -m benchmarks.tools.gpu_targets RESULTS_FOLDER                  # gpu_check.sh's <card>/ folder: the table
    python -m benchmarks.tools.gpu_targets ARCHIVE --into benchmarks/results   # unpack <card>-gpu-check.tar.gz as
                                                                         # <card>-<file> there, then the table

gpu_check.sh runs the first form as its last step, so the table is in the archive's summary.txt. Unpacking never
overwrites a file: an existing one is named in the error.
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import at

Reader = Callable[[dict], float | None]


@dataclass(frozen=True)
class Target:
    issue: int
    what: str
    file: str  # a gpu_check.sh result file
    key: str  # where the value is: a dotted path into the file, or what `read` computes
    bound: str | None = None  # "<=" or ">=", or None: reported, no bound
    limit: float | None = None
    read: Reader | None = None  # None: the value at the dotted `key`

    def value(self, data: dict) -> float | None:
        if self.read is not None:
            return self.read(data)
        return number(at(data, self.key))


def number(value) -> float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def kmeans_run(precision: str, key: str, scale: float = 1.0) -> Reader:
    """`key` of the k-means run with that distance precision, times `scale`."""

    def read(data: dict) -> float | None:
        runs = [r for r in data.get("runs", []) if r.get("distance_precision") == precision]
        value = number(runs[0].get(key)) if runs else None
        return None if value is None else value * scale

    return read


def path_taken(key: str, wanted: str) -> Reader:
    """1 where the string at `key` is `wanted` (the path a variant ran: compiled, graph), 0 where it is another."""

    def read(data: dict) -> float | None:
        value = at(data, key)
        return None if value is None else float(value == wanted)

    return read


def kernel_case(group: str, variant: str, key: str, **shape) -> Reader:
    """`key` of `variant` in the kernel case of that shape."""

    def read(data: dict) -> float | None:
        cases = [c for c in data.get(group, []) if all(c.get(k) == v for k, v in shape.items())]
        return number(at(cases[0], f"variants.{variant}.{key}")) if cases else None

    return read


def fused_lead_over_compiled(data: dict) -> float | None:
    """The smallest compiled-over-fused time ratio over every case both ran (> 1: fused faster everywhere)."""
    ratios = [
        c["ratios"]["compiled_over_fused_time"]
        for group in ("code_head", "contrastive")
        for c in data.get(group, [])
        if "compiled_over_fused_time" in c.get("ratios", {})
    ]
    return min(ratios) if ratios else None


KM, EPOCH, KERNELS = "kmeans-imagenet1k.json", "epoch-imagenet1k.json", "kernels.json"
TRAIN, CUB_EPOCH = "train-step.json", "train-epoch.json"  # bench_train: the step variants; the CUB-size epoch
CUB = "epoch.fast_default"
TARGETS = [
    Target(19, "SS-k-means round, ImageNet-1k size, fp32 search: s", KM, "runs[fp32].seconds", "<=", 10.0,
           kmeans_run("fp32", "seconds")),
    Target(19, "... memory beyond the features: GB", KM, "runs[fp32].peak_bytes_beyond_features / 1e9", "<=", 8.0,
           kmeans_run("fp32", "peak_bytes_beyond_features", 1e-9)),
    Target(19, "ImageNet-1k epoch at ViT-B/16, projected: min", EPOCH, "summary.projected_epoch_minutes", "<=", 10.0),
    Target(19, "... share of the window waiting for the loader", EPOCH, "summary.loader_wait_fraction"),
    Target(19, "... GPU utilisation, mean %", EPOCH, "summary.gpu_utilisation_mean_percent"),
    Target(20, "default step, × published bf16", TRAIN, "summary.step_speedup_vs_published_bf16.value", ">=", 2.0),
    Target(20, "default step, × published fp32", TRAIN, "summary.step_speedup_vs_published_fp32.value", ">=", 10.0),
    Target(20, "default step compiled (1), or eager after a failed compile (0)", TRAIN,
           "step.variants.fast_default.compile", ">=", 1.0,
           path_taken("step.variants.fast_default.compile", "compiled")),
    Target(20, "default step: ms", TRAIN, "step.variants.fast_default.ms_per_step"),
    Target(20, "... replayed from a CUDA graph (train.cuda_graph=on): ms", TRAIN,
           "step.variants.fast_graph.ms_per_step"),
    Target(20, "... the graph captured (1), or eager after a failed capture (0)", TRAIN,
           "step.variants.fast_graph.cuda_graph", ">=", 1.0,
           path_taken("step.variants.fast_graph.cuda_graph", "graph")),
    Target(20, "default step MFU, measured GEMM rate", TRAIN, "summary.step_mfu_measured_gemm", ">=", 0.5),
    Target(20, "default step MFU, datasheet peak", TRAIN, "summary.step_mfu_datasheet"),
    Target(20, "default peak memory, × published fp32", TRAIN, "summary.peak_memory_ratio_vs_published_fp32.value",
           "<=", 0.5),
    Target(20, "CUB-size epoch: s", CUB_EPOCH, "summary.epoch_seconds", "<=", 1.8),
    Target(20, "200 epochs with checkpoints: min", CUB_EPOCH, "summary.projected_200_epochs_with_checkpoint_minutes",
           "<=", 6.0),
    Target(20, "feature pass at CUB size: s", CUB_EPOCH, f"{CUB}.phase_seconds.features", "<=", 0.4),
    Target(20, "SS-k-means round at CUB size: s", CUB_EPOCH, f"{CUB}.phase_seconds.kmeans", "<=", 0.2),
    Target(20, "evaluation recording the token cache: s", CUB_EPOCH, f"{CUB}.evaluation_seconds"),
    Target(20, "... replaying it: s", CUB_EPOCH, f"{CUB}.evaluation_replay_seconds"),
    Target(20, "fused code head fwd+bwd, N = 256: ms", KERNELS, "code_head[N=256].fused.ms", "<=", 0.1,
           kernel_case("code_head", "fused", "ms", N=256)),
    Target(20, "... the same, replayed from a CUDA graph: ms", KERNELS, "code_head[N=256].fused_graph.ms", None, None,
           kernel_case("code_head", "fused_graph", "ms", N=256)),
    Target(20, "fused InfoNCE + SupCon fwd+bwd, N = 256, D = 40: ms", KERNELS, "contrastive[256,40].fused.ms",
           "<=", 0.1, kernel_case("contrastive", "fused", "ms", N=256, D=40)),
    Target(20, "... the losses replayed from a CUDA graph: ms", KERNELS, "contrastive[256,40].fused_graph.ms", None,
           None, kernel_case("contrastive", "fused_graph", "ms", N=256, D=40)),
    Target(20, "fused code head, N = 1M: share of HBM bandwidth", KERNELS, "code_head[N=1M].fused.hbm_util",
           ">=", 0.7, kernel_case("code_head", "fused", "hbm_util", N=1 << 20)),
    Target(20, "fused against torch.compile, slowest case: × compiled", KERNELS,
           "min ratios.compiled_over_fused_time", ">=", 1.0, fused_lead_over_compiled),
]  # fmt: skip


def evaluate(files: dict[str, Path]) -> list[dict]:
    """Every target's row, read from the result files of one gpu_check.sh run ({name in the run: path}). A result
    written at smoke size (the CPU rehearsal) is no measurement of a target: its rows say "smoke", never yes or no.
    A file that does not parse costs only its own rows, which say why."""
    results, unreadable = {}, {}
    for name in {t.file for t in TARGETS if t.file in files}:
        try:
            results[name] = json.loads(files[name].read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:  # e.g. a step killed while it wrote
            unreadable[name] = f"unreadable: {type(err).__name__}: {err}"
    rows = []
    for t in TARGETS:
        data = results.get(t.file)
        value = t.value(data) if data is not None else None
        if t.file in unreadable:
            holds = unreadable[t.file]
        elif value is None:
            holds = "owed"
        elif data.get("smoke"):
            holds = "smoke"
        elif t.bound is None:
            holds = "reported"
        else:
            holds = "yes" if {"<=": operator.le, ">=": operator.ge}[t.bound](value, t.limit) else "no"
        bound = f"{t.bound} {t.limit:g}" if t.bound else "–"
        source = f"{t.file}: {t.key}"
        rows.append({"issue": t.issue, "what": t.what, "value": value, "bound": bound, "holds": holds, "from": source})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| issue | target | measured | bound | holds | from |", "|---|---|---|---|---|---|"]
    for r in rows:
        value = "–" if r["value"] is None else f"{r['value']:.4g}"
        lines.append(f"| {r['issue']} | {r['what']} | {value} | {r['bound']} | {r['holds']} | {r['from']} |")
    return "\n".join(lines)


def unpack(archive: Path, into: Path) -> dict[str, Path]:
    """The archive's `<card>/<file>` members written as `into/<card>-<file>`, none over an existing file:
    {file: its new path}."""
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        names = [Path(m.name) for m in members]
        cards = {n.parts[0] for n in names}
        if len(cards) != 1 or any(len(n.parts) != 2 for n in names):
            raise SystemExit(f"{archive}: not a gpu_check.sh archive (one <card>/ folder of files expected)")
        card = cards.pop()
        paths = {n.name: into / f"{card}-{n.name}" for n in names}
        existing = sorted(str(p) for p in paths.values() if p.exists())
        if existing:
            raise SystemExit(f"would overwrite {', '.join(existing)}: move them away, or unpack into another folder")
        into.mkdir(parents=True, exist_ok=True)
        for member, name in zip(members, names, strict=True):
            paths[name.name].write_bytes(tar.extractfile(member).read())
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="gpu_check.sh's <card>/ folder, or its <card>-gpu-check.tar.gz")
    p.add_argument("--into", type=Path, help="unpack the archive here as <card>-<file> (never overwriting)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    if args.results.is_dir():
        files = {path.name: path for path in args.results.iterdir()}
    elif args.into is None:
        p.error(f"{args.results} is not a folder: pass --into DIR to unpack the archive")
    else:
        files = unpack(args.results, args.into)
    rows = evaluate(files)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
