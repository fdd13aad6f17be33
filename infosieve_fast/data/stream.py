"""Shards -> uint8 batches for the trainer: a `GCDSource` over the output of `make-shards`.

Images come out decoded at a FIXED size S x S (S = the shards' `resize`, 256): the stored image (shorter side S,
aspect kept) is centre-cropped to S x S so batches stack. This departs from the reference, whose `RandomCrop(224)`
ranges over the whole non-square `Resize(256)` image: here the training crops (made on the device by
`augment.DeviceAugment`) range over its central S x S square. The test view (centre 224 of the centre 256) equals the
reference's `CenterCrop(224)` up to one pixel of rounding.

Two paths, chosen by the decoded size of the split against `memory_threshold_mb`:
- in memory: decode every sample once (worker processes), keep one uint8 tensor [N, 3, S, S] in RAM, or on `device`;
  batches are gathered from it. The labelled share uses `sampler.sample_epoch` exactly like `InMemoryGCD`.
- streaming: a WebDataset pipeline per DataLoader worker. Work is split over (rank, worker) slots: by shard when there
  are at least as many shards as slots, else by sample (every slot reads every shard and decodes only its samples).
  Training epochs are resampled: each epoch has its own shard order and sample-to-slot assignment (seeded by seed and
  epoch, the same on every rank); the stream runs on into the next epoch's data when a slot runs dry, so every rank
  yields the same number of batches, `n // (batch_size * world_size)`. The labelled share is approximated per sample:
  each sample is emitted Poisson(w) times, w = share / p for labelled and (1 - share) / (1 - p) for unlabelled samples
  (p = labelled fraction), which is what sampling n draws with replacement from those weights converges to; a shuffle
  buffer (of the undecoded bytes) spreads the repeats. `sampling="shuffle"` instead yields every sample at most once
  per epoch with no re-weighting.
The feature pass and the test pass deliver every sample exactly once across all ranks and workers, in a fixed order.

A truncated or damaged shard is reported (size check against the manifest when the source opens, a warning for each
read or decode error, and a count check after every exact pass) and its unreadable samples are skipped, never fatal.
uq: the manifest's `uq` is the native train index; when make-shards skipped unreadable images, the uq values are
compacted (native index minus the number of skipped ones before it) so that they run over 0..n_train-1.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import sys
import tarfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .augment import BufferPool, cpu_threads
from .base import Batch
from .sampler import reference_labelled_share, sample_epoch

DEFAULT_MEMORY_THRESHOLD_MB = 8192.0


try:  # imported here, not in the workers: forked DataLoader workers then start without re-importing
    import webdataset as wds
except ImportError:  # pragma: no cover
    wds = None


def _report(msg: str) -> None:
    print(f"infosieve data: WARNING: {msg}", file=sys.stderr, flush=True)


def _handler(exn: Exception) -> bool:
    """webdataset exception handler: report and go on with the next sample or shard."""
    _report(f"skipped unreadable shard data: {type(exn).__name__}: {exn}")
    return True


# ---- tar reading ------------------------------------------------------------------------------------------------
# A plain-Python tar reader over mmap: about 6x faster than webdataset's (`tarfile` parses every header field of every
# member: ~0.1 ms per sample, a third of a worker's time when it decodes 0.3 ms JPEGs, and in split-by-sample mode
# every worker parses every sample). It reads what `tarfile` writes (ustar, GNU long names, pax headers) and groups
# members into samples exactly as webdataset does (key = path up to the first dot of the file name, lower-case
# extension). `TAR_READER = "webdataset"` switches back to webdataset's reader.

TAR_READER = "fast"
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext


def _octal(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:
        raise tarfile.ReadError("base-256 numeric header fields are not supported")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise tarfile.ReadError(f"invalid number {text[:12]!r} in a header: damaged archive") from None


def _pax_records(data: bytes) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        out[key.decode("utf-8")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def tar_members(path: str) -> Iterator[tuple[str, bytes]]:
    """(name, data) of every regular file in the tar at `path`, in order; a damaged or truncated archive raises
    `tarfile.ReadError` after the members before the damage."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise tarfile.ReadError("empty file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        pos, long_name, pax = 0, None, {}
        while pos + 512 <= size:
            hdr = mm[pos : pos + 512]
            if hdr.count(0) == 512:
                return  # end-of-archive marker
            if _octal(hdr[148:156]) != sum(hdr) - sum(hdr[148:156]) + 256:
                raise tarfile.ReadError(f"bad header checksum at byte {pos:,}: damaged archive")
            n = _octal(hdr[124:136])
            kind = hdr[156:157]
            start, pos = pos + 512, pos + 512 + (n + 511) // 512 * 512
            if start + n > size:
                raise tarfile.ReadError(f"member at byte {start - 512:,} ends after the end of the file: truncated")
            if kind == b"L":  # GNU long name of the next member
                long_name = mm[start : start + n].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                continue
            if kind in (b"x", b"g"):  # pax header (per member / global)
                if kind == b"x":
                    pax = _pax_records(mm[start : start + n])
                continue
            if kind not in (b"0", b"\0", b"7"):  # directories, links, ...: not sample data
                long_name, pax = None, {}
                continue
            name = hdr[0:100].split(b"\0", 1)[0]
            if hdr[257:262] == b"ustar" and hdr[345:346] != b"\0":
                name = hdr[345:500].split(b"\0", 1)[0] + b"/" + name
            name = pax.get("path") or long_name or name.decode("utf-8", "surrogateescape")
            if "size" in pax:
                raise tarfile.ReadError("pax size override is not supported")
            long_name, pax = None, {}
            yield name, mm[start : start + n]
        if pos < size:
            raise tarfile.ReadError(f"{size - pos} stray bytes at the end: truncated")
    finally:
        mm.close()


