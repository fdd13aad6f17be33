"""A whole training step and a whole epoch: infosieve-fast against the published InfoSieve loop.

The baseline is `benchmarks/published/train.py`: the published model (whole backbone under autograd, the frozen
parameters only `requires_grad=False`), its loss composition (`torch.cdist`, CE with label smoothing, SupCon on ground
truth and pseudo-labels, HLoss x2, NormPLoss, BCE categorizer), plain SGD, fp32. Both sides start each step from the
same uint8 batch on the device and make their two views with the same `DeviceAugment` (the CPU loaders are compared in
bench_loader.py), and both use the same random weights. torch's defaults hold for fp32 matmuls (no TF32).

Step mode (unless `--variants none`): for each variant, `--warmup` steps, then `--steps` steps timed between CUDA
events (wall clock on the CPU), median ms/step, images/s (samples, not views), peak memory, and MFU = the step's
FLOPs (counted from the published fp32 step with torch's FlopCounterMode) / time / a bf16 peak, twice:
`mfu_measured_gemm` against the dense bf16 GEMM rate measured in this run, `mfu_datasheet` against the card's
datasheet peak (`benchmarks/datasheet.py`; null for a card not in that table and for the CPU). The published step
reads `loss.item()` after every step. Variants, in report order (the default and its fairest baseline first):
  fast_default      infosieve-fast with its default config (on CUDA: torch.compile, train.compile=auto)
  fast_eager        fast_default + train.compile=off + train.checkpoint_blocks=off (the default before compiling and
                    recomputing were: what earlier results call fast_default)
  published_bf16    the published step under bf16 autocast, what a user tries first
  published_fp32    the published step, fp32
  fast_frozen_bf16  fast_default + train.frozen_bf16
  fast_checkpoint   fast_default + train.checkpoint_blocks=on (the trained blocks recomputed: memory, not speed)
  fast_all          fast_default + train.frozen_bf16, compiled (train.compile=on; CUDA)
  fast_graph        fast_default + train.cuda_graph=on: the step replayed from a CUDA graph (CUDA); its eager warm-up
                    steps and its capture run before the timed steps (`cuda_graph_captures`,
                    `seconds_cuda_graph_capture`)
A variant that needs CUDA is recorded as {"skipped": reason} on the CPU.

Method rows (`--methods gcd,simgcd,selex`): for each method, its step in infosieve-fast (`fast_default` with
`method=<name>`) against that method's published step (`published_fp32`, `published_bf16`), on the same batch, each
method's FLOPs counted from its own published fp32 step (`benchmarks/method_steps.py` says what each side runs).
They go into `methods.<name>` (`variants`, and `summary` with the step speedups against the two published steps),
after InfoSieve's variants (`--variants none` for the method rows alone).

Epoch mode (`--epoch`): a CUB-sized in-memory train set of random uint8 images (5,994 at 256^2, 200 classes, the first
100 known, half of their images labelled by the GCD split, RandomState(0)) and a test split (5,794, every class) on the
device. Every k-means of both sides clusters synthetic features with class structure, of the real size, instead of the
random network's features of noise images (which have none, so the k-means would time an easy case): per class a mean
on the unit sphere, per sample L2-normalise(mean + s N(0, I)), s = `--stand-in-noise` (0.03, bench_kmeans' recipe),
seeded with `--seed`; N_train x the backbone's width for the pseudo-labels, N_train x the code length for the
published code k-means, N_test x the width for its test k-means (the train set's class means). The labelled subset is
the GCD split's. The feature passes still run the real network on the images and are timed.
For each of `--epoch-variants`:
  fast epoch        `Trainer.train_epoch` after a 2-step warm-up epoch: the feature pass, SS-k-means pseudo-labels
                    (10 restarts x 10 iterations, balanced) and all N // batch steps (`epoch_seconds`), then the
                    checkpoint `infosieve train` writes after every epoch (`checkpoint_seconds` in the foreground;
                    `epoch_with_checkpoint_seconds` is the sum; by default training waits only for a host snapshot,
                    `checkpoint_snapshot_seconds`, while a thread writes it, `checkpoint_write_seconds`, during the
                    next epoch: `epoch_cycle_seconds` = snapshot + max(epoch, write), and
                    `projected_200_epochs_with_checkpoint_minutes` is 200 of those), then an evaluation
                    (test-view pass, k-means, scoring) twice: `evaluation_seconds` records the frozen prefix's
                    tokens where the token cache applies (`token_cache`: where they are kept),
                    `evaluation_replay_seconds` replays them;
  published_epoch_minimal
                    measured on the same weights right after: the minimal composition (feature pass, pseudo-label
                    k-means, steps), as `published_epoch` runs it without `released`;
  published_epoch_as_released
                    the next published epoch, with the work the published loop really does every epoch
                    (`published_epoch(released=...)`: the codes in the pseudo-label pass and their k-means, the loop's
                    per-step `.item()` records, the test-split pass and its three kmeans_pytorch runs, the scoring of
                    every clustering, the three per-epoch `torch.save`s into a temporary folder).
The published pseudo-label k-means (a Python loop writing its distance chunks into a CPU tensor) runs with
`--ref-kmeans-inits` restarts; its restarts are independent and cost the same, so its phase is projected to 10 restarts.
With `--as-released-subset IMAGES`, the as-released epoch's per-image phases (the train and test feature passes and the
steps) run over IMAGES images (IMAGES // batch steps) and are scaled to the full size; its k-means runs, scoring and
saves run in full. Every projection is recorded (`projection_factors`, measured and projected phase seconds).
`projected_200_epochs_minutes` is 200 x an epoch.

`summary` holds the figures runs are compared by. Every ratio in it is {"value", "numerator", "denominator"}, the two
being paths into this report, so each names its variants; an epoch ratio always pairs a fast epoch with the published
epochs measured alongside that same variant.

    python -m benchmarks.bench_train --device cuda --epoch --json benchmarks/results/nvidia-h100-80gb-hbm3-train.json
    python -m benchmarks.bench_train --device cpu --backbone vit_tiny_patch16_224 --batch 8 --steps 20 --warmup 3
    pytest benchmarks/bench_train.py          # the same small CPU case through pytest-benchmark

Prints one JSON document at the end (`benchmarks.tools.provenance.emit_json`); with --json it is written there after
every variant, so a run cut short keeps what it measured. INFOSIEVE_BENCH_SMOKE=1 (benchmarks/smoke.py) runs 2 steps
after 1 warm-up step and gives every size left at its default its smoke value (`SMOKE_*` below).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import datasheet, method_steps, smoke
from benchmarks.harness import ItemLog, Stopwatch, at, call_times, sync, timed
from benchmarks.published import train as published
from benchmarks.tools.provenance import device_name, emit_json, stamp, versions
from infosieve_fast.common.precision import set_cuda_matmul_tf32
from infosieve_fast.config.settings import apply_overrides, from_dict
from infosieve_fast.data.reading.augment import AugmentConfig, DeviceAugment
from infosieve_fast.data.reading.base import Batch
from infosieve_fast.data.reading.memory import InMemoryGCD
from infosieve_fast.data.splits import gcd_split
from infosieve_fast.training import checkpoint as ckpt
from infosieve_fast.training.engine import FeatureSet, Trainer
from infosieve_fast.training.loss_monitor import LossMonitor
from infosieve_fast.training.step_graph import WARMUP_STEPS

FAST_VARIANTS = {
    "fast_default": [],
    "fast_eager": ["train.compile=off", "train.checkpoint_blocks=off"],
    "fast_frozen_bf16": ["train.frozen_bf16=true"],
    "fast_checkpoint": ["train.checkpoint_blocks=on"],
    "fast_all": ["train.frozen_bf16=true", "train.compile=on"],
    "fast_graph": ["train.cuda_graph=on"],
}
PUBLISHED_VARIANTS = {"published_fp32": False, "published_bf16": True}  # the value: bf16 autocast
REPORT_ORDER = (
    "fast_default",
    "published_bf16",
    "published_fp32",
    "fast_eager",
    "fast_frozen_bf16",
    "fast_checkpoint",
    "fast_all",
    "fast_graph",
)
DEFAULT, FAIREST_BASELINE = "fast_default", "published_bf16"
CUDA_ONLY = {
    "fast_all": "needs CUDA: train.compile=on (torch.compile) is CUDA only",
    "fast_graph": "needs CUDA: train.cuda_graph=on (a CUDA graph) is CUDA only",
}
KMEANS_INITS = 10  # the published and the default n_init

# Smoke size (benchmarks/smoke.py, INFOSIEVE_BENCH_SMOKE=1): the steps always; every size the command leaves at its
# default, the backbone and its input geometry as one group (a command that names its backbone keeps its crop).
SMOKE_STEPS = {"steps": 2, "warmup": 1}
SMOKE_GEOMETRY = {
    "backbone": "vit_tiny_patch16_224",
    "backbone_kwargs": '{"img_size": 32}',
    "crop": 32,
    "image_size": 40,
}
# A batch of 8: the published loss fails on a batch without a labelled sample (SupCon over no rows), as published.
SMOKE_SIZES = {
    "batch": 8,
    "n_train": 32,
    "n_test": 16,
    "feature_batch": 16,
    "published_feature_batch": 16,
    "proj_out_dim": 256,
    "n_classes": 8,
}


def bf16_gemm_tflops(device: torch.device) -> float:
    """The dense bf16 GEMM rate of this device, measured: median of 10 square matmuls."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = call_times(lambda: a @ b, device, warmup=3, repeats=10).seconds
    return 2 * n**3 / statistics.median(times) / 1e12


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def failure(err: Exception) -> dict:
    return {"error": f"{type(err).__name__}: {err}"[:2000]}


