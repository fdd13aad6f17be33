"""A whole training step and a whole epoch: infosieve-fast against the published InfoSieve loop.

The baseline is `benchmarks/published/train.py`: the published model (whole backbone under autograd, the frozen
parameters only `requires_grad=False`), its loss composition (`torch.cdist`, CE with label smoothing, SupCon on ground
truth and pseudo-labels, HLoss x2, NormPLoss, BCE categorizer), plain SGD, fp32, and the loss read with `.item()`
after every step as the published loop logs it. Both sides start each step from the same uint8 batch on the device and
make their two views with the same `DeviceAugment` (the CPU loaders are compared in bench_loader.py), and both use the
same random weights. torch's defaults hold for fp32 matmuls (no TF32).

Step mode (always): for each variant, `--warmup` steps, then `--steps` steps timed between CUDA events (wall clock on
the CPU), median ms/step, images/s (samples, not views), peak memory, and MFU = the step's FLOPs (counted from the
published fp32 step with torch's FlopCounterMode) / time / the card's dense bf16 GEMM rate measured in this run.
Variants:
  published_fp32    (a) the published step, fp32
  published_bf16    (b) the same under bf16 autocast, what a user tries first
  fast_default      (c) infosieve-fast with its default config
  fast_frozen_bf16  (d) + train.frozen_bf16
  fast_checkpoint   (d) + train.checkpoint_blocks (memory, not speed)
  fast_compile      (d) + train.compile (CUDA)
  fast_all          (d) + both
Epoch mode (`--epoch`): a CUB-sized in-memory train set of random uint8 images (5,994 at 256^2, 200 classes, the first
100 known, half of their images labelled with RandomState(0)) on the device; one whole epoch of each side: the feature
pass, SS-k-means pseudo-labels (10 restarts x 10 iterations, balanced) and all N // batch steps. The published
k-means (a Python loop writing its distance chunks into a CPU tensor) is run with `--ref-kmeans-inits` restarts and
timed as a phase of the epoch; its restarts are independent and cost the same, so the published epoch is reported as
the measured epoch + the k-means time x (10 - inits) / inits. `projected_200_epochs_minutes` is 200 x the epoch.

    python benchmarks/bench_train.py --device cuda --epoch --json benchmarks/results/nvidia-h100-80gb-hbm3-train.json
    python benchmarks/bench_train.py --device cpu --backbone vit_tiny_patch16_224 --batch 8 --steps 20 --warmup 3
    pytest benchmarks/bench_train.py          # the same small CPU case through pytest-benchmark

Prints one JSON document (and writes it with --json); `summary` holds the figures runs are compared by.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import device_name, git_state  # noqa: E402
from benchmarks.published import train as published  # noqa: E402
from infosieve_fast.config import apply_overrides, from_dict  # noqa: E402
from infosieve_fast.data.augment import AugmentConfig, DeviceAugment  # noqa: E402
from infosieve_fast.data.base import Batch  # noqa: E402
from infosieve_fast.data.memory import InMemoryGCD  # noqa: E402
from infosieve_fast.data.splits import gcd_split  # noqa: E402
from infosieve_fast.engine import LossMonitor, Trainer  # noqa: E402

FAST_VARIANTS = {
    "fast_default": [],
    "fast_frozen_bf16": ["train.frozen_bf16=true"],
    "fast_checkpoint": ["train.checkpoint_blocks=true"],
    "fast_compile": ["train.compile=true"],
    "fast_all": ["train.frozen_bf16=true", "train.compile=true"],
}
PUBLISHED_VARIANTS = {"published_fp32": False, "published_bf16": True}
CUDA_ONLY = {"fast_compile", "fast_all"}
KMEANS_INITS = 10  # the published and the default n_init


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bf16_gemm_tflops(device: torch.device) -> float:
    """The dense bf16 GEMM rate of this device, measured: median of 10 square matmuls."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = time_calls(lambda: a @ b, device, warmup=3, repeats=10)
    return 2 * n**3 / statistics.median(times) / 1e12


