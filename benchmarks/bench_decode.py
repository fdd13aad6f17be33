"""Decode + augment per CPU core: how many images one core turns from stored JPEG bytes into two training views.

    python -m benchmarks.bench_decode --out benchmarks/results/decode_cpu.json       # full size
    python -m benchmarks.bench_decode --decode-n 64 --decode-repeats 1              # tiny

`--decode-n` (2,000) "natural-ish" images (`synthetic_shards.natural_image`: 1/f noise, ellipses, sensor noise; about
50 KB each) stored shorter side `--decode-size` (256; long side 256-384) as make-shards writes them (cached under
`--shards-dir`, reused when complete); in this process with `torch.set_num_threads(1)`: batches of `--decode-batch`
decoded as the DataLoader workers do (stream's `decode_cpu` + `cap_aspect` + `pad_into`: the images keep their
stored size, padded into one canvas), then two `--crop` (224) views each with `DeviceAugment.train_views` on the CPU.
images/s per core = images / CPU seconds of the process (robust to other load on a shared machine; the wall-clock
rate is reported too); best of `--decode-repeats` passes.

JSON on stdout and in `--out`: commit / dirty / device as the other benchmarks, a `summary`
(decode_augment_images_per_s_per_core), then `decode_augment` (with the `shards` it read).
"""

from __future__ import annotations

import argparse
import json
import tarfile
import time
from pathlib import Path

import torch

from benchmarks import smoke
from benchmarks.harness import Stopwatch, cpu_report, finish_cpu_report
from benchmarks.synthetic_shards import add_cache_arguments, cached_synthetic_shards
from infosieve_fast.data.writing import shards as shards_mod


def read_images(shards: Path, limit: int) -> list[bytes]:
    """The stored image bytes of up to `limit` train samples, in shard order (stdlib tarfile)."""
    manifest = json.loads((shards / shards_mod.MANIFEST).read_text())
    out = []
    for rec in manifest["splits"]["train"]["shards"]:
        with tarfile.open(shards / rec["name"]) as tar:
            for m in tar:
                if m.isfile() and m.name.rsplit(".", 1)[-1] in shards_mod.IMAGE_FORMATS:
                    out.append(tar.extractfile(m).read())
                    if len(out) >= limit:
                        return out
    return out


def decode_augment(images: list[bytes], *, crop: int, batch: int, repeats: int) -> dict:
    """images/s of decode + two `crop` views, one thread. The decode is the DataLoader workers' (`_Reader`, decode on
    the CPU): stream's `decode_cpu` of each image, `cap_aspect` (no cap: the source's default), `pad_into` one canvas
    with the sizes; the views are `DeviceAugment.train_views` on the CPU."""
    from infosieve_fast.data.reading.augment import AugmentConfig, DeviceAugment
    from infosieve_fast.data.reading.stream import cap_aspect, decode_cpu, pad_into

    def decoded(chunk: list[bytes]) -> tuple[torch.Tensor, torch.Tensor | None]:
        parts = [cap_aspect(decode_cpu(b), None) for b in chunk]
        canvas, sizes = pad_into(parts)
        return canvas, None if bool((sizes == sizes[:1]).all()) else sizes

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        aug = DeviceAugment(AugmentConfig(crop_size=crop))
        gen = torch.Generator().manual_seed(0)

        def views_of(canvas: torch.Tensor, sizes: torch.Tensor | None) -> torch.Tensor:
            views = aug.train_views(canvas, 2, gen) if sizes is None else aug.train_views(canvas, 2, gen, sizes=sizes)
            assert views.shape == (2 * len(canvas), 3, crop, crop) and views.dtype == torch.float32
            return views

        def one_pass() -> tuple[float, float, float]:
            wall, c0, dec = Stopwatch(), time.process_time(), 0.0
            for start in range(0, len(images), batch):
                d0 = time.process_time()
                canvas, sizes = decoded(images[start : start + batch])
                dec += time.process_time() - d0
                views_of(canvas, sizes)
            return wall.seconds(), time.process_time() - c0, dec

        views_of(*decoded(images[:batch]))  # warm-up: codec, buffers
        rounds = [one_pass() for _ in range(max(1, repeats))]
    finally:
        torch.set_num_threads(saved)
    n = len(images)
    best = min(rounds, key=lambda r: r[1])
    return {
        "images": n,
        "crop": crop,
        "views_per_image": 2,
        "batch": batch,
        "threads": 1,
        "mean_kb_per_image": round(sum(map(len, images)) / max(1, n) / 1024, 1),
        "images_per_cpu_s": round(n / best[1], 1),
        "images_per_wall_s": round(n / min(r[0] for r in rounds), 1),
        "decode_share_of_cpu": round(best[2] / best[1], 3),
        "rounds": [{"wall_s": round(w, 3), "cpu_s": round(c, 3), "decode_cpu_s": round(d, 3)} for w, c, d in rounds],
        "statistic": f"best of {len(rounds)} passes by CPU time of the process (one thread)",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    p.add_argument("--out", default=None, help="also write the JSON here")
    add_cache_arguments(p)
    p.add_argument("--decode-n", type=int, default=2000, help="images of the decode+augment set")
    p.add_argument("--decode-size", type=int, default=256, help="stored shorter side of the decode+augment set")
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--decode-repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = smoke.shrink(p.parse_args(argv), decode_n=16, decode_batch=8, decode_repeats=1)
    if args.decode_n < 1 or args.decode_batch < 1:
        p.error("need --decode-n >= 1 and --decode-batch >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = Stopwatch()
    report = cpu_report("bench_decode", argv)
    name = f"decode-n{args.decode_n}-s{args.decode_size}-seed{args.seed}"
    folder, shards = cached_synthetic_shards(
        args,
        name,
        kind="natural",
        n=args.decode_n,
        n_classes=2,
        size=args.decode_size,
        seed=args.seed,
        shard_size_mb=256,
    )
    decode = decode_augment(
        read_images(folder, args.decode_n), crop=args.crop, batch=args.decode_batch, repeats=args.decode_repeats
    )
    report["decode_augment"] = decode | {"shards": shards}
    summary = {"decode_augment_images_per_s_per_core": decode["images_per_cpu_s"]}
    return finish_cpu_report(report, summary, started, args.out)


if __name__ == "__main__":
    main()