# ------------------------------------------------------------------------------------------------------------ setup
def fast_config(args, overrides: list[str]) -> object:
    """The config of a fast variant. `data.source` stays unset: the benchmark hands the Trainer its own in-memory
    source, so no source of the config is ever built or checked against the crop."""
    values = {
        "model": {
            "backbone": args.backbone,
            "grad_from_block": args.grad_from_block,
            "proj_out_dim": args.proj_out_dim,
            "backbone_kwargs": dict(args.backbone_kwargs),
        },
        "data": {"batch_size": args.batch, "feature_batch_size": args.feature_batch, "crop_size": args.crop},
        "train": {"device": str(args.device), "seed": args.seed},
    }
    return from_dict(apply_overrides(values, overrides))


def labelled_classes(n: int, n_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets `i % n_classes` of n samples, and the GCD split's labelled mask (the first half of the classes known,
    half of their images labelled, RandomState(0))."""
    classes = torch.arange(n) % n_classes
    labelled, targets = gcd_split(classes.numpy(), list(range(n_classes // 2)), 0.5, 0)
    return torch.from_numpy(targets).long(), torch.from_numpy(labelled)


def random_images(n: int, size: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, size, size), generator=generator, dtype=torch.uint8, device=device)


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


class StandInTrainer(Trainer):
    """A Trainer whose feature passes run the network (and are timed) but hand the k-means `stand_in[uq]` (features
    with class structure, see the module docstring) once `stand_in` is set."""

    stand_in: torch.Tensor | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        features = self.evaluator.features

        def stood_in(view: str, seed: int = 0, embed=None) -> FeatureSet:
            fs = features(view, seed, embed)
            return fs if self.stand_in is None else dataclasses.replace(fs, feats=self.stand_in[fs.uq])

        self.evaluator.features = stood_in


def make_trainer(args, overrides: list[str], source: InMemoryGCD, cls: type[Trainer] = Trainer) -> Trainer:
    torch.manual_seed(args.seed)
    return cls(fast_config(args, overrides), source=source)


def make_published(args, n_old: int, device: torch.device, weights_from: Trainer) -> published.PublishedLoop:
    model = published.build_published_model(
        n_old,
        args.backbone,
        args.grad_from_block,
        proj_out_dim=args.proj_out_dim,
        backbone_kwargs=dict(args.backbone_kwargs),
    ).to(device)
    published.copy_weights_from_fast(model, weights_from.model)
    loop = published.PublishedLoop.build(model, n_old)
    published.set_epoch(model, 0, 200)
    return loop


# ------------------------------------------------------------------------------------------------------------- step
def step_functions(args, device: torch.device, variant: str, batch: Batch, pseudo: torch.Tensor, n_old: int):
    """(step callable, finish callable, details callable) for `variant`; `finish` checks the losses and frees the
    models, `details` gives the paths that ran (compiled or eager, graph or eager). A fast variant compiles as
    `train.compile` says before its first step (`Trainer.compile_once`)."""
    source = InMemoryGCD(batch.images, batch.targets, batch.labelled, n_old, None)
    if variant in FAST_VARIANTS:
        trainer = make_trainer(args, FAST_VARIANTS[variant], source)
        trainer.model.labeller.set_schedule(0.1, 2.0, 2.0)
        gen = torch.Generator(device=device).manual_seed(args.seed)
        monitor = LossMonitor(0)
        trainer.compile_once()
        details = lambda: {**trainer.compiled.fields(), **trainer.step_graph.fields()}  # noqa: E731
        return (lambda: trainer.train_step(batch, pseudo, gen, monitor)), monitor.check, details
    donor = make_trainer(args, [], source)  # only its weights: both sides start equal
    loop = make_published(args, n_old, device, donor)
    del donor
    augment = DeviceAugment(AugmentConfig(args.crop))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    amp = PUBLISHED_VARIANTS[variant]
    losses = ItemLog(variant)

    def step() -> None:
        views = augment.train_views(batch.images, 2, gen)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = published.published_step(
                loop.model, loop.optimizer, loop.losses, views, batch.targets, batch.labelled, pseudo
            )
        losses.record(loss)  # the published loop logs loss.item() after every step

    return step, losses.last, dict


def method_step_functions(method: str) -> Callable:
    """`step_functions` for `method`'s rows (`benchmarks/method_steps.py`): its fast step and its published step."""

    def make(args, device: torch.device, variant: str, batch: Batch, pseudo: torch.Tensor, n_old: int):
        config = fast_config(args, method_steps.fast_overrides(args, method))
        return method_steps.step_functions(args, device, method, variant, batch, n_old, config)

    return make


