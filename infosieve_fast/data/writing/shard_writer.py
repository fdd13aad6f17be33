"""What make-shards writes and how: each split's plan (samples in write order with their `cls`, `uq` and `lab`) and
the tar shards written from it, atomically, with fixed tar metadata so that a rewrite is byte-identical."""

from __future__ import annotations

import io
import sys
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...common.files import atomic_write
from ...common.shown_text import terminal_safe
from ...common.worker_processes import forked_pool
from ..shard_format import DISCOVERY
from ..shard_manifest import ORDER_SEED, PROP, SPLIT_SEED, ShardsError, file_sha256
from ..splits import discovery_counts, discovery_split, gcd_split, split_counts
from .encode import encode_job
from .layout_common import RawDataset

NO_SIZE_LIMIT = 1 << 62  # a rewritten shard holds exactly its recorded samples, whatever their size


class Plan:
    """What to write for one split: sources in write order, with their cls/uq/lab fields."""

    def __init__(self, split: str, sources: list, names: list[str], cls: np.ndarray, uq: np.ndarray, lab: np.ndarray):
        self.split, self.sources, self.names, self.cls, self.uq, self.lab = split, sources, names, cls, uq, lab

    def __len__(self) -> int:
        return len(self.sources)


def _train_split(raw: RawDataset, holdout: float, holdout_seed: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """(labelled mask, targets, counts) of the train samples in native order: the GCD split (docs/reference.md §7), or
    for your own images every labelled image but the held-out share (`splits.discovery_split`)."""
    if raw.dataset == DISCOVERY:
        labelled, targets, held = discovery_split(raw.train_labels, holdout, holdout_seed)
        return labelled, targets, discovery_counts(targets, held)
    labelled, targets = gcd_split(raw.train_labels, raw.known, PROP, SPLIT_SEED, novel_classes=raw.novel)
    return labelled, targets, split_counts(labelled, targets, len(raw.known), len(raw.test))


def plans(raw: RawDataset, holdout: float, holdout_seed: int) -> tuple[Plan, Plan, dict]:
    """(train plan, test plan, the split's counts): train samples in the fixed shuffled write order, test ones in native
    order, targets remapped with the known classes first."""
    labelled, targets, counts = _train_split(raw, holdout, holdout_seed)
    order = raw.known + raw.novel
    remap = {c: i for i, c in enumerate(order)}
    stray = sorted(set(raw.test_labels.tolist()) - set(order))
    if stray:
        raise ShardsError(f"test classes {stray[:10]} are not train classes")
    test_targets = np.asarray([remap[c] for c in raw.test_labels.tolist()], np.int64)
    n = len(raw.train)
    write_order = np.random.RandomState(ORDER_SEED).permutation(n)
    train = Plan(
        "train",
        [raw.train[i] for i in write_order],
        [raw.train_names[i] for i in write_order],
        targets[write_order],
        write_order,
        labelled[write_order],
    )
    nt = len(raw.test)
    test = Plan("test", raw.test, raw.test_names, test_targets, np.arange(nt), np.zeros(nt, bool))
    return train, test, counts


@contextmanager
def encoding_pool(workers: int) -> Iterator[object]:
    """`workers` forked encoding processes (None for one: encode in this process), terminated on exit."""
    if workers <= 1:
        yield None
        return
    with forked_pool(workers) as pool:
        yield pool


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o644, "", ""
    tar.addfile(info, io.BytesIO(data))


def _add_sample(tar: tarfile.TarFile, plan: Plan, pos: int, image_key: str, data: bytes) -> None:
    """Sample `pos` of `plan` as the tar members `<uq>.<image_key>`, `.cls`, `.uq` and `.lab`."""
    key = f"{int(plan.uq[pos]):08d}"
    _add(tar, f"{key}.{image_key}", data)
    _add(tar, key + ".cls", b"%d" % int(plan.cls[pos]))
    _add(tar, key + ".uq", b"%d" % int(plan.uq[pos]))
    _add(tar, key + ".lab", b"%d" % int(plan.lab[pos]))


def _skipped(plan: Plan, pos: int, error: str) -> dict:
    """The manifest's record of sample `pos`, whose image did not read or decode; reported on stderr."""
    name, why = terminal_safe(plan.names[pos]), terminal_safe(error)  # file names can hold escape sequences
    print(f"make-shards: skipped {name} ({plan.split}): {why}", file=sys.stderr)
    return {
        "split": plan.split,
        "uq": int(plan.uq[pos]),
        "labelled": bool(plan.lab[pos]),
        "source": plan.names[pos],
        "error": error,
    }


@dataclass
class ShardWriter:
    """Writes plans' samples as tar shards into `out`: resized to `resize`, encoded as `codec` = (image format, JPEG
    quality) by `pool` (None: in this process), each sample counted on `bar` (a progress bar, or None)."""

    out: Path
    resize: int
    codec: tuple[str, int]
    pool: object = None
    bar: object = None

    def append(self, plan: Plan, prefix: str, done: list[dict], size_bytes: int, on_shard) -> None:
        """Append shards of about `size_bytes` to `done` from position done[-1].end to the plan's end, calling
        `on_shard` after each finished one."""
        pos = done[-1]["start"] + done[-1]["count"] if done else 0
        results = self._encoded(plan, pos, len(plan))
        while pos < len(plan):
            name = f"{prefix}-{plan.split}-{len(done):05d}.tar"
            record = self._write_one(plan, name, pos, results, size_bytes, len(plan))
            done.append(record)
            pos += record["count"]
            on_shard()

    def rewrite(self, plan: Plan, rec: dict) -> None:
        """Write the shard of record `rec` again (its samples) and update the record; warn if the bytes differ."""
        stop = rec["start"] + rec["count"]
        results = self._encoded(plan, rec["start"], stop)
        new = self._write_one(plan, rec["name"], rec["start"], results, NO_SIZE_LIMIT, stop)
        if new["sha256"] != rec["sha256"]:
            print(f"make-shards: WARNING: rewritten {rec['name']} differs from the manifest", file=sys.stderr)
        rec.update(new)

    def _encoded(self, plan: Plan, start: int, stop: int) -> Iterator[tuple]:
        """(pos, bytes or None, error) for positions start..stop-1, in order."""
        fmt, quality = self.codec
        jobs = ((p, plan.sources[p], self.resize, quality, fmt) for p in range(start, stop))
        if self.pool is None:
            yield from map(encode_job, jobs)
        else:
            yield from self.pool.imap(encode_job, jobs, chunksize=8)

    def _write_one(
        self, plan: Plan, name: str, start: int, results: Iterator[tuple], size_bytes: int, stop_at: int
    ) -> dict:
        """Write positions start.. into `name` until it reaches `size_bytes` (or `stop_at`); atomic. A shard takes at
        least one position, so that a size below one sample's bytes still moves on."""
        skipped, written, pos = [], 0, start
        image_format = self.codec[0]

        def write(f) -> None:
            nonlocal written, pos
            with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                while pos < stop_at and (pos == start or f.tell() < size_bytes):
                    p, data, err = next(results)
                    assert p == pos, (p, pos)
                    if data is None:
                        skipped.append(_skipped(plan, p, err))
                    else:
                        _add_sample(tar, plan, p, image_format, data)
                        written += 1
                    pos += 1
                    if self.bar is not None:
                        self.bar.update(1)

        atomic_write(self.out / name, write)
        size = (self.out / name).stat().st_size
        return {
            "name": name,
            "start": start,
            "count": pos - start,
            "written": written,
            "bytes": size,
            "sha256": file_sha256(self.out / name),
            "skipped": skipped,
        }