def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds per call: between CUDA events on a GPU (the host never waits inside the run), wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
    events[0].record()
    for i in range(repeats):
        fn()
        events[i + 1].record()
    sync(device)
    return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(repeats)]


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ------------------------------------------------------------------------------------------------------------ setup
def fast_config(args, overrides: list[str]) -> object:
    values = {
        "model": {
            "backbone": args.backbone, "grad_from_block": args.grad_from_block, "proj_out_dim": args.proj_out_dim,
            "backbone_kwargs": dict(args.backbone_kwargs),
        },
        "data": {
            "batch_size": args.batch, "feature_batch_size": args.feature_batch, "crop_size": args.crop,
            "source": "digits",  # placeholder: the benchmark hands the Trainer its own in-memory source
        },
        "train": {"device": str(args.device), "seed": args.seed},
    }  # fmt: skip
    return from_dict(apply_overrides(values, overrides))


def gcd_set(n: int, n_classes: int, size: int, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """Random uint8 images [n, 3, size, size] on `device`, targets over `n_classes`, the first half known, half of
    their images labelled (RandomState(0), as GCD splits)."""
    g = torch.Generator(device=device).manual_seed(seed)
    classes = torch.arange(n) % n_classes
    labelled, targets = gcd_split(classes.numpy(), list(range(n_classes // 2)), 0.5, 0)
    images = torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8, device=device)
    return images, torch.from_numpy(targets).long(), torch.from_numpy(labelled)


def step_batch(args, device: torch.device) -> tuple[Batch, torch.Tensor, int]:
    """One batch as a training step sees it, with a pseudo-label table over the sample ids; and n_old."""
    n_classes = args.n_classes
    g = torch.Generator().manual_seed(args.seed)
    images = torch.randint(0, 256, (args.batch, 3, args.image_size, args.image_size), generator=g, dtype=torch.uint8)
    labelled = torch.rand(args.batch, generator=g) < 0.57  # the published sampler's labelled share on CUB
    targets = torch.randint(0, n_classes, (args.batch,), generator=g)
    targets = torch.where(labelled, targets % (n_classes // 2), targets)
    pseudo = torch.randint(0, n_classes, (args.batch,), generator=g)
    batch = Batch(images, targets, torch.arange(args.batch), labelled).to(device)
    return batch, pseudo.to(device), n_classes // 2


def make_trainer(args, overrides: list[str], source: InMemoryGCD) -> Trainer:
    torch.manual_seed(args.seed)
    return Trainer(fast_config(args, overrides), source=source)


def make_published(args, n_old: int, device: torch.device, weights_from: Trainer) -> published.PublishedLoop:
    model = published.build_published_model(
        n_old, args.backbone, args.grad_from_block, proj_out_dim=args.proj_out_dim,
        backbone_kwargs=dict(args.backbone_kwargs),
    ).to(device)  # fmt: skip
    published.copy_weights_from_fast(model, weights_from.model)
    loop = published.PublishedLoop.build(model, n_old)
    published.set_epoch(model, 0, 200)
    return loop


# ------------------------------------------------------------------------------------------------------------- step
def step_functions(args, device: torch.device, variant: str, batch: Batch, pseudo: torch.Tensor, n_old: int):
    """(step callable, finish callable) for `variant`; `finish` checks the losses and frees the models."""
    source = InMemoryGCD(batch.images, batch.targets, batch.labelled, n_old, None)
    if variant in FAST_VARIANTS:
        trainer = make_trainer(args, FAST_VARIANTS[variant], source)
        trainer.model.labeller.set_schedule(0.1, 2.0, 2.0)
        gen = torch.Generator(device=device).manual_seed(args.seed)
        monitor = LossMonitor(0)
        return (lambda: trainer.train_step(batch, pseudo, gen, monitor)), monitor.check
    donor = make_trainer(args, [], source)  # only its weights: both sides start equal
    loop = make_published(args, n_old, device, donor)
    del donor
    augment = DeviceAugment(AugmentConfig(args.crop))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    amp = PUBLISHED_VARIANTS[variant]
    losses: list[float] = []

    def step() -> None:
        views = augment.train_views(batch.images, 2, gen)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = published.published_step(
                loop.model, loop.optimizer, loop.losses, views, batch.targets, batch.labelled, pseudo
            )
        losses.append(loss.item())  # the published loop logs loss.item() after every step

    def finish() -> float:
        if not all(math.isfinite(v) for v in losses):
            raise RuntimeError(f"{variant}: non-finite loss")
        return losses[-1]

    return step, finish


def count_step_flops(args, device: torch.device, batch: Batch, pseudo: torch.Tensor, n_old: int) -> int:
    step, _ = step_functions(args, device, "published_fp32", batch, pseudo, n_old)
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def bench_variant(args, device, variant, batch, pseudo, n_old, flops, peak_tflops) -> dict:
    free_memory(device)
    t0 = time.perf_counter()
    step, finish = step_functions(args, device, variant, batch, pseudo, n_old)
    step()  # first call: kernel compilation, torch.compile, allocator growth
    sync(device)
    first_s = time.perf_counter() - t0
    free_memory(device)  # resets the peak: the steady-state peak of the timed steps is reported
    times = time_calls(step, device, args.warmup, args.steps)
    last_loss = finish()
    ms = statistics.median(times) * 1e3
    return {
        "ms_per_step": ms,
        "ms_per_step_min": min(times) * 1e3,
        "ms_per_step_max": max(times) * 1e3,
        "images_per_s": args.batch / (ms / 1e3),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "mfu": flops / (ms / 1e3) / (peak_tflops * 1e12),
        "setup_and_first_step_s": first_s,
        "last_loss": last_loss,
    }


class StepBench:
    """The step variants on one shared batch; the FLOPs are counted once, from the published fp32 step."""

    def __init__(self, args, device: torch.device, peak_tflops: float):
        self.args, self.device, self.peak = args, device, peak_tflops
        self.batch, self.pseudo, self.n_old = step_batch(args, device)
        self.flops = count_step_flops(args, device, self.batch, self.pseudo, self.n_old)
        self.results: dict[str, dict] = {}

    def run(self, variants: list[str], on_result: Callable[[dict], None]) -> None:
        for variant in variants:
            if variant in CUDA_ONLY and self.device.type != "cuda":
                continue
            try:
                self.results[variant] = bench_variant(
                    self.args, self.device, variant, self.batch, self.pseudo, self.n_old, self.flops, self.peak
                )
            except Exception as err:  # one variant failing (e.g. torch.compile) must not cost the others' numbers
                self.results[variant] = {"error": f"{type(err).__name__}: {err}"[:2000]}
            print(f"{variant:18s} {self.results[variant]}", file=sys.stderr, flush=True)
            on_result(self.report())

    def report(self) -> dict:
        return {"flops_per_step": self.flops, "variants": self.results}


# ------------------------------------------------------------------------------------------------------------ epoch
def bench_epoch(args, device: torch.device, variant: str) -> dict:
    images, targets, labelled = gcd_set(args.n_train, args.n_classes, args.image_size, device, args.seed)
    n_old = args.n_classes // 2
    source = InMemoryGCD(images, targets.to(device), labelled.to(device), n_old, None)
    trainer = make_trainer(args, FAST_VARIANTS[variant], source)
    trainer.cfg.train.max_steps_per_epoch = 2
    trainer.train_epoch(0)  # warm-up: every kernel and k-means path once
    trainer.cfg.train.max_steps_per_epoch = None
    sync(device)
    t0 = time.perf_counter()
    record = trainer.train_epoch(1)
    sync(device)
    fast_s = time.perf_counter() - t0

    loop = make_published(args, n_old, device, trainer)
    del trainer
    free_memory(device)
    augment = DeviceAugment(AugmentConfig(args.crop))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    inits = args.ref_kmeans_inits
    kmeans_kwargs = {"n_init": inits, "max_iter": 10, "sqdist_mode": "broadcast", "random_state": 0}
    sync(device)
    t0 = time.perf_counter()
    result = published.published_epoch(
        loop, images, targets, labelled, args.n_classes, batch_size=args.batch, epoch=1, epochs=200, augment=augment.
        train_views, generator=gen, sampler_generator=torch.Generator().manual_seed(args.seed),
        feature_batch_size=args.published_feature_batch, kmeans_kwargs=kmeans_kwargs,
    )  # fmt: skip
    losses = [float(v) for v in result.losses]
    sync(device)
    measured_s = time.perf_counter() - t0
    kmeans_s = result.seconds["kmeans"]
    published_s = measured_s + kmeans_s * (KMEANS_INITS - inits) / inits
    if not all(math.isfinite(v) for v in losses) or not math.isfinite(record["loss_total"]):
        raise RuntimeError("non-finite loss in the epoch benchmark")
    return {
        "variant": variant,
        "n_train": args.n_train,
        "steps": record["steps"],
        "published_steps": len(losses),
        "epoch_seconds": fast_s,
        "phase_seconds": {k: record[f"seconds_{k}"] for k in ("features", "kmeans", "steps")},
        "published_epoch_seconds": published_s,
        "published_epoch_measured_seconds": measured_s,
        "published_phase_seconds_measured": result.seconds,
        "published_kmeans_seconds_per_restart": kmeans_s / inits,
        "published_kmeans_restarts_measured": inits,
        "speedup": published_s / fast_s,
        "projected_200_epochs_minutes": 200 * fast_s / 60,
        "published_projected_200_epochs_minutes": 200 * published_s / 60,
    }


# ------------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--backbone", default="vit_base_patch16_224")
    p.add_argument("--backbone-kwargs", default="{}", help="JSON dict for timm.create_model, e.g. '{\"img_size\": 64}'")
    p.add_argument("--grad-from-block", type=int, default=10)
    p.add_argument("--proj-out-dim", type=int, default=65536)
    p.add_argument("--batch", type=int, default=128, help="samples per step (two views each)")
    p.add_argument("--image-size", type=int, default=256, help="stored image size (the crop is taken from it)")
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--n-classes", type=int, default=200)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variants", default=None, help="comma list; default: all that run on the device")
    p.add_argument("--epoch", action="store_true", help="also time a whole epoch against the published epoch")
    p.add_argument("--epoch-variants", default="fast_default", help="comma list of fast variants for --epoch")
    p.add_argument("--n-train", type=int, default=5994)
    p.add_argument("--feature-batch", type=int, default=1024, help="infosieve-fast's feature-pass batch")
    p.add_argument("--published-feature-batch", type=int, default=128, help="the published feature pass's batch")
    p.add_argument("--ref-kmeans-inits", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device = torch.device(args.device)
    args.backbone_kwargs = json.loads(args.backbone_kwargs)
    known = [*PUBLISHED_VARIANTS, *FAST_VARIANTS]
    args.variants = args.variants.split(",") if args.variants else known
    args.epoch_variants = args.epoch_variants.split(",")
    unknown = sorted(set(args.variants + args.epoch_variants) - set(known))
    if unknown:
        p.error(f"unknown variant(s) {unknown}: choose from {known}")
    if not set(args.epoch_variants) <= set(FAST_VARIANTS):
        p.error(f"--epoch-variants takes fast variants only: {list(FAST_VARIANTS)}")
    if not 1 <= args.ref_kmeans_inits <= KMEANS_INITS:
        p.error(f"--ref-kmeans-inits must be in 1..{KMEANS_INITS}")
    return args


def summarise(steps: dict, epochs: list[dict]) -> dict:
    v = {k: r for k, r in steps.get("variants", {}).items() if "error" not in r}
    epochs = [e for e in epochs if "error" not in e]
    fast = [k for k in FAST_VARIANTS if k in v]
    fastest = min(fast, key=lambda k: v[k]["ms_per_step"]) if fast else None

    def ratio(num: str, den: str, key: str) -> float | None:
        if num in v and den in v and v[num][key] and v[den][key]:
            return v[num][key] / v[den][key]
        return None

    default_epoch = next((e for e in epochs if e["variant"] == "fast_default"), None)
    best_epoch = min(epochs, key=lambda e: e["epoch_seconds"]) if epochs else None
    return {
        "step_speedup_vs_published_fp32": ratio("published_fp32", "fast_default", "ms_per_step"),
        "step_speedup_vs_published_bf16": ratio("published_bf16", "fast_default", "ms_per_step"),
        "peak_memory_ratio_vs_published_fp32": ratio("fast_default", "published_fp32", "peak_memory_gib"),
        "step_mfu": v["fast_default"]["mfu"] if "fast_default" in v else None,
        "epoch_seconds": default_epoch["epoch_seconds"] if default_epoch else None,
        "published_epoch_seconds": best_epoch["published_epoch_seconds"] if best_epoch else None,
        "projected_200_epochs_minutes": default_epoch["projected_200_epochs_minutes"] if default_epoch else None,
        "fastest_step_variant": fastest,
        "fastest_step_speedup_vs_published_fp32": ratio("published_fp32", fastest, "ms_per_step") if fastest else None,
        "fastest_step_speedup_vs_published_bf16": ratio("published_bf16", fastest, "ms_per_step") if fastest else None,
        "fastest_step_mfu": v[fastest]["mfu"] if fastest else None,
        "fastest_step_peak_memory_ratio_vs_published_fp32": ratio(fastest, "published_fp32", "peak_memory_gib")
        if fastest
        else None,
        "fastest_epoch_variant": best_epoch["variant"] if best_epoch else None,
        "fastest_epoch_seconds": best_epoch["epoch_seconds"] if best_epoch else None,
        "fastest_projected_200_epochs_minutes": best_epoch["projected_200_epochs_minutes"] if best_epoch else None,
    }


def run(args: argparse.Namespace, emit: Callable[[dict], None] = lambda report: None) -> dict:
    """The whole benchmark; `emit(report)` is called after every variant, so a run cut short keeps what it measured."""
    device = args.device
    commit, dirty = git_state()
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's default, stated: the fp32 baseline is true fp32
    report = {
        "benchmark": "bench_train",
        "command": " ".join(["python", "benchmarks/bench_train.py", *sys.argv[1:]]),
        "commit": commit,
        "dirty": dirty,
        "device": device_name(device),
        "torch": torch.__version__,
        "settings": {k: (str(v) if isinstance(v, torch.device) else v) for k, v in vars(args).items() if k != "json"},
        "bf16_gemm_tflops": bf16_gemm_tflops(device),
        "summary": {},
        "step": {},
        "epoch": [],
        "notes": (
            "baseline: benchmarks/published/train.py (published model, loss and SGD; fp32 or bf16 autocast; "
            "loss.item() per step as the published loop logs it). Same uint8 batch, same device augmentation and "
            "same initial weights on both sides. Step times: median between CUDA events (wall clock on the CPU). "
            "MFU against the bf16 GEMM rate measured here. Published epoch: measured with ref_kmeans_inits "
            "k-means restarts, plus one restart's time for each missing restart up to 10."
        ),
    }

    def update(steps: dict | None = None) -> None:
        if steps is not None:
            report["step"] = steps
        report["summary"] = summarise(report["step"], report["epoch"])
        emit(report)

    steps = StepBench(args, device, report["bf16_gemm_tflops"])
    # The torch.compile variants compile for a minute or more: they run last, after the epochs, so a run cut short by a
    # time limit keeps every other number.
    steps.run([v for v in args.variants if v not in CUDA_ONLY], update)
    if args.epoch:
        for variant in args.epoch_variants:
            free_memory(device)
            try:
                report["epoch"].append(bench_epoch(args, device, variant))
            except Exception as err:
                report["epoch"].append({"variant": variant, "error": f"{type(err).__name__}: {err}"[:2000]})
            print(f"epoch {variant}: {report['epoch'][-1]}", file=sys.stderr, flush=True)
            update()
    steps.run([v for v in args.variants if v in CUDA_ONLY], update)
    return report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    def write(report: dict) -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")

    report = run(args, write)
    print(json.dumps(report, indent=2))
    return report


# ----------------------------------------------------------------------------------------------- pytest-benchmark
SMALL_CPU_CASE = [
    "--device", "cpu", "--backbone", "vit_tiny_patch16_224", "--backbone-kwargs", '{"img_size": 64}',
    "--batch", "8", "--image-size", "72", "--crop", "64", "--n-classes", "8", "--grad-from-block", "10",
]  # fmt: skip


def _step_for_pytest(variant: str):
    args = parse_args(SMALL_CPU_CASE)
    batch, pseudo, n_old = step_batch(args, args.device)
    return step_functions(args, args.device, variant, batch, pseudo, n_old)


def test_published_step_speed(benchmark):
    step, finish = _step_for_pytest("published_fp32")
    benchmark(step)
    assert math.isfinite(finish())


def test_fast_step_speed(benchmark):
    step, finish = _step_for_pytest("fast_default")
    benchmark(step)
    assert math.isfinite(finish())


if __name__ == "__main__":
    main()