def count_step_flops(args, device, batch: Batch, pseudo: torch.Tensor, n_old: int, make=step_functions) -> int:
    step, _, _ = make(args, device, "published_fp32", batch, pseudo, n_old)
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def bench_variant(
    args, device, variant, batch, pseudo, n_old, flops: int, peaks: dict[str, float | None], make=step_functions
) -> dict:
    free_memory(device)
    with timed(device) as first:
        step, finish, details = make(args, device, variant, batch, pseudo, n_old)
        step()  # first call: kernel compilation, allocator growth (and the compile, `seconds_compile`, before it)
        if details().get("cuda_graph") == "graph":  # the eager warm-up and the capture stay out of the timed steps
            for _ in range(max(0, WARMUP_STEPS - args.warmup)):
                step()
    free_memory(device)  # resets the peak: the steady-state peak of the timed steps is reported
    times = call_times(step, device, args.warmup, args.steps).seconds
    last_loss = finish()
    seconds = statistics.median(times)
    return {
        "ms_per_step": seconds * 1e3,
        "ms_per_step_min": min(times) * 1e3,
        "ms_per_step_max": max(times) * 1e3,
        "images_per_s": args.batch / seconds,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        **{f"mfu_{name}": flops / seconds / (tflops * 1e12) if tflops else None for name, tflops in peaks.items()},
        "setup_and_first_step_s": first.seconds,
        **details(),
        "last_loss": last_loss,
    }


