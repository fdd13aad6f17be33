"""The saved shard index: opening a set of WebDataset shards the first time (one walk over every tar header) against
reopening it (the index saved beside the shards, checked against their sizes and modification times, reused).

Writes ``--samples`` small synthetic JPEGs (8 distinct 24 x 32 images, ``.jpg`` + ``.cls``, as webdataset's TarWriter
writes them) into shards of ``--per-shard`` samples, then opens them with ``ShardSource`` as foreign shards: once with
no saved index, then ``--reopens`` times more. The issue's target: reopening >= 10x faster than the first open.

    python -m benchmarks.bench_shard_index --samples 100000 --json benchmarks/results/shard_index_cpu.json
"""

from __future__ import annotations

import argparse
import io
import statistics
import tarfile
import tempfile
from pathlib import Path

from benchmarks import smoke
from benchmarks.harness import timed
from benchmarks.tools.provenance import emit_json
from infosieve_fast.config.settings import IntakeConfig
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource

N_CLASSES = 10


def _images() -> list[bytes]:
    import numpy as np
    from PIL import Image

    out = []
    for i in range(8):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (24, 32, 3), dtype=np.uint8)).save(buf, "JPEG")
        out.append(buf.getvalue())
    return out


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(folder: Path, samples: int, per_shard: int) -> None:
    """`samples` samples of .jpg + .cls (class = sample index mod N_CLASSES) in shards of `per_shard`."""
    images = _images()
    for start in range(0, samples, per_shard):
        with tarfile.open(folder / f"train-{start // per_shard:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(start, min(start + per_shard, samples)):
                _add(tar, f"{i:09d}.jpg", images[i % len(images)])
                _add(tar, f"{i:09d}.cls", b"%d" % (i % N_CLASSES))


def _open(folder: Path, cache: Path) -> tuple[float, ShardSource]:
    with timed() as clock:
        src = ShardSource(folder, ReadOptions(num_workers=0, cache="off", intake=IntakeConfig(index_cache=str(cache))))
    return clock.seconds, src


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--per-shard", type=int, default=10_000)
    parser.add_argument("--reopens", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = smoke.shrink(parser.parse_args(argv), samples=2000, per_shard=500, reopens=2)
    with tempfile.TemporaryDirectory() as tmp:
        folder, cache = Path(tmp) / "shards", Path(tmp) / "cache"
        folder.mkdir()
        write_shards(folder, args.samples, args.per_shard)
        first, src = _open(folder, cache)
        reopens = [_open(folder, cache) for _ in range(args.reopens)]
    assert not src.reused_index and all(s.reused_index for _, s in reopens), "the saved index was not reused"
    reopen = statistics.median(t for t, _ in reopens)
    emit_json(
        {
            "benchmark": "shard_index",
            "smoke": smoke.active(),
            "samples": src.n_train,
            "shards": len(src.urls),
            "first_open_s": round(first, 4),
            "reopen_s": round(reopen, 4),
            "reopen_all_s": [round(t, 4) for t, _ in reopens],
            "speedup": round(first / reopen, 1),
            "targets": {"speedup": 10},
        },
        args.json,
    )


if __name__ == "__main__":
    main()