def tar_samples(path: str) -> Iterator[dict]:
    """The samples of one shard: dicts of extension -> bytes, plus `__key__` and `__url__` (as webdataset's)."""
    sample: dict | None = None
    for name, data in tar_members(path):
        m = _KEY_EXT.match(name)
        if m is None:
            continue
        key, ext = m.group(1), m.group(2).lower()
        if sample is None or sample["__key__"] != key or ext in sample:
            if sample is not None:
                yield sample
            sample = {"__key__": key, "__url__": path}
        sample[ext] = data
    if sample is not None:
        yield sample


IMAGE_KEYS = ("jpg", "png")  # a sample's image, by the shards' --image-format
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _image_decoder():
    """torchvision's decoders (libjpeg-turbo: about 1.4x PIL's speed here; libpng), or PIL where torchvision has none.

    The format is read from the bytes (PNG signature, else JPEG), so both kinds of shards decode alike."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29 deprecates its image codecs
            from torchvision.io import ImageReadMode, decode_jpeg, decode_png

        def decode(data: bytes) -> Tensor:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                if data[:8] == _PNG_MAGIC:
                    return decode_png(buf, mode=ImageReadMode.RGB)
                return decode_jpeg(buf, mode=ImageReadMode.RGB)

    except ImportError:  # pragma: no cover - depends on the torchvision build
        import io

        from PIL import Image

        def decode(data: bytes) -> Tensor:
            arr = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            return torch.from_numpy(arr.copy()).permute(2, 0, 1)

    return decode


_decode = _image_decoder()


def decode_fixed(data: bytes, size: int) -> Tensor:
    """JPEG or PNG bytes -> uint8 [3, size, size]: decode as RGB, centre-crop to size x size."""
    img = _decode(data)
    h, w = img.shape[-2:]
    if h < size or w < size:
        raise ValueError(f"stored image of {h}x{w} is smaller than {size}x{size}")
    top, left = (h - size) // 2, (w - size) // 2
    return img[:, top : top + size, left : left + size]


class _Stream(IterableDataset):
    """Per-worker pipeline: shards -> samples (webdataset) -> this slot's share -> [repeat, shuffle] -> decode."""

    def __init__(self, urls: list[str], *, mode: str, size: int, batch_size: int, rank: int, world: int, n_uq: int,
                 skipped: np.ndarray, epoch: int = 0, seed: int = 0, weights: tuple[float, float] | None = None,
                 buffer: int = 2000):  # fmt: skip
        self.urls, self.mode, self.size, self.batch_size = urls, mode, size, batch_size
        self.rank, self.world, self.n_uq, self.skipped = rank, world, n_uq, skipped
        self.epoch, self.seed, self.weights, self.buffer = epoch, seed, weights, buffer

    def _slot(self) -> tuple[int, int]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * nw + wid, self.world * nw

    @staticmethod
    def _raw_samples(urls: list[str]) -> Iterator[dict]:
        if TAR_READER == "webdataset":
            if wds is None:
                raise ImportError("TAR_READER = 'webdataset' needs the webdataset package: pip install webdataset")
            yield from wds.tariterators.tarfile_samples([{"url": u} for u in urls], handler=_handler)
            return
        for url in urls:
            try:
                yield from tar_samples(url)
            except Exception as exn:  # a missing, truncated or damaged shard: report, go on with the next one
                _report(f"skipped unreadable shard data in {url}: {type(exn).__name__}: {exn}")

    def _samples(self, urls: list[str]) -> Iterator[dict]:
        for sample in self._raw_samples(urls):
            if not all(k in sample for k in ("cls", "uq", "lab")) or not any(k in sample for k in IMAGE_KEYS):
                _report(f"skipped incomplete sample {sample.get('__key__')} in {sample.get('__url__')}")
                continue
            yield sample

    def _exact(self) -> Iterator[dict]:
        slot, n_slots = self._slot()
        if len(self.urls) >= n_slots:
            yield from self._samples(self.urls[slot::n_slots])
        else:
            for s in self._samples(self.urls):
                if int(s["uq"]) % n_slots == slot:
                    yield s

    def _epoch(self, epoch: int) -> Iterator[dict]:
        slot, n_slots = self._slot()
        rng = np.random.default_rng([self.seed, epoch])  # identical on every rank and worker
        order = [self.urls[i] for i in rng.permutation(len(self.urls))]
        local = np.random.default_rng([self.seed, epoch, slot, 1])
        if len(order) >= n_slots:
            source = self._samples(order[slot::n_slots])
        else:
            owner = rng.permutation(self.n_uq) % n_slots
            source = (s for s in self._samples(order) if owner[int(s["uq"])] == slot)
        buf: list[dict] = []
        for s in source:
            reps = 1 if self.weights is None else local.poisson(self.weights[int(s["lab"])])
            for _ in range(reps):
                if len(buf) < self.buffer:
                    buf.append(s)
                    continue
                i = local.integers(len(buf))
                buf[i], s = s, buf[i]
                yield s
        local.shuffle(buf)
        yield from buf

    def _decoded(self, samples: Iterator[dict]) -> Iterator[tuple]:
        for s in samples:
            try:
                img = decode_fixed(s["jpg"] if "jpg" in s else s["png"], self.size)
            except Exception as exn:
                _report(f"skipped sample {s.get('__key__')} of {s.get('__url__')}: {type(exn).__name__}: {exn}")
                continue
            yield img, int(s["cls"]), int(s["uq"]), int(s["lab"])

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """Full batches, plus one partial batch at the end of the pass (exact) or of every epoch (train)."""
        if self.mode == "exact":
            yield from self._batches(self._exact())
            return
        epoch, empty = self.epoch, 0
        while True:  # resampled epochs, until the consumer stops
            n = 0
            for batch in self._batches(self._epoch(epoch)):
                n += len(batch[0])
                yield batch
            empty = 0 if n else empty + 1
            if empty >= 2:
                raise RuntimeError("the training stream yields no samples: are all shards unreadable?")
            epoch += 1

    @staticmethod
    def _new_images(b: int, size: int) -> Tensor:
        """The uint8 batch the decoded images are written into. In a DataLoader worker it is allocated in shared
        memory, so handing it to the main process moves no data (otherwise the batch would be copied into shared
        memory when it is sent)."""
        if get_worker_info() is not None:
            try:
                storage = torch.UntypedStorage._new_shared(b * 3 * size * size)
                return torch.empty(0, dtype=torch.uint8).set_(storage).view(b, 3, size, size)
            except Exception:  # pragma: no cover - private API missing: the DataLoader copies instead
                pass
        return torch.empty(b, 3, size, size, dtype=torch.uint8)

    def _batches(self, samples: Iterator[dict]) -> Iterator[tuple]:
        b, size = self.batch_size, self.size
        images = self._new_images(b, size)
        meta = np.empty((b, 3), np.int64)
        k = 0
        for img, cls, uq, lab in self._decoded(samples):
            images[k].copy_(img)
            meta[k] = cls, uq, lab
            k += 1
            if k == b:
                yield self._pack(images, meta, k)
                images = self._new_images(b, size)
                k = 0
        if k:
            yield self._pack(images, meta, k)

    def _pack(self, images: Tensor, meta: np.ndarray, k: int) -> tuple:
        uq = meta[:k, 1]
        if len(self.skipped):
            uq = uq - np.searchsorted(self.skipped, uq)
        m = torch.from_numpy(meta[:k].copy())
        return images[:k], m[:, 0], torch.from_numpy(uq.copy()), m[:, 2].bool()