def in_report_order(results: dict[str, dict]) -> dict[str, dict]:
    return {v: results[v] for v in REPORT_ORDER if v in results}


class StepBench:
    """The step variants on one shared batch; the FLOPs are counted once, from the published fp32 step, before the
    first variant runs (none runs: no count, `flops_per_step` null). `peaks`: the
    bf16 rates MFU is reported against ({"measured_gemm": TFLOPS, "datasheet": TFLOPS or None}). `make`: the variants'
    `step_functions` (InfoSieve's, or a method's: `method_step_functions`)."""

    def __init__(self, args, device: torch.device, peaks: dict[str, float | None], make=step_functions):
        self.args, self.device, self.peaks, self.make = args, device, peaks, make
        self.batch, self.pseudo, self.n_old = step_batch(args, device)
        self.flops: int | None = None
        self.results: dict[str, dict] = {}

    def run(self, variants: list[str], on_result: Callable[[], None]) -> None:
        if variants and self.flops is None:
            self.flops = count_step_flops(self.args, self.device, self.batch, self.pseudo, self.n_old, self.make)
        for variant in variants:
            if variant in CUDA_ONLY and self.device.type != "cuda":
                self.results[variant] = {"skipped": CUDA_ONLY[variant]}
            else:
                try:
                    self.results[variant] = bench_variant(
                        self.args, self.device, variant, self.batch, self.pseudo, self.n_old, self.flops, self.peaks,
                        self.make,
                    )  # fmt: skip
                except Exception as err:  # one variant failing (e.g. torch.compile) must not cost the others' numbers
                    self.results[variant] = failure(err)
            print(f"{variant:18s} {self.results[variant]}", file=sys.stderr, flush=True)
            on_result()

    def report(self) -> dict:
        return {"flops_per_step": self.flops, "variants": in_report_order(self.results)}


# ------------------------------------------------------------------------------------------------------------ epoch
@dataclasses.dataclass
class EpochData:
    """The epoch benchmark's train set (on the device) and test split (images on the device, targets on the CPU, as
    the published test loader delivers them)."""

    images: torch.Tensor
    targets: torch.Tensor
    labelled: torch.Tensor
    test_images: torch.Tensor
    test_targets: torch.Tensor


def epoch_data(args, device: torch.device) -> EpochData:
    g = torch.Generator(device=device).manual_seed(args.seed)
    targets, labelled = labelled_classes(args.n_train, args.n_classes)
    images = random_images(args.n_train, args.image_size, device, g)
    test_images = random_images(args.n_test, args.image_size, device, g)
    test_targets = torch.arange(args.n_test) % args.n_classes
    return EpochData(images, targets.to(device), labelled.to(device), test_images, test_targets)


def clustered_features(targets: torch.Tensor, means: torch.Tensor, noise: float, generator: torch.Generator):
    """L2-normalise(means[target] + noise * N(0, I)) per sample [len(targets), D] (CPU): features with class
    structure."""
    draws = torch.randn(len(targets), means.shape[1], generator=generator)
    return F.normalize(means[targets.cpu()] + noise * draws, dim=1)


def stand_in_features(args, data: EpochData, feat_dim: int, code_length: int) -> published.StandIns:
    """What every k-means of the epoch benchmark clusters (see the module docstring), seeded with `--seed`, on the
    device: class means on the unit sphere, shared by the train and test features, and their noisy samples."""
    g = torch.Generator().manual_seed(args.seed)
    feat_means = F.normalize(torch.randn(args.n_classes, feat_dim, generator=g), dim=1)
    code_means = F.normalize(torch.randn(args.n_classes, code_length, generator=g), dim=1)
    noise = args.stand_in_noise
    train = clustered_features(data.targets, feat_means, noise, g)
    codes = clustered_features(data.targets, code_means, noise, g)
    test = clustered_features(data.test_targets, feat_means, noise, g)
    device = data.images.device
    return published.StandIns(train.to(device), codes.to(device), test.to(device))


