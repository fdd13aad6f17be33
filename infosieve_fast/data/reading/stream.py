"""Shards -> uint8 batches for the trainer: a `GCDSource` over the output of `make-shards`, or over WebDataset shards
written by other tools (`data.intake`: brace patterns, globs, lists, configurable keys, make-shards' split).

When the source opens, one pass over the tar headers indexes every sample (shard, byte offset, stored size, target,
uq, labelled flag; `tar.index_rows`; saved beside the shards, reused while they are unchanged: `intake.cached_index`),
so any sample can be read by offset and an epoch can be any global order:
- training draws exactly N samples per epoch with the reference's `WeightedRandomSampler` weights (or a permutation,
  `sampling="shuffle"`) from one generator seeded by (seed, epoch), the same on every rank: a fresh shuffle across all
  shards every epoch. Global batch b of `batch_size x world_size` draws is split over the ranks (rank r takes rows
  r·B..(r+1)·B), and a rank's batches go round-robin to its DataLoader workers, which read and decode them;
- the feature and test passes give every sample exactly once across ranks: rank r reads the r-th contiguous share of
  the samples in storage order (sequential reads).

Images are served with the shorter side `resize` (default: the manifest's; an image stored at another size is resized
when decoded, on the CPU or on the GPU), aspect kept, as the reference's `Resize(256)`:
the training crops range over the whole image, and the test view is the centre crop of the whole image. Batches of
images of different sizes are padded into one canvas with `Batch.sizes` (`decode.pad_into`); `max_aspect` can cap the
longer side.

Where the decoding happens:
- `decode="cpu"`: in the DataLoader workers (libjpeg-turbo);
- `decode="gpu"`: the workers only read the bytes and the main process decodes the batch on the GPU (nvJPEG,
  `torchvision.io.decode_jpeg(..., device=...)`); `"auto"` picks it when `device` is a CUDA device. A batch nvJPEG
  fails on is decoded on the CPU instead (`decode.decode_gpu`; reported once);
- a decoded cache, chosen by `cache` ("auto": on the GPU when the decoded split fits `gpu_cache_share` of the GPU's
  free memory, else in RAM below `memory_threshold_mb`, else none): the split is decoded once (each rank decodes
  only its share, then the ranks exchange them) and every later pass serves crops from it without any CPU decoding
  (`cache.DecodedCache`).
`decode_counts` keeps how many images were decoded where (each epoch record holds an epoch's: `decode.DecodeWindow`).
The DataLoader workers are forked, or started from a forkserver once CUDA is initialised (`workers.py`).

Unreadable samples (a damaged shard, a header or an image that does not decode) are skipped and counted, never fatal:
`unreadable()` lists them, the trainer leaves them out of the clustering and the metrics, `exclude` keeps them out of
training draws, and the run folder lists them (`unreadable.json`). uq: the manifest's `uq` is the native train index;
when make-shards skipped unreadable images, the uq values are compacted (native index minus the number of skipped
ones before it) so that they run over 0..n_train-1.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, get_worker_info

from ...common import distributed as dist
from ...common.labels import NO_LABEL
from ...common.shown_text import terminal_safe
from ...common.worker_processes import start_reader_worker, stop_signals_blocked
from ...config.settings import DataConfig, IntakeConfig
from ..shard_format import DISCOVERY
from ..shard_manifest import ManifestError, read_manifest, shard_file_problems
from .base import Batch
from .cache import DecodedCache, cache_device
from .decode import DecodeCounts, as_buffer, cap_aspect, decode_cpu, decode_gpu, pad_into, resize_uint8, served_sizes
from .intake import is_manifest_folder, make_shards_index_cached, open_foreign
from .sampler import sample_epoch
from .tar import ShardIndex, open_mmap
from .workers import worker_context

CACHE_MODES = ("auto", "gpu", "cpu", "off")
DECODE_MODES = ("auto", "cpu", "gpu")
SAMPLING_MODES = ("weighted", "shuffle")
_CHOICES = {"split": ("train", "test"), "sampling": SAMPLING_MODES, "cache": CACHE_MODES, "decode": DECODE_MODES}
FOREIGN = "webdataset"  # the dataset name of foreign shards
FOREIGN_SIZE = 256  # the shorter side foreign shards' images are served at unless data.resize says otherwise


def _is_webp(data) -> bool:
    head = bytes(data[:12])
    return head[:4] == b"RIFF" and head[8:12] == b"WEBP"


def decode_image(data) -> Tensor:
    """JPEG, PNG or WebP bytes -> RGB uint8 [3, H, W] on the CPU."""
    if not _is_webp(data):
        return decode_cpu(data)
    from torchvision.io import ImageReadMode, decode_webp

    return decode_webp(as_buffer(data), mode=ImageReadMode.RGB)


def _report(msg: str) -> None:
    print(f"infosieve data: WARNING: {terminal_safe(msg)}", file=sys.stderr, flush=True)


def _shared_uint8(shape: tuple[int, ...]) -> Tensor:
    """A uint8 tensor that a DataLoader worker can hand to the main process without a copy (shared memory)."""
    if get_worker_info() is not None:
        try:
            storage = torch.UntypedStorage._new_shared(int(np.prod(shape)))
            return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)
        except Exception:  # pragma: no cover - private API missing: the DataLoader copies instead
            pass
    return torch.empty(shape, dtype=torch.uint8)


def _as_is(batch):  # the DataLoader's collate_fn: the reader already returns whole batches
    return batch


class _Reader(Dataset):
    """Reads samples by index row. `__getitems__` (called by the DataLoader's workers with one batch of rows) returns
    `(images, sizes, cls, uq, lab, failed)` with the images decoded (`decode=True`), or `(bytes, lengths, cls, uq, lab,
    failed)` with the images' encoded bytes concatenated, for decoding on the GPU. `failed`: uq of the rows that did
    not read or decode (left out of the batch)."""

    def __init__(
        self, urls: list[str], index: ShardIndex, uq: np.ndarray, decode: bool, max_aspect: float | None, hw: np.ndarray
    ):
        self.urls, self.index, self.uq, self.decode, self.max_aspect = urls, index, uq, decode, max_aspect
        self.hw = hw  # per row: the size it is served at before the aspect cap (`load_hw`)
        self._mmaps: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.uq)

    def __getitem__(self, row: int):
        return self.__getitems__([row])

    def _bytes(self, row: int) -> bytes:
        s = int(self.index.shard[row])
        if s not in self._mmaps:
            self._mmaps[s] = open_mmap(self.urls[s])
        a = int(self.index.offset[row])
        return self._mmaps[s][a : a + int(self.index.length[row])]

    def __getitems__(self, rows: list[int]) -> tuple:
        rows = np.asarray(rows, np.int64)
        ok, parts, failed = [], [], []
        for row in rows:
            try:
                data = self._bytes(row)
                if self.decode:
                    data = cap_aspect(resize_uint8(decode_image(data), self.hw[row]), self.max_aspect)
                parts.append(data)
                ok.append(row)
            except Exception as exn:
                url = self.urls[int(self.index.shard[row])]
                _report(f"skipped unreadable sample uq {self.uq[row]} in {url}: {type(exn).__name__}: {exn}")
                failed.append(self.uq[row])
        ok = np.asarray(ok, np.int64)
        meta = tuple(torch.from_numpy(a[ok]) for a in (self.index.cls, self.uq, self.index.lab))
        failed_t = torch.as_tensor(failed, dtype=torch.long)
        if not self.decode:
            lengths = torch.tensor([len(p) for p in parts], dtype=torch.long)
            flat = _shared_uint8((int(lengths.sum()),))
            flat.numpy()[:] = np.frombuffer(b"".join(parts), np.uint8)
            return flat, lengths, *meta, failed_t
        if not parts:
            return torch.empty(0, 3, 1, 1, dtype=torch.uint8), None, *meta, failed_t
        hw = np.asarray([p.shape[1:] for p in parts])
        canvas, sizes = pad_into(parts, _shared_uint8((len(parts), 3, *hw.max(0))))
        return canvas, (None if (hw == hw[0]).all() else sizes), *meta, failed_t


@dataclass(frozen=True)
class ReadOptions:
    """How a `ShardSource` reads its shards: the split; the labelled share of each batch (`sampler.sample_epoch`; None:
    as the data falls); the decoded cache (`cache`, `memory_threshold_mb`, `gpu_cache_share`: `cache.cache_device`);
    the DataLoader workers; the seed of the epoch orders; where images are decoded (`decode`); the aspect cap and the
    served size (`max_aspect`, `resize`: None serves the stored size); whether shards are hashed against the manifest
    (`verify`); how foreign shards are read (`intake`)."""

    split: str = "train"
    labelled_share: float | None = None
    memory_threshold_mb: float = DataConfig.memory_threshold_mb
    num_workers: int = 2
    seed: int = 0
    sampling: str = "weighted"
    cache: str = "auto"
    gpu_cache_share: float = 0.5
    decode: str = "auto"
    max_aspect: float | None = None
    verify: bool = False
    resize: int | None = None
    intake: IntakeConfig = field(default_factory=IntakeConfig)

    def __post_init__(self):
        for name, value in (
            ("split", self.split),
            ("sampling", self.sampling),
            ("cache", self.cache),
            ("decode", self.decode),
        ):
            if value not in _CHOICES[name]:
                raise ValueError(f"{name} must be one of {_CHOICES[name]}, got {value!r}")
        if self.max_aspect is not None and self.max_aspect < 1:
            raise ValueError(f"max_aspect must be >= 1 (or None: no cap), got {self.max_aspect}")

    @classmethod
    def of_config(cls, data: DataConfig, seed: int) -> ReadOptions:
        """The train split read as `data` says, its epoch orders drawn from the run's `seed`."""
        return cls(
            labelled_share=data.labelled_share,
            memory_threshold_mb=data.memory_threshold_mb,
            num_workers=data.num_workers,
            seed=seed,
            sampling=data.sampling,
            cache=data.cache,
            gpu_cache_share=data.gpu_cache_share,
            decode=data.decode,
            max_aspect=data.max_aspect,
            resize=data.resize,
            intake=data.intake,
        )


class ShardSource:
    """`GCDSource` over a shards folder (train split), plus `test_batches` for the test split.

    `n_train` is the number of samples of `split` (for `split="test"`, the test set's size), readable or not.
    """

    def __init__(
        self,
        shards_dir: str | Path | list,
        options: ReadOptions = ReadOptions(),
        *,
        device: torch.device | str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        if rank is None or world_size is None:
            rank, world_size = dist.get_rank(), dist.get_world_size()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.options, self.split = options, options.split
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.gpu_decode = options.decode == "gpu" or (options.decode == "auto" and self.device.type == "cuda")
        self.decode_counts = DecodeCounts()  # images decoded so far, by where (a cached pass adds none)
        if self.gpu_decode and self.device.type != "cuda":
            raise ValueError(f"decode='gpu' needs a CUDA device, got device={self.device}: use decode='cpu'")
        if is_manifest_folder(shards_dir):
            skipped = self._open_manifest(Path(shards_dir), self.split)
        elif self.split == "test":
            raise ValueError(f"{shards_dir}: foreign shards have no test split (only make-shards writes one)")
        else:
            skipped = self._open_foreign(shards_dir)
        # the shorter side images are served at (resized on load when it differs)
        self.size = options.resize or self.size
        for msg in self.problems:
            _report(msg)
        self._map_rows(skipped)
        self._unreadable = set(np.flatnonzero(self.row_of_uq < 0).tolist())  # not in any readable shard
        if self._unreadable:
            missing = f"{len(self._unreadable)} of {self.n_train} samples are in no readable shard"
            _report(f"{self.dir} ({self.split}): {missing}")
        self._excluded = np.zeros(self.n_train, bool)
        self.decoded_mb = float((3 * self.served_hw.prod(1)).sum()) / 2**20
        self.cache_device = cache_device(
            options.cache, self.device, self.decoded_mb, options.gpu_cache_share, options.memory_threshold_mb
        )
        self.in_memory = self.cache_device is not None
        self._cache: DecodedCache | None = None
        self._test: ShardSource | None = None

    def _map_rows(self, skipped: np.ndarray) -> None:
        """Per index row its compacted uq (`skipped`: the uq make-shards skipped) and served size; per uq its row (-1:
        in no readable shard) and labelled flag."""
        self.uq = self.index.uq - np.searchsorted(skipped, self.index.uq)  # compacted, per index row
        outside = (self.uq < 0) | (self.uq >= self.n_train)
        if outside.any():
            raise ManifestError(
                f"{self.dir}: {int(outside.sum())} sample(s) of its shards have a uq outside the manifest's "
                f"{self.n_train:,} {self.split} samples (first: {int(self.index.uq[outside][0])}): the manifest does "
                "not describe these shards (run make-shards again into a new --out)"
            )
        self.row_of_uq = np.full(self.n_train, -1, np.int64)
        self.row_of_uq[self.uq] = np.arange(len(self.uq))
        self.labelled = np.zeros(self.n_train, bool)
        self.labelled[self.uq] = self.index.lab
        self.n_labelled = int(self.labelled.sum())
        self.load_hw, self.served_hw = served_sizes(self.index.hw, self.size, self.options.max_aspect)  # per index row

    def _open_manifest(self, folder: Path, split: str) -> np.ndarray:
        """Open a make-shards folder's `split`; returns the uq of the images make-shards skipped (sorted)."""
        self.dir = folder
        self.manifest = m = read_manifest(folder, split)
        self.dataset = m["dataset"]
        self.size = int(m["resize"])
        self.n_old = int(m["n_old"])
        self.n_classes = None if m["n_classes"] is None else int(m["n_classes"])  # None: unknown (your own images)
        self.class_names = list(m["classes"]["names"])  # target order
        info = m["splits"][split]
        self.records = info["shards"]
        self.urls = [str(folder / r["name"]) for r in self.records]
        skipped = np.sort(np.asarray([s["uq"] for s in m["skipped"] if s["split"] == split], np.int64))
        self.n_train = int(info["n"]) - len(skipped)
        problems = shard_file_problems(self.records, self.urls, self.options.verify)
        self.index, more, self.reused_index = make_shards_index_cached(self.urls, self.options.intake.index_cache)
        self.problems = problems + more
        self._check_labels()
        return skipped

    def _check_labels(self) -> None:
        """Every sample's `.cls` is one of the manifest's classes (or no label), and every labelled one a known class,
        before anything is sized by them: every method trains on these labels (those that run no pseudo-label round,
        whose epochs check nothing, too)."""
        cls = self.index.cls
        outside = (cls != NO_LABEL) & ((cls < 0) | (cls >= len(self.class_names)))
        if outside.any():
            row = int(np.flatnonzero(outside)[0])
            raise ManifestError(
                f"{self.urls[int(self.index.shard[row])]}: sample uq {int(self.index.uq[row])} has the .cls label "
                f"{int(cls[row])}, outside the manifest's {len(self.class_names)} classes ({int(outside.sum())} such "
                "sample(s)): the shards were changed after make-shards wrote them; run make-shards again"
            )
        novel = self.index.lab & (cls >= self.n_old)  # a labelled sample must be of a known class
        if novel.any():
            row = int(np.flatnonzero(novel)[0])
            raise ManifestError(
                f"{self.urls[int(self.index.shard[row])]}: sample uq {int(self.index.uq[row])} is labelled with class "
                f"{int(cls[row])} ({self.class_names[int(cls[row])]}), a novel one: labelled samples are of the "
                f"manifest's {self.n_old} known classes ({int(novel.sum())} such sample(s)): the shards were changed "
                "after make-shards wrote them; run make-shards again"
            )

    def held_out(self) -> np.ndarray:
        """uq (ascending) of the held-out labelled images of shards of your own images (`make-shards --dataset
        discovery --holdout SHARE`): labelled images of the known classes served as unlabelled ones (`lab` 0), their
        class kept as their target for evaluation. Empty for every other dataset (their unlabelled images are the
        GCD split's, not held out)."""
        if self.dataset != DISCOVERY:
            return np.zeros(0, np.int64)
        return np.sort(self.uq[~self.index.lab & (self.index.cls != NO_LABEL)])

    def _open_foreign(self, spec) -> np.ndarray:
        """Open foreign WebDataset shards (data/reading/intake.py): every readable sample is a train sample."""
        opened = open_foreign(spec, self.options.intake)
        self.dir = Path(spec) if isinstance(spec, (str, Path)) else Path(opened.urls[0]).parent
        self.manifest = {"dataset": FOREIGN, "counts": {"test": 0}}  # no test split
        self.dataset, self.size = FOREIGN, FOREIGN_SIZE
        self.n_old, self.class_names = opened.n_old, opened.class_names
        self.n_classes = len(self.class_names)
        self.records = [{"name": Path(u).name} for u in opened.urls]
        self.urls, self.index, self.reused_index = opened.urls, opened.index, opened.reused_index
        self.n_train = len(self.index)
        self.problems = opened.problems
        return np.zeros(0, np.int64)

    # ---- reading ------------------------------------------------------------------------------------------------

    def _read(self, batches: list[np.ndarray], device: torch.device | None = None) -> Iterator[Batch]:
        """Batches of the given index rows, in order, on `device` (default: the source's), read (and decoded, unless
        on the GPU) by the workers."""
        reader = _Reader(self.urls, self.index, self.uq, not self.gpu_decode, self.options.max_aspect, self.load_hw)
        device = self.device if device is None else device
        workers = self.options.num_workers
        if workers <= 0:
            parts_iter: Iterator[tuple] = (reader.__getitems__(rows) for rows in batches)
        else:
            with stop_signals_blocked():  # its workers are forked here: see worker_processes.py
                parts_iter = iter(
                    DataLoader(
                        reader,
                        batch_sampler=[rows.tolist() for rows in batches],
                        num_workers=workers,
                        collate_fn=_as_is,
                        pin_memory=self.device.type == "cuda",
                        prefetch_factor=2,
                        multiprocessing_context=worker_context(preload=__name__),
                        worker_init_fn=start_reader_worker,
                    )
                )
        for parts in parts_iter:
            images, sizes, cls, uq, lab, failed = parts
            self._unreadable.update(failed.tolist())
            if self.gpu_decode:
                images, sizes, keep = self._decode_on_gpu(images, sizes, uq)
                cls, uq, lab = cls[keep], uq[keep], lab[keep]
            else:
                self.decode_counts.cpu += len(uq)  # decoded by the reader
            if len(uq):
                batch = Batch(images, cls.long(), uq.long(), lab.bool(), sizes)
                yield batch.to(device, non_blocking=True)

    def _decode_on_gpu(self, flat: Tensor, lengths: Tensor, uq: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        encoded = list(torch.split(flat, lengths.tolist()))
        fallbacks = self.decode_counts.gpu_fallback
        decoded = self._decode_on_device(encoded)
        if fallbacks == 0 < self.decode_counts.gpu_fallback:
            self._report_gpu_fallback(self.decode_counts.gpu_fallback)
        keep = torch.tensor([d is not None for d in decoded], dtype=torch.bool)
        for u in uq[~keep].tolist():
            _report(f"skipped unreadable sample uq {u} of {self.dir}: it does not decode")
            self._unreadable.add(u)
        hw = self.load_hw[self.row_of_uq[uq.numpy()]]
        cap = self.options.max_aspect
        images = [cap_aspect(resize_uint8(d, hw[i]), cap) for i, d in enumerate(decoded) if d is not None]
        if not images:
            return torch.empty(0, 3, 1, 1, dtype=torch.uint8, device=self.device), None, keep
        canvas, sizes = pad_into(images)
        uniform = bool((sizes == sizes[:1]).all())
        return canvas, None if uniform else sizes, keep  # the sizes stay on the host (`Batch.sizes`)

    def _decode_on_device(self, encoded: list[Tensor]) -> list[Tensor | None]:
        """`decode_gpu` of the JPEGs and PNGs; WebPs (which nvJPEG does not read) decoded on the CPU and moved."""
        webp = [_is_webp(e) for e in encoded]
        rest = iter(
            decode_gpu([e for e, w in zip(encoded, webp, strict=True) if not w], self.device, self.decode_counts)
        )
        out: list[Tensor | None] = []
        for e, w in zip(encoded, webp, strict=True):
            if not w:
                out.append(next(rest))
                continue
            try:
                out.append(decode_image(e).to(self.device))
                self.decode_counts.cpu += 1
            except Exception:  # an undecodable WebP: the caller reports it unreadable
                out.append(None)
        return out

    def cpu_decode_reason(self, window: DecodeCounts) -> str | None:
        """Why the CPU decoded images of `window` (counts of an epoch) where a GPU decode was asked for, one line; None
        under `decode="cpu"`."""
        if self.gpu_decode and window.gpu_fallback:
            return f"nvJPEG failed on {window.gpu_fallback} images ({window.gpu_error}); the CPU decoded them"
        if self.gpu_decode:
            return "PNG or WebP images: nvJPEG decodes JPEGs only"
        if self.options.decode == "auto":
            return f"data.decode=auto on a {self.device.type} device: the CPU decodes (nvJPEG needs CUDA)"
        return None

    def _report_gpu_fallback(self, n: int) -> None:
        _report(
            f"nvJPEG failed on a batch of {n} images of {self.dir} ({self.decode_counts.gpu_error}); they were decoded "
            "on the CPU instead, and so will be every batch nvJPEG fails on (counted in decode_counts.gpu_fallback, "
            "not reported again). If nvJPEG does not work on this machine, set data.decode: cpu (the DataLoader "
            "workers decode, no GPU attempt per batch)."
        )

    def _share_rows(self) -> np.ndarray:
        """This rank's contiguous share of the index rows (storage order)."""
        n = len(self.index)
        return np.arange(n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size)

    # ---- GCDSource ----------------------------------------------------------------------------------------------

    def feature_batches(self, batch_size: int) -> Iterator[Batch]:
        """Every readable sample of the split exactly once across ranks (this rank's share), no augmentation."""
        rows = self._share_rows()
        if self.in_memory:
            self.load()
            uq = torch.from_numpy(self.uq[rows])
            uq = uq[~torch.from_numpy(np.isin(uq.numpy(), list(self._unreadable)))]
            yield from self._cached(uq[s : s + batch_size] for s in range(0, len(uq), batch_size))
            return
        yield from self._read([rows[s : s + batch_size] for s in range(0, len(rows), batch_size)])

    def epoch_order(self, epoch: int, seed: int) -> Tensor:
        """The epoch's global draw, the same on every rank: uq of N samples, N = the samples not excluded, drawn
        with the reference's weights (or a permutation, `sampling="shuffle"`) by a generator seeded by (seed, epoch)."""
        present = torch.from_numpy((self.row_of_uq >= 0) & ~self._excluded)
        n = int(present.sum())
        gen = torch.Generator().manual_seed((self.options.seed * 1_000_003 + seed) * 100_003 + epoch)
        if self.options.sampling == "weighted":
            return sample_epoch(torch.from_numpy(self.labelled), n, self.options.labelled_share, gen, present)
        return torch.nonzero(present).squeeze(1)[torch.randperm(n, generator=gen)]

    def train_batches(self, batch_size: int, epoch: int, seed: int, skip: int = 0) -> Iterator[Batch]:
        """One epoch: `N // (batch_size * world_size)` full batches on every rank; global batch b is rows
        b·B·W .. (b+1)·B·W of `epoch_order`, and this rank takes its rank-th slice of B (from batch `skip` on)."""
        if self.split != "train":
            raise ValueError("train_batches needs split='train'")
        order = self.epoch_order(epoch, seed)
        step = batch_size * self.world_size
        n_batches = len(order) // step
        if n_batches == 0:
            raise ValueError(
                f"{len(order)} readable samples are fewer than one batch of {batch_size} x {self.world_size} ranks"
            )
        mine = [order[b * step + self.rank * batch_size :][:batch_size] for b in range(skip, n_batches)]
        if self.in_memory:
            self.load()
            yield from self._cached(iter(mine))
            return
        yield from self._read([self.row_of_uq[uq.numpy()] for uq in mine])

    def unreadable(self) -> list[int]:
        return sorted(self._unreadable)

    def exclude(self, uq: list[int]) -> None:
        self._excluded[np.asarray(uq, np.int64)] = True

    def describe(self, uq: int) -> dict:
        """Where sample `uq` is stored (for the run folder's list of unreadable samples)."""
        row = int(self.row_of_uq[uq])
        if row < 0:
            return {"uq": uq, "shard": None, "problem": "in no readable shard (see the warnings)"}
        return {
            "uq": uq,
            "shard": self.records[int(self.index.shard[row])]["name"],
            "offset": int(self.index.offset[row]),
        }

    def test_batches(self, batch_size: int) -> Iterator[Batch]:
        """The test split, every sample once across ranks (this rank's share), in a fixed order."""
        if self.split == "test":
            yield from self.feature_batches(batch_size)
            return
        if self._test is None:
            # the test split: every sample once, in a fixed order, decoded where the train split is, at its size
            served = dataclasses.replace(
                self.options,
                split="test",
                labelled_share=None,
                sampling=ReadOptions.sampling,
                cache=ReadOptions.cache,
                decode="gpu" if self.gpu_decode else "cpu",
                verify=False,
                resize=self.size,
            )
            self._test = ShardSource(self.dir, served, device=self.device, rank=self.rank, world_size=self.world_size)
        yield from self._test.test_batches(batch_size)

    # ---- decoded cache ------------------------------------------------------------------------------------------

    def load(self) -> None:
        """Decode the split once into the cache (done on first use; call it to pay the cost up front). Each rank
        decodes its share; with several ranks the shares are then broadcast, so every rank holds the whole split."""
        if self._cache is not None:
            return
        assert self.cache_device is not None
        cache = DecodedCache(self.served_hw, self.cache_device)
        rows = self._share_rows()
        decoded = self._read([rows[s : s + 256] for s in range(0, len(rows), 256)], self.cache_device)
        for uq, got, expected in cache.fill(decoded, self.row_of_uq):
            _report(f"sample uq {uq} decodes to {got[0]}x{got[1]}, its header says {expected}")
            self._unreadable.add(uq)
        if self.world_size > 1:
            cache.share_across_ranks(self.world_size)
            gathered = dist.all_gather_cat(torch.as_tensor(self.unreadable(), dtype=torch.long))[0]
            self._unreadable = set(gathered.tolist())
        self._cache = cache

    def cache_bytes(self) -> int:
        """Bytes of decoded images the cache holds (0 before `load` and without a cache)."""
        return 0 if self._cache is None else self._cache.flat.numel()

    def _cached(self, uq_batches: Iterator[Tensor]) -> Iterator[Batch]:
        assert self._cache is not None
        return self._cache.serve(uq_batches, self.row_of_uq, self.index.cls, self.labelled, self.device)