class ShardSource:
    """`GCDSource` over a shards folder (train split), plus `test_batches` for the test split.

    `n_train` is the number of samples of `split` (for `split="test"`, the test set's size).
    """

    def __init__(
        self,
        shards_dir: str | Path,
        *,
        split: str = "train",
        labelled_share: float | None = None,
        memory_threshold_mb: float = DEFAULT_MEMORY_THRESHOLD_MB,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 2,
        seed: int = 0,
        device: torch.device | str | None = None,
        sampling: str = "weighted",
        shuffle_buffer: int = 2000,
        verify: bool = False,
    ):
        self.dir = Path(shards_dir)
        path = self.dir / "manifest.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: make the shards with `infosieve make-shards` first")
        self.manifest = json.loads(path.read_text())
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if sampling not in ("weighted", "shuffle"):
            raise ValueError(f"sampling must be 'weighted' or 'shuffle', got {sampling!r}")
        if rank is None or world_size is None:
            dist = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = torch.distributed.get_rank() if dist else 0
            world_size = torch.distributed.get_world_size() if dist else 1
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.split, self.labelled_share, self.sampling = split, labelled_share, sampling
        self.rank, self.world_size, self.num_workers, self.seed = rank, world_size, num_workers, seed
        self.device = torch.device(device) if device is not None else None
        self.shuffle_buffer, self.memory_threshold_mb, self.verify = shuffle_buffer, memory_threshold_mb, verify
        m = self.manifest
        self.dataset = m["dataset"]
        self.size = int(m["resize"])
        self.n_old, self.n_classes = int(m["n_old"]), int(m["n_classes"])
        info = m["splits"][split]
        self.records = info["shards"]
        self.urls = [str(self.dir / r["name"]) for r in self.records]
        self.n_uq = int(info["n"])  # native index space
        self.skipped = np.sort(np.asarray([s["uq"] for s in m["skipped"] if s["split"] == split], np.int64))
        self.n_train = self.n_uq - len(self.skipped)
        self.n_labelled = m["counts"]["labelled"] - sum(
            1 for s in m["skipped"] if s["split"] == "train" and s.get("labelled", False)
        )
        self.problems = self._check_files()
        self.decoded_mb = self.n_train * 3 * self.size * self.size / 2**20
        self.in_memory = self.decoded_mb <= memory_threshold_mb
        self._mem: dict | None = None
        self._pool = BufferPool(3)  # in-memory batches (CPU): the caller's current and previous ones, the next one
        self._test: ShardSource | None = None

    # ---- checks -------------------------------------------------------------------------------------------------

    def _check_files(self) -> list[str]:
        problems = []
        for rec, url in zip(self.records, self.urls, strict=True):
            p = Path(url)
            if not p.is_file():
                problems.append(f"shard {p} is missing: its {rec['written']} samples are skipped")
            elif p.stat().st_size != rec["bytes"]:
                problems.append(
                    f"shard {p} has {p.stat().st_size:,} bytes, the manifest says {rec['bytes']:,}: truncated or "
                    "damaged; its unreadable samples are skipped (re-run make-shards on this folder to repair it)"
                )
            elif self.verify:
                from .shards import _sha256

                if _sha256(p) != rec["sha256"]:
                    problems.append(f"shard {p} does not match its sha256 in the manifest: damaged")
        for msg in problems:
            _report(msg)
        return problems

    # ---- pipelines ----------------------------------------------------------------------------------------------

    def _loader(self, stream: _Stream) -> Iterator[tuple]:
        if self.num_workers <= 0:
            yield from stream
            return
        pin = self.device is not None and self.device.type == "cuda"
        loader = DataLoader(stream, batch_size=None, num_workers=self.num_workers, pin_memory=pin, prefetch_factor=2)
        yield from loader

    def _exact_stream(self, batch_size: int, rank: int, world: int) -> _Stream:
        return _Stream(self.urls, mode="exact", size=self.size, batch_size=batch_size, rank=rank, world=world,
                       n_uq=self.n_uq, skipped=self.skipped)  # fmt: skip

    def _to_batch(self, parts: tuple) -> Batch:
        images, targets, uq, lab = parts
        batch = Batch(images, targets.long(), uq.long(), lab.bool())
        if self.device is not None:
            batch = batch.to(self.device, non_blocking=True)
        return batch

    def _exact_batches(self, batch_size: int) -> Iterator[Batch]:
        """Every sample of this rank's share once: full worker batches pass through, the workers' tails are merged."""
        n = 0
        for batch in self._full_batches(self._loader(self._exact_stream(batch_size, self.rank, self.world_size)),
                                        batch_size, None):  # fmt: skip
            n += len(batch.uq)
            yield batch
        expected = self._expected_exact()
        if n != expected:
            _report(f"{self.dir} ({self.split}, rank {self.rank}): {n} samples read, {expected} expected")

    def _expected_exact(self) -> int:
        n_slots = self.world_size * max(self.num_workers, 1)
        nw = max(self.num_workers, 1)
        if len(self.urls) >= n_slots:
            mine = [r for i, r in enumerate(self.records) if (i % n_slots) // nw == self.rank]
            return sum(r["written"] for r in mine)
        uq = np.setdiff1d(np.arange(self.n_uq), self.skipped)
        return int(((uq % n_slots) // nw == self.rank).sum())

    # ---- GCDSource ----------------------------------------------------------------------------------------------

    def feature_batches(self, batch_size: int) -> Iterator[Batch]:
        """Every sample of the split exactly once across ranks (this rank's share), fixed order, no augmentation."""
        if self.in_memory:
            yield from self._memory_exact(batch_size)
        else:
            yield from self._exact_batches(batch_size)

    def train_batches(self, batch_size: int, epoch: int, seed: int) -> Iterator[Batch]:
        """One epoch: `n_train // (batch_size * world_size)` full batches on every rank."""
        if self.split != "train":
            raise ValueError("train_batches needs split='train'")
        n_batches = self.n_train // (batch_size * self.world_size)
        if n_batches == 0:
            raise ValueError(f"{self.n_train} samples are fewer than one batch of {batch_size} x {self.world_size}")
        if self.in_memory:
            yield from self._memory_train(batch_size, epoch, seed, n_batches)
            return
        weights = None
        if self.sampling == "weighted":
            p = self.n_labelled / self.n_train
            share = self.labelled_share
            if share is None:
                share = reference_labelled_share(self.n_labelled, self.n_train - self.n_labelled)
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"labelled share must be in [0, 1] (or None for the reference's), got {share}")
            if (share > 0 and p == 0) or (share < 1 and p == 1):
                raise ValueError(f"labelled share {share} needs both labelled and unlabelled samples")
            weights = ((1 - share) / (1 - p) if p < 1 else 0.0, share / p if p > 0 else 0.0)  # index by lab
        stream = _Stream(
            self.urls, mode="train", size=self.size, batch_size=batch_size, rank=self.rank, world=self.world_size,
            n_uq=self.n_uq, skipped=self.skipped, epoch=epoch, seed=self.seed * 1_000_003 + seed, weights=weights,
            buffer=self.shuffle_buffer,
        )  # fmt: skip
        yield from self._full_batches(self._loader(stream), batch_size, n_batches)

    def _full_batches(self, parts_iter: Iterator[tuple], batch_size: int, limit: int | None) -> Iterator[Batch]:
        """Workers' full batches pass through; their partial ones (end of a pass or epoch) are merged.

        `limit=None`: a finite exact pass, whose last batch may be partial. Otherwise stop after `limit` batches.
        """
        tails: list[tuple] = []
        n_tail, count = 0, 0
        for parts in parts_iter:
            if len(parts[0]) == batch_size:
                out = [parts]
            else:
                tails.append(parts)
                n_tail += len(parts[0])
                out = []
                if n_tail >= batch_size:
                    merged = [torch.cat([t[i] for t in tails]) for i in range(4)]
                    out = [tuple(x[:batch_size] for x in merged)]
                    rest = tuple(x[batch_size:] for x in merged)
                    tails, n_tail = ([rest], len(rest[0])) if len(rest[0]) else ([], 0)
            for p in out:
                yield self._to_batch(p)
                count += 1
                if limit is not None and count >= limit:
                    return
        if limit is None and tails:
            merged = [torch.cat([t[i] for t in tails]) for i in range(4)]
            for start in range(0, len(merged[0]), batch_size):
                yield self._to_batch(tuple(x[start : start + batch_size] for x in merged))

    def test_batches(self, batch_size: int) -> Iterator[Batch]:
        """The test split, every sample once across ranks (this rank's share), in a fixed order."""
        if self.split == "test":
            yield from self.feature_batches(batch_size)
            return
        if self._test is None:
            self._test = ShardSource(
                self.dir, split="test", memory_threshold_mb=self.memory_threshold_mb, rank=self.rank,
                world_size=self.world_size, num_workers=self.num_workers, seed=self.seed, device=self.device,
            )  # fmt: skip
        yield from self._test.test_batches(batch_size)

    # ---- in-memory path -----------------------------------------------------------------------------------------

    def load(self) -> None:
        """Decode the whole split once into memory (done on first use; call it to pay the cost up front)."""
        if self._mem is not None:
            return
        n, s = self.n_train, self.size
        dev = self.device if self.device is not None else torch.device("cpu")
        images = torch.empty(n, 3, s, s, dtype=torch.uint8, device=dev)
        targets = torch.full((n,), -1, dtype=torch.long)
        labelled = torch.zeros(n, dtype=torch.bool)
        present = torch.zeros(n, dtype=torch.bool)
        for imgs, cls, uq, lab in self._loader(self._exact_stream(256, 0, 1)):
            images[uq.to(dev)] = imgs.to(dev, non_blocking=True)
            targets[uq], labelled[uq], present[uq] = cls, lab, True
        missing = int((~present).sum())
        if missing:
            _report(f"{self.dir} ({self.split}): {missing} of {n} samples could not be read and are left out")
        idx = torch.nonzero(present).flatten()
        self._mem = {"images": images, "targets": targets, "labelled": labelled, "present": idx}

    def _memory_batch(self, idx: Tensor) -> Batch:
        m = self._mem
        assert m is not None
        data = m["images"]
        dev = data.device
        if dev.type == "cpu":  # into a reused buffer: a fresh 25 MB tensor per batch costs more than the copy
            images = torch.index_select(data, 0, idx, out=self._pool.get((len(idx), *data.shape[1:]), data.dtype))
        else:
            images = data[idx.to(dev)]
        return Batch(images, m["targets"][idx].to(dev), idx.to(dev), m["labelled"][idx].to(dev))

    def _memory_exact(self, batch_size: int) -> Iterator[Batch]:
        self.load()
        mine = self._mem["present"][self.rank :: self.world_size]
        yield from self._lookahead(mine[start : start + batch_size] for start in range(0, len(mine), batch_size))

    def _memory_train(self, batch_size: int, epoch: int, seed: int, n_batches: int) -> Iterator[Batch]:
        self.load()
        present = self._mem["present"]
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + seed) * 100_003 + epoch)
        if self.sampling == "weighted":
            pos = sample_epoch(self._mem["labelled"][present], len(present), self.labelled_share, gen)
        else:
            pos = torch.randperm(len(present), generator=gen)
        order = present[pos]
        step = batch_size * self.world_size
        rows = (order[b * step + self.rank * batch_size :][:batch_size] for b in range(n_batches))
        yield from self._lookahead(rows)

    def _lookahead(self, rows: Iterator[Tensor]) -> Iterator[Batch]:
        """`_memory_batch` of each index set; on the CPU the next batch is gathered in a background thread while the
        caller works on the current one (the gather is ~10% of an in-memory training step on the CPU)."""
        threads = cpu_threads(1) if self._mem["images"].device.type == "cpu" else None
        if threads is None:
            yield from map(self._memory_batch, rows)
            return
        pending = None
        for idx in rows:
            nxt = threads.submit(self._memory_batch, idx)
            if pending is not None:
                yield pending.result()
            pending = nxt
        if pending is not None:
            yield pending.result()