def time_fast_epoch(trainer: Trainer, device: torch.device) -> dict:
    """A warm-up epoch of 2 steps (the compile, every kernel and k-means path once), then one whole epoch, then the
    checkpoint `infosieve train` writes after it, then two evaluations (`train.eval_every`'s, and those before and
    after training): the first records the test view's frozen-prefix tokens where the token cache applies, the second
    replays them."""
    trainer.cfg.train.max_steps_per_epoch = 2
    trainer.train_epoch(0)
    trainer.cfg.train.max_steps_per_epoch = None
    with timed(device) as epoch:
        record = trainer.train_epoch(1)
    epoch_s = epoch.seconds
    if not math.isfinite(record["loss_total"]):
        raise RuntimeError("non-finite loss in the fast epoch")
    checkpoint = time_checkpoint(trainer)
    checkpoint_s = checkpoint["checkpoint_seconds"]
    cycle_s = checkpoint["checkpoint_snapshot_seconds"] + max(epoch_s, checkpoint["checkpoint_write_seconds"])
    evaluations = []
    for _ in range(2):
        with timed(device) as evaluation:
            trainer.evaluate()
        evaluations.append(evaluation.seconds)
    return {
        "steps": record["steps"],
        "epoch_seconds": epoch_s,
        "phase_seconds": {k: record[f"seconds_{k}"] for k in ("features", "kmeans", "steps")},
        **checkpoint,
        "epoch_with_checkpoint_seconds": epoch_s + checkpoint_s,
        "epoch_cycle_seconds": cycle_s,
        "projected_200_epochs_with_checkpoint_minutes": 200 * cycle_s / 60,
        "evaluation_seconds": evaluations[0],
        "evaluation_replay_seconds": evaluations[1],
        "token_cache": dict(trainer.token_cache.placement),  # split -> where its tokens are kept
        "projected_200_epochs_minutes": 200 * epoch_s / 60,
        **trainer.compiled.fields(),
    }


def time_checkpoint(trainer: Trainer) -> dict:
    """The per-epoch checkpoint, written both ways `infosieve train` can: in the foreground
    (`train.background_checkpoint=false`: `checkpoint_seconds`), and as the default does, where training waits only
    for the host snapshot (`checkpoint_snapshot_seconds`) while a writer thread serialises and fsyncs it during the
    next epoch (`checkpoint_write_seconds`)."""
    state = trainer.state_dict(2, {})
    with tempfile.TemporaryDirectory() as run_dir:
        with timed() as foreground:
            ckpt.save_checkpoint(run_dir, state)
        sync(trainer.device)
        clock = Stopwatch()
        ckpt.save_checkpoint_in_background(run_dir, state)
        snapshot = clock.seconds()
        ckpt.wait_for_checkpoint()
        write = clock.seconds() - snapshot
    return {
        "checkpoint_seconds": foreground.seconds,
        "checkpoint_snapshot_seconds": snapshot,
        "checkpoint_write_seconds": write,
    }


def time_published_epoch(
    args, loop: published.PublishedLoop, data: EpochData, stand_ins: published.StandIns, epoch: int, as_released: bool
) -> dict:
    """One published epoch on the loop's current weights, its phases and their projections (k-means restarts to 10,
    `--as-released-subset` phases to the full size)."""
    device = data.images.device
    augment = DeviceAugment(AugmentConfig(args.crop))
    inits = args.ref_kmeans_inits
    kwargs = dict(
        batch_size=args.batch,
        epoch=epoch,
        epochs=200,
        augment=augment.train_views,
        generator=torch.Generator(device=device).manual_seed(args.seed + epoch),
        sampler_generator=torch.Generator().manual_seed(args.seed + epoch),
        feature_batch_size=args.published_feature_batch,
        stand_ins=stand_ins,
        kmeans_kwargs={"n_init": inits, "max_iter": 10, "sqdist_mode": "broadcast", "random_state": args.seed},
    )
    with tempfile.TemporaryDirectory() as save_dir:
        if as_released:
            test = (data.test_images, data.test_targets, augment.test_view)
            kwargs["released"] = published.ReleasedWork(*test, save_dir)
            kwargs["max_images"] = args.as_released_subset
        with timed(device) as measured:
            result = published.published_epoch(loop, data.images, data.targets, data.labelled, args.n_classes, **kwargs)
            losses = [float(v) for v in result.losses]
        measured_s = measured.seconds
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"non-finite loss in the published epoch {epoch}")
    factors = {k: f for k, f in {**result.scale, "kmeans": KMEANS_INITS / inits}.items() if f != 1}
    phases = {k: s * factors.get(k, 1.0) for k, s in result.seconds.items()}
    seconds = measured_s + sum(phases.values()) - sum(result.seconds.values())
    out = {
        "seconds": seconds,
        "measured_seconds": measured_s,
        "phase_seconds": phases,
        "phase_seconds_measured": result.seconds,
        "projection_factors": factors,
        "kmeans_restarts_measured": inits,
        "subset_images": kwargs.get("max_images"),
        "steps_measured": len(losses),
        "projected_200_epochs_minutes": 200 * seconds / 60,
    }
    if as_released:
        out.update(step_log=result.step_log, accuracies=result.accuracies)
    return out


