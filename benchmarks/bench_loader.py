"""Two-view training batches per second: the reference's loader against shards (streaming and in memory).

    python -m benchmarks.bench_loader --data $INFOSIEVE_REALDATA/cub100 --json OUT.json

A *view* is one augmented 224x224 image delivered as part of a normalised float32 batch, as the trainer consumes it.
- reference: an ImageFolder-style dataset over the JPEG files; per view PIL `Resize(256)` (bicubic) / `RandomCrop(224)`
  / `RandomHorizontalFlip` / `ColorJitter()` (a no-op, as in the reference) / `ToTensor` / `Normalize`; two views per
  image returned as a list (GCD's `ContrastiveLearningViewGenerator`), so the DataLoader (`--workers` workers, batch
  `--batch-size`, shuffled, drop_last) yields a list of two [B, 3, 224, 224] batches, and the consumer makes the
  view-major [2B, 3, 224, 224] batch the model takes with `torch.cat(images)` (docs/reference.md §3: `CT.py:321`), in
  the main process.
- reference_stacked (reported for comparison; it is what this script measured before): the same transforms, the two
  views stacked per sample in the worker, the batch flattened to [2B, ...] without a copy; its rows are sample-major
  (image 0 view 0, image 0 view 1, ...), not the reference's view-major order, and it skips the `torch.cat`.
- stream: `ShardSource` streaming (`cache="off"`) with `--workers` decode workers; `DeviceAugment` makes the two views
  from each decoded uint8 batch in the main process (here on the CPU: "the device").
- memory: `ShardSource` in memory (decoded once, time reported apart as `memory_decode_s`), same augmentation.
Each pipeline runs `--warmup` batches untimed, then `--batches` timed ones, from a fresh loader (epoch 0) each time;
with the defaults (3 + 50 batches of 128 over cub100's 5,902 images: 46 batches an epoch) every timed run crosses one
epoch boundary, so the streaming path's per-epoch restart (new DataLoader workers) is paid as in training.
The three run in turn, `--repeats` rounds (the machine may be shared: interleaving spreads any outside load over all
three); the result is each pipeline's median views/s over the rounds, the ratios are of the medians, and every
round's numbers are listed under `rounds`. Threads of the main process (`torch.set_num_threads`): `--threads` (1) for
the reference and the stream, whose worker processes need the cores, and `--memory-threads` (all cores) for the
in-memory path, where no worker runs and the augmentation is the only work (as the reference's workers, it gets the
machine). The shards are written once into `--shards` (JPEG, the default format; reused when complete).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import smoke
from benchmarks.cub_subset import write_cub_subset
from benchmarks.harness import timed
from benchmarks.tools.provenance import emit_json, versions
from infosieve_fast.data.reading.augment import AugmentConfig, DeviceAugment
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
from infosieve_fast.data.writing.layouts import read_dataset
from infosieve_fast.data.writing.shards import make_shards

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class ReferenceDataset(torch.utils.data.Dataset):
    """What the reference does: load the file, apply the full train transform twice (a list of two views; `stacked`:
    one [2, 3, 224, 224] tensor)."""

    def __init__(self, paths: list[str], labels: list[int], stacked: bool = False):
        from torchvision import transforms as T

        self.paths, self.labels, self.stacked = paths, labels, stacked
        self.transform = T.Compose(
            [
                T.Resize(256, interpolation=T.InterpolationMode.BICUBIC),
                T.RandomCrop(224),
                T.RandomHorizontalFlip(),
                T.ColorJitter(),
                T.ToTensor(),
                T.Normalize(MEAN, STD),
            ]
        )

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(self.paths[i]) as im:
            img = im.convert("RGB")
        views = [self.transform(img), self.transform(img)]
        return (torch.stack(views) if self.stacked else views), self.labels[i], i


def _timed(batches, warmup: int, n: int, views_of) -> tuple[float, int]:
    it = iter(batches)
    for _ in range(warmup):
        views_of(next(it))
    views = 0
    with timed() as clock:
        for _ in range(n):
            views += views_of(next(it))
    return clock.seconds, views


def bench_reference(data: Path, args, stacked: bool = False) -> float:
    torch.set_num_threads(args.threads)
    raw = read_dataset("cubfiles", data)
    ds = ReferenceDataset(raw.train, raw.train_labels.tolist(), stacked)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True, persistent_workers=True
    )

    def views_of(batch) -> int:
        x = batch[0].flatten(0, 1) if stacked else torch.cat(batch[0], dim=0)  # [2B, 3, 224, 224]
        assert x.dtype == torch.float32 and x.shape[-1] == 224
        return x.shape[0]

    def forever():
        while True:
            yield from loader

    dt, views = _timed(forever(), args.warmup, args.batches, views_of)
    return views / dt


def bench_shards(src: ShardSource, args, threads: int) -> float:
    torch.set_num_threads(threads)
    aug = DeviceAugment(AugmentConfig())
    gen = torch.Generator().manual_seed(0)

    def forever():
        epoch = 0
        while True:
            yield from src.train_batches(args.batch_size, epoch, 0)
            epoch += 1

    def views_of(batch) -> int:
        views = aug.train_views(batch.images, 2, gen, batch.sizes)
        assert views.dtype == torch.float32 and views.shape[-1] == 224
        return views.shape[0]

    dt, views = _timed(forever(), args.warmup, args.batches, views_of)
    return views / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="a CUB-style folder (cub100)")
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--shards", default=None, help="shards folder (default: a folder under the temp dir, reused)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="main-process threads for the reference and the stream")
    p.add_argument(
        "--memory-threads", type=int, default=os.cpu_count() or 1, help="main-process threads, in-memory path"
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds of (reference, stream, memory); medians reported")
    p.add_argument("--classes", type=int, default=None, help="only the first N species of --data (default: all)")
    args = smoke.shrink(p.parse_args(), classes=4, batch_size=8, batches=2, warmup=1, repeats=1)
    torch.set_num_threads(args.threads)
    data = Path(args.data).resolve()
    subset = f"-first{args.classes}" if args.classes else ""
    default_shards = Path(tempfile.gettempdir()) / f"infosieve-bench-shards-cub100{subset}"
    shards = Path(args.shards) if args.shards else default_shards
    if args.classes:
        data = write_cub_subset(data, args.classes, shards.with_name(shards.name + "-raw"))
    load_start = os.getloadavg()[0]
    with timed() as making:
        make_shards("cubfiles", data, shards, workers=args.workers, progress=False)
    make_s = making.seconds
    stream_src = ShardSource(shards, ReadOptions(cache="off", num_workers=args.workers))
    memory_src = ShardSource(shards, ReadOptions(cache="cpu", num_workers=args.workers))
    with timed() as decoding:
        memory_src.load()
    decode_s = decoding.seconds
    rounds = []
    for r in range(args.repeats):
        one = {"loadavg_before": round(os.getloadavg()[0], 2)}
        one["reference"] = round(bench_reference(data, args), 1)
        one["reference_stacked"] = round(bench_reference(data, args, stacked=True), 1)
        one["stream"] = round(bench_shards(stream_src, args, args.threads), 1)
        one["memory"] = round(bench_shards(memory_src, args, args.memory_threads), 1)
        one["stream_vs_reference"] = round(one["stream"] / one["reference"], 2)
        one["memory_vs_reference"] = round(one["memory"] / one["reference"], 2)
        one["stream_vs_reference_stacked"] = round(one["stream"] / one["reference_stacked"], 2)
        one["memory_vs_reference_stacked"] = round(one["memory"] / one["reference_stacked"], 2)
        rounds.append(one)
        print(f"round {r + 1}/{args.repeats}: {json.dumps(one)}", file=sys.stderr, flush=True)
    ref, ref_stacked, stream, memory = (
        statistics.median(x[k] for x in rounds) for k in ("reference", "reference_stacked", "stream", "memory")
    )
    result = {
        "reference": round(ref, 1),
        "stream": round(stream, 1),
        "memory": round(memory, 1),
        "stream_vs_reference": round(stream / ref, 2),
        "memory_vs_reference": round(memory / ref, 2),
        "reference_stacked": round(ref_stacked, 1),
        "stream_vs_reference_stacked": round(stream / ref_stacked, 2),
        "memory_vs_reference_stacked": round(memory / ref_stacked, 2),
        "targets": {"stream_vs_reference": 3.0, "memory_vs_reference": 10.0},
        "unit": "views/s (one view = one augmented 224x224 normalised float32 image; 2 views per image)",
        "command": " ".join(["python", "-m", "benchmarks.bench_loader", *sys.argv[1:]]),
        "statistic": f"median over {args.repeats} interleaved rounds (see rounds)",
        "rounds": rounds,
        "make_shards_s": round(make_s, 1),
        "memory_decode_s": round(decode_s, 1),
        "settings": {
            "data": str(data),
            "batch_size": args.batch_size,
            "batches": args.batches,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "workers": args.workers,
            "main_threads": args.threads,
            "memory_main_threads": args.memory_threads,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_at_start": round(load_start, 2),
            "loadavg_at_end": round(os.getloadavg()[0], 2),
            "platform": platform.platform(),
            "torch": versions()["torch"],
        },
    }
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
