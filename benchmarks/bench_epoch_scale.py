"""An ImageNet-1k epoch projected from a measured window: synthetic JPEG shards streamed through the real trainer.

    python -m benchmarks.bench_epoch_scale --device cuda --kmeans-json RESULTS/card-kmeans-imagenet1k.json \
        --json RESULTS/card-epoch-imagenet1k.json                    # ViT-B/16, 32,768 images, 512 steps (GPU check)
    python -m benchmarks.bench_epoch_scale --device cpu --n 96 --size 64 --crop 32 --batch 16 --steps 8 \
        --backbone resnet10t --workers 1                             # a CPU smoke run (tests/test_bench_epoch_scale.py)

What runs, with configs/imagenet1k.yaml (ViT-B/16 from random weights: the speed is the same), streamed from shards
(`data.cache=off`, as ImageNet-1k's ~335 GB of decoded images never fit a cache) with `data.decode` (default auto:
nvJPEG on CUDA):
1. shards: `--n` synthetic "natural" images (`pooled_shards`: crops of a pool of synthetic_shards' 1/f-texture, ellipse
   and noise images; ~55 KB JPEG quality 95 at shorter side 256, long side 256-384, half portrait) of `--classes`
   classes, written by make-shards on every core and reused from `--shards-dir`;
2. loader alone: `--loader-batches` training batches read, decoded and delivered on the device; images/s;
3. feature pass over all `--n` images (the evaluator's `features`: augmented view, bf16 forward); images/s;
4. the training window: `Trainer.train_step` over the sampler's batches (epochs in a row) until `--steps` steps, timed
   from the first batch to the device's last kernel; ms/step, images/s, the host's time waiting for the loader
   (`loader_wait_fraction`), and GPU utilisation sampled by `nvidia-smi` every 200 ms (mean and median);
5. projection for ImageNet-1k (1,281,167 train images, batch `--batch`): feature pass = N / its rate, steps =
   N // batch x ms/step, k-means = the ImageNet-size round measured by `bench_kmeans.py --scale imagenet1k`
   (`--kmeans-json`: its fp32 run, the default config's; without it the projection leaves k-means out and says so);
6. for comparison, the loader alone with the other decode path (`loader_other_decode`: CPU workers vs nvJPEG), last,
   so the projection never waits for it; its failure is recorded there (`error`) and costs nothing else.
The loader is "never the bottleneck" when it delivers faster than training consumes (`loader_vs_train` > 1) and the
training loop almost never waits for it. The JSON is written after every phase (`phases_done`; `complete` once the
projection is in; the comparison of step 6 follows), so a run cut short keeps what it measured. A ViT gets
`img_size=--crop` (`model.backbone_kwargs`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import torch

from benchmarks import smoke
from benchmarks.harness import Stopwatch, sync, throughput, timed
from benchmarks.pooled_shards import KIND, write_pooled_shards
from benchmarks.tools.provenance import device_name, emit_json, stamp
from infosieve_fast.config.settings import load_config
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
from infosieve_fast.training.engine import Trainer
from infosieve_fast.training.loss_monitor import LossMonitor

IMAGENET1K_TRAIN = 1_281_167
# smoke size (INFOSIEVE_BENCH_SMOKE=1, the CPU rehearsal of gpu_check.sh): a ViT-Ti/16 on 32 px crops, seconds on a CPU
SMOKE = dict(
    device="cpu",
    n=96,
    classes=8,
    size=64,
    crop=32,
    batch=16,
    feature_batch=32,
    steps=8,
    warmup=2,
    loader_batches=4,
    workers=1,
    backbone="vit_tiny_patch16_224",
)
SMOKE_SETS = ("model.proj_out_dim=256", "model.proj_hidden_dim=128", "model.proj_bottleneck_dim=64", "kmeans.n_init=1")


class GpuUtilisation:
    """`nvidia-smi` utilisation samples (percent) every 200 ms while active; nothing where there is no nvidia-smi."""

    def __init__(self, device: torch.device):
        self.samples: list[float] = []
        self._proc = None
        if device.type != "cuda":
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            self._proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    f"--id={index}",
                    "--query-gpu=utilization.gpu",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "200",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                self.samples.append(float(line.strip()))
            except ValueError:
                pass

    def stop(self) -> dict:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        if not self.samples:
            return {"mean": None, "median": None, "samples": 0}
        return {
            "mean": round(statistics.mean(self.samples), 1),
            "median": statistics.median(self.samples),
            "samples": len(self.samples),
        }


def build_trainer(args, shards: Path) -> Trainer:
    overrides = [
        f"data.shards={shards}",
        f"data.batch_size={args.batch}",
        f"data.feature_batch_size={args.feature_batch}",
        "data.cache=off",
        f"data.decode={args.decode}",
        f"data.num_workers={args.workers}",
        f"data.crop_size={args.crop}",
        f"train.device={args.device}",
        "model.pretrained=null",
        f"model.backbone={args.backbone}",
        f"train.seed={args.seed}",
    ]
    if args.backbone.startswith("vit") and args.crop != 224:
        overrides.append(f"model.backbone_kwargs={{img_size: {args.crop}}}")
    return Trainer(load_config("configs/imagenet1k.yaml", overrides + list(args.set)))


def loader_rate(source, batch_size: int, batches: int) -> dict:
    it = source.train_batches(batch_size, epoch=100, seed=0)
    next(it)  # workers started, first batch in
    n = 0
    with timed(source.device) as clock:
        for _, batch in zip(range(batches), it, strict=False):
            n += len(batch.uq)
    return throughput(n, clock.seconds)


def feature_pass(trainer: Trainer) -> tuple[dict, object]:
    with timed(trainer.device) as clock:
        fs = trainer.evaluator.features("train", seed=0)
    return throughput(len(fs.uq), clock.seconds), fs


def training_window(trainer: Trainer, pseudo: torch.Tensor, steps: int, warmup: int) -> dict:
    dev, bs = trainer.device, trainer.cfg.data.batch_size
    gen = torch.Generator(device=dev).manual_seed(0)
    monitor = LossMonitor(0)
    util = None
    wait, done, epoch, window = 0.0, 0, 0, None
    while done < steps + warmup:
        batches = iter(trainer.source.train_batches(bs, epoch=epoch, seed=0))
        while done < steps + warmup:
            fetch = Stopwatch()
            batch = next(batches, None)
            if batch is None:
                break
            if done == warmup:  # the window starts with this batch in hand
                sync(dev)
                window, wait, util = Stopwatch(), 0.0, GpuUtilisation(dev)
            elif done > warmup:
                wait += fetch.seconds()
            trainer.train_step(batch, pseudo, gen, monitor)
            done += 1
        epoch += 1
    sync(dev)
    seconds = window.seconds()
    monitor.check()
    return {
        "steps": steps,
        "warmup_steps": warmup,
        "seconds": round(seconds, 3),
        "ms_per_step": round(1000 * seconds / steps, 2),
        "images_per_s": round(steps * bs / seconds, 1),
        "loader_wait_fraction": round(wait / seconds, 4),
        "gpu_utilisation_percent": util.stop(),
        "epochs_spanned": epoch,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--n", type=int, default=32_768, help="synthetic train images")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--size", type=int, default=256, help="stored shorter side")
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--feature-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=512, help="timed training steps (>= 500 for the issue's window)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--loader-batches", type=int, default=100)
    p.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    p.add_argument("--decode", default="auto", choices=("auto", "cpu", "gpu"))
    p.add_argument("--backbone", default="vit_base_patch16_224")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--set", action="append", default=[], help="extra config overrides, key=value")
    p.add_argument("--shards-dir", default=None, help=f"default: /tmp/infosieve-bench-epoch/{KIND}-n{{n}}-s{{size}}")
    p.add_argument("--kmeans-json", default=None, help="bench_kmeans.py --scale imagenet1k output to project with")
    p.add_argument("--json", default=None, help="also write the JSON here (after every phase)")
    return smoke.shrink(p.parse_args(argv), SMOKE_SETS, **SMOKE)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = {
        **stamp(),
        "benchmark": "bench_epoch_scale",
        "command": " ".join([sys.executable, *sys.argv]),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "complete": False,
        "phases_done": [],
    }

    def phase_done(name: str, **measured) -> None:  # a run cut short keeps every phase it finished
        result.update(measured)
        result["phases_done"].append(name)
        emit_json(result, args.json, echo=False)

    shards = Path(args.shards_dir or f"/tmp/infosieve-bench-epoch/{KIND}-n{args.n}-s{args.size}")
    phase_done(
        "shards",
        data=write_pooled_shards(shards, n=args.n, n_classes=args.classes, size=args.size, workers=os.cpu_count() or 2),
    )
    trainer = build_trainer(args, shards)
    result.update(device=device_name(trainer.device), decode_on_gpu=trainer.source.gpu_decode)
    phase_done("loader", loader=loader_rate(trainer.source, args.batch, args.loader_batches))
    trainer.compile_once()  # the default path (train.compile=auto), compiled before the timed phases as training does
    phase_done("compile", compile=trainer.compiled.fields())
    features, fs = feature_pass(trainer)
    phase_done("feature_pass", feature_pass=features)
    with timed() as kmeans:
        pseudo = trainer.evaluator.cluster(fs, seed=0, balanced=trainer.cfg.kmeans.balanced).labels
    phase_done("kmeans_at_this_n", kmeans_at_this_n_s=round(kmeans.seconds, 2))
    window = training_window(trainer, pseudo, args.steps, args.warmup)
    phase_done("window", window=window)
    projection = project(features, window, args.batch, args.kmeans_json)
    loader = result["loader"]
    result.update(
        complete=True,
        projection=projection,
        summary={
            "projected_epoch_minutes": projection["epoch_minutes"],
            "projection_includes_kmeans": projection["kmeans_s"] is not None,
            "ms_per_step": window["ms_per_step"],
            "train_images_per_s": window["images_per_s"],
            "loader_images_per_s": loader["images_per_s"],
            "loader_vs_train": round(loader["images_per_s"] / window["images_per_s"], 2),
            "loader_wait_fraction": window["loader_wait_fraction"],
            "gpu_utilisation_mean_percent": window["gpu_utilisation_percent"]["mean"],
            "feature_images_per_s": features["images_per_s"],
        },
    )
    phase_done("projection")
    phase_done("loader_other_decode", loader_other_decode=other_decode_rate(trainer, shards, args))
    emit_json(result, args.json)
    return result


def other_decode_rate(trainer: Trainer, shards: Path, args) -> dict | None:
    """The loader with the other decode path (CPU workers against nvJPEG), for comparison: after the projection, and
    its failure recorded in its own entry, so it costs nothing else. None where it cannot run (nvJPEG needs a GPU)."""
    other = "cpu" if trainer.source.gpu_decode else "gpu"
    if other == "gpu" and trainer.device.type != "cuda":
        return None
    try:
        src = ShardSource(
            shards, ReadOptions(cache="off", decode=other, num_workers=args.workers, seed=1), device=trainer.device
        )
        return {"decode": other, **loader_rate(src, args.batch, args.loader_batches)}
    except Exception as err:  # a comparison, not a measurement the projection needs
        return {"decode": other, "error": f"{type(err).__name__}: {err}"}


def project(features: dict, window: dict, batch: int, kmeans_json: str | None) -> dict:
    """The ImageNet-1k epoch from the measured rates: feature pass + steps (+ the k-means round of `kmeans_json`)."""
    kmeans_seconds, kmeans_source = None, "not measured: pass --kmeans-json (bench_kmeans.py --scale imagenet1k)"
    if kmeans_json and Path(kmeans_json).is_file():
        runs = json.loads(Path(kmeans_json).read_text())["runs"]
        run = ([r for r in runs if r["distance_precision"] == "fp32"] or runs)[0]  # the default config's round
        kmeans_seconds, kmeans_source = run["seconds"], f"{kmeans_json} ({run['distance_precision']})"
    n = IMAGENET1K_TRAIN
    projection = {
        "n_train": n,
        "batch": batch,
        "feature_pass_s": round(n / features["images_per_s"], 1),
        "steps": n // batch,
        "steps_s": round(n // batch * window["ms_per_step"] / 1000, 1),
        "kmeans_s": kmeans_seconds,
        "kmeans_source": kmeans_source,
    }
    total = projection["feature_pass_s"] + projection["steps_s"] + (kmeans_seconds or 0.0)
    return {**projection, "epoch_minutes": round(total / 60, 2)}


if __name__ == "__main__":
    main()