def bench_epoch(args, data: EpochData, variant: str) -> dict:
    """One fast epoch of `variant`, then the two published epochs on the weights it left (see the module docstring)."""
    device = data.images.device
    n_old = args.n_classes // 2
    source = InMemoryGCD(data.images, data.targets, data.labelled, n_old, None)
    trainer = make_trainer(args, FAST_VARIANTS[variant], source, StandInTrainer)
    stand_ins = stand_in_features(args, data, trainer.model.backbone.feat_dim, trainer.cfg.model.code_length)
    trainer.stand_in = stand_ins.train
    fast = time_fast_epoch(trainer, device)
    loop = make_published(args, n_old, device, trainer)
    del trainer
    free_memory(device)
    return {
        "variant": variant,
        "n_train": args.n_train,
        "n_test": args.n_test,
        **fast,
        "published_epoch_minimal": time_published_epoch(args, loop, data, stand_ins, 1, as_released=False),
        "published_epoch_as_released": time_published_epoch(args, loop, data, stand_ins, 2, as_released=True),
    }


# ----------------------------------------------------------------------------------------------------------- summary
def ratio(report: dict, numerator: str, denominator: str) -> dict:
    """{"value": report[numerator] / report[denominator] (None unless both are there and non-zero), and the paths}."""
    num, den = at(report, numerator), at(report, denominator)
    value = num / den if isinstance(num, (int, float)) and isinstance(den, (int, float)) and num and den else None
    return {"value": value, "numerator": numerator, "denominator": denominator}


def step_ratio(report: dict, baseline: str, variant: str, key: str = "ms_per_step") -> dict:
    """A step speedup: the baseline's `key` over the variant's (for memory pass them the other way round)."""
    return ratio(report, f"step.variants.{baseline}.{key}", f"step.variants.{variant}.{key}")


def epoch_ratios(report: dict, variant: str) -> dict[str, dict]:
    """The epoch speedups of `variant` against the published epochs measured alongside it: the minimal one against
    the fast epoch, the as-released one against the fast epoch with its checkpoint (each what a user waits for)."""
    e = f"epoch.{variant}"
    return {
        "vs_published_minimal": ratio(report, f"{e}.published_epoch_minimal.seconds", f"{e}.epoch_seconds"),
        "vs_published_as_released": ratio(
            report, f"{e}.published_epoch_as_released.seconds", f"{e}.epoch_with_checkpoint_seconds"
        ),
    }


