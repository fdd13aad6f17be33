"""A Herbarium19-size split served from the decoded GPU cache: after the first epoch, no decoding at all.

    python -m benchmarks.bench_gpu_cache --device cuda --json RESULTS/gpu-cache-herbarium19.json   # GPU check
    python -m benchmarks.bench_gpu_cache --device cpu --n 200 --size 64       # CPU smoke run: the cache in RAM

1. shards: `--n` (34,000, about Herbarium19's 34,225 train images) synthetic JPEGs of `--classes` (683) classes at
   shorter side `--size` (256), long side 1-1.5 x, half of them portrait (`pooled_shards`: synthetic_shards' natural
   images drawn from a pool, ~55 KB each), written by make-shards in parallel processes and reused from
   `--shards-dir` when present;
2. the train split opened as the trainer opens it (`data.build_source` with `data.cache=gpu`; on the CPU
   `data.cache=cpu`, the decoded split in RAM, said in the JSON's `cache`), decoding with `data.decode` (`--decode`,
   default auto: nvJPEG on CUDA);
3. `--epochs` (3) passes over every sample as the feature pass reads them (`feature_batches`, batches of `--batch`),
   each batch made into `--views` augmented views (`DeviceAugment.train_views`: 1 = the pseudo-label pass's view,
   2 = the training step's two; 0 = none). The first pass fills the cache (every sample decoded once); the later
   ones gather from it.
Per epoch: seconds, images/s, and the images decoded during it on the CPU, by nvJPEG, and handed from nvJPEG to the
CPU (`ShardSource.decode_counts`). The target: the epochs after the first decode nothing (`summary.later_epochs_
decode_nothing`). Also the cache's size and the GPU memory allocated. The JSON is written after every epoch (a killed
run keeps what it measured), and printed at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import smoke
from benchmarks.harness import throughput, timed
from benchmarks.pooled_shards import write_pooled_shards
from benchmarks.tools.provenance import device_name, emit_json
from infosieve_fast.config.settings import load_config
from infosieve_fast.data import build_source
from infosieve_fast.data.reading.augment import AugmentConfig, DeviceAugment
from infosieve_fast.training.trainer_setup import resolve_device

HERBARIUM19_N, HERBARIUM19_CLASSES = 34_000, 683


def run_epoch(source, augment: DeviceAugment | None, views: int, batch_size: int, gen: torch.Generator) -> dict:
    """One pass over every sample; the seconds, the images and the decodes it took."""
    before = source.decode_counts.as_dict()
    n = 0
    with timed(source.device) as clock:
        for batch in source.feature_batches(batch_size):
            n += len(batch.uq)
            if augment is not None:
                augment.train_views(batch.images, views, gen, batch.sizes)
    after = source.decode_counts.as_dict()
    return {**throughput(n, clock.seconds), "decodes": {k: after[k] - before[k] for k in after}}


def gpu_memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"allocated_gib": None, "peak_allocated_gib": None}
    return {
        "allocated_gib": round(torch.cuda.memory_allocated(device) / 2**30, 3),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--n", type=int, default=HERBARIUM19_N, help="synthetic train images")
    p.add_argument("--classes", type=int, default=None, help="default: Herbarium19's share, 683 per 34,000 images")
    p.add_argument("--size", type=int, default=256, help="stored shorter side")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=256, help="feature-pass batch size")
    p.add_argument("--views", type=int, default=1, help="augmented views per batch (0: none, 2: the training step's)")
    p.add_argument("--crop", type=int, default=None, help="view size (default 224, or --size when smaller)")
    p.add_argument("--decode", default="auto", choices=("auto", "cpu", "gpu"))
    p.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards-dir", default=None, help="default: TMPDIR/infosieve-bench-gpu-cache/pooled-n{n}-s{size}")
    p.add_argument("--json", default=None, help="also write the JSON here (after every epoch)")
    args = smoke.shrink(p.parse_args(argv), n=200, classes=4, size=64, batch=64, workers=1)
    if args.classes is None:
        args.classes = max(2, round(args.n * HERBARIUM19_CLASSES / HERBARIUM19_N))
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    crop = args.crop or min(224, args.size)
    shards = Path(
        args.shards_dir or Path(tempfile.gettempdir()) / "infosieve-bench-gpu-cache" / f"pooled-n{args.n}-s{args.size}"
    )
    data = write_pooled_shards(shards, n=args.n, n_classes=args.classes, size=args.size, workers=os.cpu_count() or 2)
    cache = "gpu" if device.type == "cuda" else "cpu"
    cfg = load_config(
        None,
        [
            f"data.shards={shards}",
            f"data.cache={cache}",
            f"data.decode={args.decode}",
            f"data.num_workers={args.workers}",
            f"train.device={device}",
            f"train.seed={args.seed}",
        ],
    )
    source = build_source(cfg.data, cfg.train, device)
    if device.type != "cuda":
        print("bench_gpu_cache: no GPU: the decoded cache is kept in RAM (data.cache=cpu)", file=sys.stderr)
    augment = DeviceAugment(AugmentConfig(crop_size=crop)) if args.views else None
    gen = torch.Generator(device=device).manual_seed(args.seed)
    result = {
        "benchmark": "bench_gpu_cache",
        "device": device_name(device),
        "command": " ".join([sys.executable, *sys.argv]),
        "cache": cache if device.type == "cuda" else "cpu (no GPU: the decoded split is kept in RAM)",
        "decode_on_gpu": source.gpu_decode,
        "settings": {**vars(args), "crop": crop},
        "data": data,
        "epochs": [],
    }
    for epoch in range(args.epochs):
        result["epochs"].append({"epoch": epoch, **run_epoch(source, augment, args.views, args.batch, gen)})
        result["cache_bytes"] = source.cache_bytes()
        result["cache_gib"] = round(result["cache_bytes"] / 2**30, 3)
        result["gpu_memory"] = gpu_memory(device)
        result["summary"] = summarise(result["epochs"], source.n_train, source.unreadable())
        print(f"bench_gpu_cache: epoch {epoch}: {result['epochs'][-1]}", file=sys.stderr, flush=True)
        emit_json(result, args.json, echo=False)
    emit_json(result, args.json)
    return result


def summarise(epochs: list[dict], n_train: int, unreadable: list[int]) -> dict:
    later = epochs[1:]
    return {
        "n_train": n_train,
        "unreadable": len(unreadable),
        "first_epoch_decodes": epochs[0]["decodes"],
        "later_epochs_decode_nothing": bool(later) and all(not any(e["decodes"].values()) for e in later),
        "first_epoch_images_per_s": epochs[0]["images_per_s"],
        "later_epochs_images_per_s": [e["images_per_s"] for e in later],
    }


if __name__ == "__main__":
    main()