def summarise(report: dict) -> dict:
    """The figures runs are compared by: the default against its fairest baseline first, then the fastest variants."""
    ok = {k: r for k, r in report["step"].get("variants", {}).items() if "ms_per_step" in r}
    epochs = {k: e for k, e in report["epoch"].items() if "epoch_seconds" in e}
    fastest = min((k for k in FAST_VARIANTS if k in ok), key=lambda k: ok[k]["ms_per_step"], default=None)
    best = min(epochs, key=lambda k: epochs[k]["epoch_seconds"], default=None)
    s = {"default_variant": DEFAULT}
    for base in (FAIREST_BASELINE, "published_fp32"):
        s[f"step_speedup_vs_{base}"] = step_ratio(report, base, DEFAULT)
        s[f"peak_memory_ratio_vs_{base}"] = step_ratio(report, DEFAULT, base, "peak_memory_gib")
    s["step_mfu_measured_gemm"] = at(report, f"step.variants.{DEFAULT}.mfu_measured_gemm")
    s["step_mfu_datasheet"] = at(report, f"step.variants.{DEFAULT}.mfu_datasheet")
    s["epoch_seconds"] = at(report, f"epoch.{DEFAULT}.epoch_seconds")
    s.update({f"epoch_speedup_{k}": r for k, r in epoch_ratios(report, DEFAULT).items()})
    s["projected_200_epochs_minutes"] = at(report, f"epoch.{DEFAULT}.projected_200_epochs_minutes")
    s["projected_200_epochs_with_checkpoint_minutes"] = at(
        report, f"epoch.{DEFAULT}.projected_200_epochs_with_checkpoint_minutes"
    )
    s["fastest_step_variant"] = fastest
    for base in (FAIREST_BASELINE, "published_fp32"):
        s[f"fastest_step_speedup_vs_{base}"] = step_ratio(report, base, fastest) if fastest else None
    s["fastest_step_peak_memory_ratio_vs_published_fp32"] = (
        step_ratio(report, fastest, "published_fp32", "peak_memory_gib") if fastest else None
    )
    s["fastest_step_mfu_measured_gemm"] = ok[fastest]["mfu_measured_gemm"] if fastest else None
    s["fastest_step_mfu_datasheet"] = ok[fastest]["mfu_datasheet"] if fastest else None
    s["fastest_epoch_variant"] = best
    s["fastest_epoch_seconds"] = epochs[best]["epoch_seconds"] if best else None
    s.update({f"fastest_epoch_speedup_{k}": r if best else None for k, r in epoch_ratios(report, best).items()})
    s["fastest_projected_200_epochs_minutes"] = epochs[best]["projected_200_epochs_minutes"] if best else None
    s["fastest_projected_200_epochs_with_checkpoint_minutes"] = (
        epochs[best]["projected_200_epochs_with_checkpoint_minutes"] if best else None
    )
    return s


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
    p.add_argument(
        "--variants",
        default=None,
        help="comma list, in the order they run (with --epoch the CUDA-only ones run after the epochs); 'none': no "
        "step variant (an epoch-only run); default: all (those needing CUDA skipped on the CPU)",
    )
    p.add_argument(
        "--methods",
        default="none",
        help=f"comma list of {','.join(method_steps.METHODS)}: each method's fast step against its published step, "
        "after the variants; 'none' (default): no method row",
    )
    p.add_argument("--epoch", action="store_true", help="also time a whole epoch against the published epochs")
    p.add_argument("--epoch-variants", default=DEFAULT, help="comma list of fast variants for --epoch")
    p.add_argument("--n-train", type=int, default=5994, help="--epoch: train images (CUB's)")
    p.add_argument("--n-test", type=int, default=5794, help="--epoch: test-split images (CUB's)")
    p.add_argument("--feature-batch", type=int, default=1024, help="infosieve-fast's feature-pass batch")
    p.add_argument("--published-feature-batch", type=int, default=128, help="the published feature pass's batch")
    p.add_argument("--ref-kmeans-inits", type=int, default=1, help="published pseudo-label k-means restarts run")
    p.add_argument(
        "--as-released-subset",
        type=int,
        default=None,
        metavar="IMAGES",
        help="run the as-released published epoch's passes and steps over IMAGES images and project them "
        "to the full size (default: run them in full)",
    )
    p.add_argument(
        "--stand-in-noise",
        type=float,
        default=0.03,
        help="--epoch: per-coordinate noise of the features every k-means clusters (larger: classes overlap "
        "more, the k-means converge later); 0.03 is bench_kmeans' recipe",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if smoke.active():
        geometry = SMOKE_GEOMETRY if all(getattr(args, k) == p.get_default(k) for k in SMOKE_GEOMETRY) else {}
        sizes = {k: v for k, v in SMOKE_SIZES.items() if getattr(args, k) == p.get_default(k)}
        args = smoke.shrink(args, **SMOKE_STEPS, **geometry, **sizes)
    return check_args(p, args)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Resolve the device, the JSON and the variant lists; refuse what cannot run, naming the flag."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device = torch.device(args.device)
    try:
        args.backbone_kwargs = json.loads(args.backbone_kwargs)
    except json.JSONDecodeError as err:
        p.error(f"--backbone-kwargs must be a JSON dict, e.g. '{{\"img_size\": 64}}': {err}")
    args.variants = [] if args.variants == "none" else args.variants.split(",") if args.variants else list(REPORT_ORDER)
    args.epoch_variants = args.epoch_variants.split(",")
    args.methods = [] if args.methods == "none" else args.methods.split(",")
    if not set(args.methods) <= set(method_steps.METHODS):
        p.error(f"unknown method(s) {sorted(set(args.methods) - set(method_steps.METHODS))} in --methods: choose from "
                f"{list(method_steps.METHODS)} (InfoSieve's rows are --variants)")  # fmt: skip
    unknown = sorted(set(args.variants + args.epoch_variants) - set(REPORT_ORDER))
    if unknown:
        p.error(f"unknown variant(s) {unknown}: choose from {list(REPORT_ORDER)}")
    if not set(args.epoch_variants) <= set(FAST_VARIANTS):
        p.error(f"--epoch-variants takes fast variants only: {list(FAST_VARIANTS)}")
    if not 1 <= args.ref_kmeans_inits <= KMEANS_INITS:
        p.error(f"--ref-kmeans-inits must be in 1..{KMEANS_INITS}")
    if args.crop > args.image_size:
        p.error(f"--crop {args.crop} is larger than the stored --image-size {args.image_size}: raise --image-size")
    if args.n_classes < 2:
        p.error(f"--n-classes must be >= 2 (half of them known), got {args.n_classes}")
    if args.epoch and args.n_train < args.batch:
        p.error(f"--n-train {args.n_train} holds no full batch of --batch {args.batch}: raise --n-train")
    if args.epoch and args.n_test < args.n_classes:
        p.error(f"--n-test {args.n_test} is below --n-classes {args.n_classes} (kmeans_pytorch needs K points)")
    if args.stand_in_noise < 0:
        p.error(f"--stand-in-noise must be >= 0, got {args.stand_in_noise}")
    if args.as_released_subset is not None and args.as_released_subset < 1:
        p.error(f"--as-released-subset must be >= 1 image, got {args.as_released_subset}")
    return args


def bench_method(args, method: str, peaks: dict[str, float | None], report: dict, update: Callable[[], None]):
    """`method`'s row, `report["methods"][method]`: its fast step and its published steps, and the speedups
    (`update` after each variant)."""
    entry = report["methods"][method] = {}
    bench = StepBench(args, args.device, peaks, method_step_functions(method))

    def on_result() -> None:
        entry.update(bench.report())
        rows = f"methods.{method}.variants"
        entry["summary"] = {
            f"step_speedup_vs_{base}": ratio(report, f"{rows}.{base}.ms_per_step", f"{rows}.{DEFAULT}.ms_per_step")
            for base in (FAIREST_BASELINE, "published_fp32")
        }
        update()

    try:
        bench.run(list(method_steps.VARIANTS), on_result)
    except Exception as err:  # its FLOP count failing must not cost the other methods' numbers
        entry.update(failure(err))
        update()


def run(args: argparse.Namespace, emit: Callable[[dict], None] = lambda report: None) -> dict:
    """The whole benchmark; `emit(report)` is called after every variant, so a run cut short keeps what it measured."""
    device = args.device
    set_cuda_matmul_tf32(False)  # torch's default, stated: the fp32 baseline is true fp32
    name = device_name(device)
    report = {
        "benchmark": "bench_train",
        **stamp(),
        "command": " ".join(["python", "-m", "benchmarks.bench_train", *sys.argv[1:]]),
        "device": name,
        "torch": versions()["torch"],
        "summary": {},
        "bf16_gemm_tflops": bf16_gemm_tflops(device),
        "bf16_datasheet_tflops": datasheet.bf16_tflops(name) if device.type == "cuda" else None,
        "bf16_datasheet_source": datasheet.SOURCE,
        "settings": {k: (str(v) if isinstance(v, torch.device) else v) for k, v in vars(args).items() if k != "json"},
        "step": {},
        "methods": {},
        "epoch": {},
        "notes": (
            "baseline: benchmarks/published/train.py (published model, loss and SGD; fp32 or bf16 autocast; "
            "loss.item() per step). Same uint8 batch, same device augmentation and same initial weights on both "
            "sides. Step times: median between CUDA events (wall clock on the CPU). MFU against the bf16 GEMM rate "
            "measured here (mfu_measured_gemm) and against the datasheet peak (mfu_datasheet). Epochs: every k-means "
            "clusters seeded synthetic features with class structure of the real size; the feature passes run the "
            "network. Published epochs: minimal (features, k-means, steps) and as released (+ codes and their "
            "k-means, per-step .item() records, the test-split pass and 3 kmeans_pytorch runs, scoring, 3 "
            "torch.saves); the pseudo-label k-means measured with ref_kmeans_inits restarts and projected to 10; "
            "with as_released_subset, the as-released passes and steps projected from that many images. Every "
            "summary ratio names the report paths of its numerator and denominator. Method rows: each method's fast "
            "step against its published step (benchmarks/method_steps.py), its FLOPs from its published fp32 step."
        ),
    }
    peaks = {"measured_gemm": report["bf16_gemm_tflops"], "datasheet": report["bf16_datasheet_tflops"]}
    steps = StepBench(args, device, peaks)

    def update() -> None:
        report["step"] = steps.report()
        report["epoch"] = in_report_order(report["epoch"])
        report["summary"] = summarise(report)
        emit(report)

    # With --epoch the CUDA-only variants (each compiles or captures first) run last, after the epochs, so a run cut
    # short by a time limit keeps every other number; without it every variant runs in the order given.
    deferred = [v for v in args.variants if v in CUDA_ONLY] if args.epoch else []
    steps.run([v for v in args.variants if v not in deferred], update)
    for method in args.methods:
        bench_method(args, method, peaks, report, update)
    if args.epoch:
        data = epoch_data(args, device)
        for variant in args.epoch_variants:
            free_memory(device)
            if variant in CUDA_ONLY and device.type != "cuda":
                report["epoch"][variant] = {"variant": variant, "skipped": CUDA_ONLY[variant]}
            else:
                try:
                    report["epoch"][variant] = bench_epoch(args, data, variant)
                except Exception as err:
                    report["epoch"][variant] = {"variant": variant, **failure(err)}
            print(f"epoch {variant}: {report['epoch'][variant]}", file=sys.stderr, flush=True)
            update()
    steps.run(deferred, update)
    return report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args, lambda r: emit_json(r, args.json, echo=False))
    emit_json(report, args.json)
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
    step, finish, _ = _step_for_pytest("published_fp32")
    benchmark(step)
    assert math.isfinite(finish())


def test_fast_step_speed(benchmark):
    step, finish, _ = _step_for_pytest("fast_default")
    benchmark(step)
    assert math.isfinite(finish())


if __name__ == "__main__":
    main()
