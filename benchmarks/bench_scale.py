"""Scale rehearsal on the CPU: ~100k synthetic samples through the streaming data path, decode+augment per core,
and one 200k x 768, K = 1,000 SS-k-means round.

    python -m benchmarks.bench_scale --out benchmarks/results/scale_cpu.json          # full size
    python -m benchmarks.bench_scale --n 2000 --decode-n 64 --kmeans-n 4000 --kmeans-k 40 --kmeans-dim 32  # tiny

1. Shards (cached under `--shards-dir`, reused when complete; `make_shards` verifies every shard's sha256 and the
   counts are checked again): `--n` synthetic images of `--classes` classes, stored shorter side `--size` (64) as
   JPEG quality 95, written by `make_shards` itself (the images are generated in its encoding workers, see
   `SyntheticImage`). Class c = a flat colour from a palette + stripes of a class-specific orientation and frequency +
   noise; the GCD split is make-shards' own: classes 0..C/2-1 known, half of their images labelled.
2. Streaming (`ShardSource`, `memory_threshold_mb=0`): `--world` rank processes (spawned as torchrun would, or forked:
   `--rank-start`), each with `--workers` DataLoader workers; `--epochs` epochs, each = the feature pass
   (`feature_batches`) then the training batches (`train_batches`) on every rank; the ranks meet at a barrier before
   every epoch (as DDP's collectives would make them). Checks: every sample exactly once per feature pass over the
   ranks; every epoch's labelled share of the training draws within 1% (absolute) of the reference's (U+L)/(2U+L);
   the same number of full training batches on every rank, n_train // (batch * world); each draw's labelled flag and
   target equal the feature pass's for that uq; each image's mean colour names its target's palette colour (image
   and metadata stay together).
   Memory: the resident memory of the whole process tree (this process, the ranks, their DataLoader workers) is
   sampled every `--rss-interval` s: the sum of RSS (a page shared by several processes, e.g. torch's libraries or a
   batch in shared memory, counts once per process: an upper bound) and of anonymous RSS, and every
   `--pss-interval` s the sum of PSS (shared pages split among their processes: the real footprint); maximum
   overall and per epoch (flat = epoch 2's RSS maximum within 10% of epoch 1's).
3. Decode + augment per core: `--decode-n` (2,000) "natural-ish" images (1/f noise, ellipses, sensor noise; about
   50 KB each) stored shorter side 256 (long side 256-384) as make-shards writes them; in this process with
   `torch.set_num_threads(1)`: batches of `--decode-batch` decoded as the DataLoader workers do (stream's
   `decode_cpu` + `cap_aspect` + `pad_into`: the images keep their stored size, padded into one canvas), then two 224
   views each with `DeviceAugment.train_views` on the CPU. images/s per core = images / CPU seconds of the
   process (robust to other load on a shared machine; the wall-clock rate is reported too); best of
   `--decode-repeats` passes.
4. SS-k-means: `--kmeans-n` x `--kmeans-dim` synthetic clustered features (bench_kmeans.make_features: first half of
   the classes known, half of their points labelled), K = `--kmeans-k`, balanced reference mode (the training
   default), `--kmeans-n-init` x `--kmeans-max-iter`. The config default is 10 x 10, but on a shared 2-core CPU one
   restart took 44 s (load average 2) to 184 s (load 4) and each further one ~140 s (load 4: n_init 2 took 322 s),
   so 10 would take ~7-25 minutes: the default here is n_init = 1 (the JSON names it).

JSON on stdout and in `--out`: commit / dirty / device as the other benchmarks, a `summary` (exactly_once,
labelled_share_error = the largest per-epoch |share - target|, max_rss_mb, decode_augment_images_per_s_per_core,
kmeans_200k_k1000_seconds), then the details. `--draws FILE.npz` saves every rank's feature-pass uq and training
draws (uq, labelled, target) per epoch. Exit status 1 when a data check fails.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from pathlib import Path
from queue import Empty

import numpy as np
import torch

from benchmarks import smoke
from benchmarks.provenance import device_name, emit_json, stamp
from infosieve_fast.data import shards as shards_mod
from infosieve_fast.data.layouts import RawDataset
from infosieve_fast.data.sampler import reference_labelled_share

GENERATOR_VERSION = 1  # bump when the synthetic images change: the cache folders are named by it
SHARE_TOLERANCE = 0.01
FLAT_TOLERANCE = 0.10  # epoch 2's peak may exceed epoch 1's by this fraction and still count as flat
DATASET = "imagefolder"  # make-shards' generic layout name: no reference counts to compare against


# ---- synthetic images -------------------------------------------------------------------------------------------


def palette(n_classes: int, seed: int = 0) -> np.ndarray:
    """[n_classes, 3] distinct colours on a grid over [40, 200] (spacing >= 17 per channel for <= 1,000 classes)."""
    levels = max(2, math.ceil(n_classes ** (1 / 3)))
    grid = np.linspace(40, 200, levels)
    cube = np.stack(np.meshgrid(grid, grid, grid, indexing="ij"), -1).reshape(-1, 3)
    return cube[np.random.RandomState(seed).permutation(len(cube))[:n_classes]].astype(np.float32)


def class_image(index: int, label: int, colours: np.ndarray, size: int, seed: int) -> np.ndarray:
    """size x size x 3 uint8: the class colour + class stripes (orientation, frequency) + per-image phase, brightness
    and pixel noise. Its mean colour stays within a few levels of the class colour."""
    rng = np.random.default_rng([seed, 0, index])
    theta = label * 2.399963  # golden angle: neighbouring classes far apart in orientation
    freq = 2 + label % 5
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    stripes = 30 * np.sin(2 * np.pi * freq * (xx * np.cos(theta) + yy * np.sin(theta)) + rng.uniform(0, 2 * np.pi))
    img = colours[label] + rng.uniform(-6, 6) + stripes[..., None] + rng.normal(0, 8, (size, size, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def natural_image(index: int, size: int, seed: int) -> np.ndarray:
    """A "natural-ish" image, shorter side `size`, long side size..1.5 size: 1/f-spectrum texture (luminance plus
    some per-channel colour), a few flat-coloured ellipses with sharp edges, sensor noise. About 50 KB as a
    quality-95 JPEG at 256, close to ImageNet images resized to 256."""
    rng = np.random.default_rng([seed, 1, index])
    h, w = size, int(rng.integers(size, size * 3 // 2 + 1))
    f = np.sqrt(np.fft.fftfreq(h)[:, None] ** 2 + np.fft.rfftfreq(w)[None, :] ** 2)
    f[0, 0] = 1.0
    amp = 1.0 / f
    amp[0, 0] = 0.0
    chans = []
    for _ in range(3):
        spec = amp * np.exp(2j * np.pi * rng.random(amp.shape)) * rng.standard_normal(amp.shape)
        c = np.fft.irfft2(spec, s=(h, w))
        chans.append(c / c.std())
    base, mix = rng.uniform(60, 190, 3), rng.uniform(0.6, 1.0, 3)
    img = np.stack([base[c] + 45 * (mix[c] * chans[0] + (1 - mix[c]) * chans[c]) for c in range(3)], -1)
    yy, xx = np.mgrid[0:h, 0:w]
    for _ in range(int(rng.integers(2, 6))):
        cy, cx, ry, rx = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(15, h / 2), rng.uniform(15, w / 2)
        mask = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1
        img[mask] = img[mask] * 0.4 + rng.uniform(0, 255, 3) * 0.6
    img += rng.normal(0, 3, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


class SyntheticImage:
    """One synthetic image as a make-shards source: a file-like object (PIL reads it as a binary PPM) whose pixels are
    generated on first read. Only (kind, index, label, ...) is pickled, so make-shards' encoding workers generate the
    images in parallel and the full set never sits in memory."""

    def __init__(self, kind: str, index: int, label: int, size: int, seed: int, n_classes: int):
        self.kind, self.index, self.label = kind, index, label
        self.size, self.seed, self.n_classes = size, seed, n_classes
        self._buf: io.BytesIO | None = None

    def pixels(self) -> np.ndarray:
        if self.kind == "class":
            return class_image(self.index, self.label, palette(self.n_classes, self.seed), self.size, self.seed)
        return natural_image(self.index, self.size, self.seed)

    def _file(self) -> io.BytesIO:
        if self._buf is None:
            a = self.pixels()
            self._buf = io.BytesIO(b"P6 %d %d 255\n" % (a.shape[1], a.shape[0]) + a.tobytes())
        return self._buf

    def read(self, n: int = -1) -> bytes:
        return self._file().read(n)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._file().seek(pos, whence)

    def tell(self) -> int:
        return self._file().tell()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_buf"} | {"_buf": None}


def _signature(kind: str, n: int, n_classes: int, size: int, seed: int) -> str:
    return f"bench_scale synthetic v{GENERATOR_VERSION}: kind={kind} n={n} classes={n_classes} size={size} seed={seed}"


def write_synthetic_shards(
    out: Path,
    *,
    kind: str,
    n: int,
    n_classes: int,
    size: int,
    seed: int,
    shard_size_mb: float,
    workers: int,
    image: type = SyntheticImage,
) -> dict:
    """Write (or verify and reuse) `n` synthetic images (`image` objects, generated in make-shards' encoding workers)
    as make-shards output in `out`. make_shards takes the synthetic `RawDataset` in place of a folder; everything else
    (split, write order, tar format, manifest, resume, sha256 verification of a complete folder) is its own."""
    sig = _signature(kind, n, n_classes, size, seed)
    manifest_path = out / shards_mod.MANIFEST
    reused = manifest_path.is_file()
    if reused and sig not in json.loads(manifest_path.read_text()).get("notes", []):
        raise RuntimeError(f"{out} holds other shards than '{sig}': delete it or choose another --shards-dir")
    labels = np.arange(n, dtype=np.int64) % n_classes
    raw = RawDataset(
        DATASET,
        out,
        [f"synthetic{c:04d}" for c in range(n_classes)],
        list(range(n_classes // 2)),
        list(range(n_classes // 2, n_classes)),
        [image(kind, i, int(labels[i]), size, seed, n_classes) for i in range(n)],
        labels,
        [f"synthetic[{i}]" for i in range(n)],
        notes=[sig],
    )
    t0 = time.perf_counter()
    # workers >= 2: the encoding runs in a process pool, so no generated pixels stay in this process
    manifest = shards_mod.make_shards(
        DATASET, raw, out, shard_size_mb=shard_size_mb, resize=size, workers=max(2, workers), progress=False
    )
    seconds = time.perf_counter() - t0
    c = manifest["counts"]
    want_labelled = int(0.5 * int(np.sum(labels < n_classes // 2)))
    problems = [
        f"{k} = {c.get(k)}, expected {v}"
        for k, v in {"train": n, "written_train": n, "skipped_train": 0, "labelled": want_labelled}.items()
        if c.get(k) != v
    ]
    if problems or manifest["n_classes"] != n_classes or manifest["n_old"] != n_classes // 2:
        raise RuntimeError(f"{out}: the shards do not hold what was asked: {problems or manifest['classes']}")
    recs = manifest["splits"]["train"]["shards"]
    return {
        "dir": str(out),
        "reused": reused,
        "seconds": round(seconds, 1),
        "n_train": n,
        "n_labelled": c["labelled"],
        "n_old": manifest["n_old"],
        "n_classes": n_classes,
        "stored_side": size,
        "n_shards": len(recs),
        "mb": round(sum(r["bytes"] for r in recs) / 2**20, 1),
        "mean_kb_per_image": round(sum(r["bytes"] for r in recs) / n / 1024, 1),
        "image": manifest["image"],
    }


# ---- resident memory of the process tree ------------------------------------------------------------------------


def _tree_pids(root: int) -> list[int]:
    """`root` and all its descendants (psutil when installed, else /proc/PID/task/TID/children)."""
    try:
        import psutil

        p = psutil.Process(root)
        return [root, *(c.pid for c in p.children(recursive=True))]
    except ImportError:
        pass
    except Exception:
        return []
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(x) for x in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


def _memory_kb(pid: int, pss: bool = True) -> tuple[float, float, float] | None:
    """(rss, anonymous rss, pss) in kB from /proc (psutil's rss where /proc is missing); pss is NaN when not asked
    for or unknown (reading smaps_rollup costs ~10 ms of kernel time per torch process). None if the process is
    gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        rss = float(fields.get("VmRSS", "0 kB").split()[0])
        anon = float(fields.get("RssAnon", "0 kB").split()[0])
        proportional = math.nan
        if pss:
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss:"):
                            proportional = float(line.split()[1])
                            break
            except OSError:
                pass
        return rss, anon, proportional
    except (OSError, ValueError):
        try:
            import psutil

            rss = psutil.Process(pid).memory_info().rss / 1024
            return rss, math.nan, math.nan
        except Exception:
            return None


class TreeMemory:
    """Samples the memory of this process's tree in a background thread: (monotonic time, rss, anon, pss, processes)
    per sample, MiB, every `interval` s; pss only every `pss_interval` s (NaN in between: it is costly to read)."""

    def __init__(self, interval: float, pss_interval: float = 2.0):
        self.interval, self.pss_interval, self.samples = interval, pss_interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scale-rss", daemon=True)

    def _run(self) -> None:
        root, last_pss = os.getpid(), -math.inf
        while not self._stop.is_set():
            now = time.monotonic()
            with_pss = now - last_pss >= self.pss_interval
            last_pss = now if with_pss else last_pss
            tot, procs = np.zeros(3), 0
            for pid in _tree_pids(root):
                m = _memory_kb(pid, with_pss)
                if m is not None:
                    tot += m
                    procs += 1
            self.samples.append((now, *(tot / 1024).tolist(), procs))
            self._stop.wait(self.interval)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peak(self, t0: float = -math.inf, t1: float = math.inf) -> dict:
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        arr = np.asarray(s).reshape(-1, 5)

        def top(col: int) -> float | None:
            v = arr[:, col][~np.isnan(arr[:, col])]
            return round(float(v.max()), 1) if len(v) else None

        return {
            "rss_mb": top(1),
            "pss_mb": top(3),
            "anon_mb": top(2),
            "processes": int(arr[:, 4].max()) if len(arr) else None,
            "samples": len(arr),
            "pss_samples": int((~np.isnan(arr[:, 3])).sum()),
        }


# ---- the streaming rehearsal ------------------------------------------------------------------------------------


def _nearest_colour(images: torch.Tensor, sizes: torch.Tensor | None, colours: torch.Tensor) -> np.ndarray:
    """The palette class nearest to each image's mean colour (over its own size in a padded batch)."""
    if sizes is None:
        mean = images.float().mean(dim=(2, 3))  # [B, 3]
    else:
        mean = torch.stack(
            [img[:, :h, :w].float().mean(dim=(1, 2)) for img, (h, w) in zip(images, sizes.tolist(), strict=True)]
        )
    return torch.cdist(mean, colours).argmin(1).numpy().astype(np.int32)


def _collect(batches, colours: torch.Tensor) -> dict:
    uq, lab, tgt, pred, sizes = [], [], [], [], []
    for b in batches:
        uq.append(b.uq.numpy().copy())
        lab.append(b.labelled.numpy().copy())
        tgt.append(b.targets.numpy().astype(np.int32))
        pred.append(_nearest_colour(b.images, getattr(b, "sizes", None), colours))
        sizes.append(len(b.uq))
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)
    return {
        "uq": cat(uq, np.int64),
        "labelled": cat(lab, bool),
        "targets": cat(tgt, np.int32),
        "pred": cat(pred, np.int32),
        "batch_sizes": np.asarray(sizes, np.int64),
    }


def rank_main(rank: int, cfg: dict, barrier, queue) -> None:
    """One rank: its own ShardSource (rank r of world w, num_workers DataLoader workers), every epoch = feature pass +
    training batches. Sends ("epoch", rank, epoch, data) per epoch and ("done", rank, stderr) at the end; stderr (its
    own and its workers': the data path's warnings) is captured and sent back."""
    log = tempfile.TemporaryFile(mode="w+b")
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        from infosieve_fast.data.stream import ShardSource

        # a spawned process inherits "spawn" as its default start method, so its DataLoaders would spawn their
        # workers (a fresh interpreter + torch import per worker, every pass); a torchrun-started rank has the
        # platform default, which the parent passes on
        mp.set_start_method(cfg["start_method"], force=True)
        torch.set_num_threads(1)
        colours = torch.from_numpy(palette(cfg["n_classes"], cfg["seed"]))
        src = ShardSource(
            cfg["shards"],
            memory_threshold_mb=0,
            rank=rank,
            world_size=cfg["world"],
            num_workers=cfg["workers"],
            seed=cfg["seed"],
        )
        for epoch in range(cfg["epochs"]):
            barrier.wait(timeout=600)
            t0 = time.monotonic()
            feat = _collect(src.feature_batches(cfg["feature_batch"]), colours)
            t1 = time.monotonic()
            train = _collect(src.train_batches(cfg["batch"], epoch=epoch, seed=cfg["seed"]), colours)
            t2 = time.monotonic()
            info = {"n_train": src.n_train, "n_old": src.n_old, "n_classes": src.n_classes}
            queue.put(("epoch", rank, epoch, {"feature": feat, "train": train, "times": (t0, t1, t2), **info}))
    except BaseException:
        sys.stderr.flush()
        queue.put(("error", rank, traceback.format_exc()))
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        log.seek(0)
        text = log.read().decode("utf-8", "replace")
        if text:
            sys.stderr.write(text)
        queue.put(("done", rank, text))


def stream_rehearsal(
    shards: Path,
    *,
    world: int,
    workers: int,
    epochs: int,
    batch: int,
    feature_batch: int,
    seed: int,
    n_classes: int,
    start: str,
    memory: TreeMemory,
) -> tuple[dict, dict]:
    """Run the ranks (started by `start`: "spawn", fresh interpreters as torchrun starts them, or "fork", faster);
    `memory` starts sampling once they are started. Returns (per-epoch raw data {(epoch, rank): data}, {rank: stderr
    text})."""
    import infosieve_fast.data.stream  # noqa: F401  (imported once here: forked ranks start with it)

    ctx = mp.get_context(start)
    barrier, queue = ctx.Barrier(world), ctx.Queue()
    cfg = {
        "shards": str(shards),
        "world": world,
        "workers": workers,
        "epochs": epochs,
        "batch": batch,
        "feature_batch": feature_batch,
        "seed": seed,
        "n_classes": n_classes,
        "start_method": mp.get_start_method(),
    }
    procs = [
        ctx.Process(target=rank_main, args=(r, cfg, barrier, queue), name=f"bench-scale-rank{r}") for r in range(world)
    ]
    for p in procs:
        p.start()
    memory.start()  # after the start: no sampling thread when the ranks fork
    data, logs, errors, quiet = {}, {}, [], 0
    try:
        while len(logs) < world:
            try:
                msg = queue.get(timeout=1.0)
                quiet = 0
            except Empty:  # a rank without a "done" that has exited (and sent nothing for 5 s) failed
                dead = [r for r, p in enumerate(procs) if r not in logs and not p.is_alive()]
                quiet = quiet + 1 if dead else 0
                if quiet >= 5:
                    errors.append(f"rank(s) {dead} exited with {[procs[r].exitcode for r in dead]} without a report")
                    break
                continue
            if msg[0] == "epoch":
                data[(msg[2], msg[1])] = msg[3]
            elif msg[0] == "error":
                errors.append(f"rank {msg[1]}:\n{msg[2]}")
                barrier.abort()
            else:
                logs[msg[1]] = msg[2]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        raise RuntimeError("the streaming rehearsal failed:\n" + "\n".join(errors))
    return data, logs


def check_epochs(
    data: dict, *, world: int, epochs: int, batch: int, n_train: int, n_labelled: int, memory: TreeMemory
) -> dict:
    """The data checks of every epoch, from the ranks' raw data."""
    target = reference_labelled_share(n_labelled, n_train - n_labelled)
    want_batches = n_train // (batch * world)
    out = []
    for e in range(epochs):
        ranks = [data[(e, r)] for r in range(world)]
        # feature pass: exactly once over the ranks
        uq = np.concatenate([d["feature"]["uq"] for d in ranks])
        counts = np.bincount(uq[(uq >= 0) & (uq < n_train)], minlength=n_train)
        out_of_range = int(((uq < 0) | (uq >= n_train)).sum())
        feat_lab = np.zeros(n_train, bool)
        feat_tgt = np.full(n_train, -1, np.int32)
        for d in ranks:
            ok = (d["feature"]["uq"] >= 0) & (d["feature"]["uq"] < n_train)
            feat_lab[d["feature"]["uq"][ok]] = d["feature"]["labelled"][ok]
            feat_tgt[d["feature"]["uq"][ok]] = d["feature"]["targets"][ok]
        feature = {
            "samples": int(len(uq)),
            "missing": int((counts == 0).sum()),
            "duplicates": int((counts > 1).sum()),
            "out_of_range": out_of_range,
            "per_rank": [int(len(d["feature"]["uq"])) for d in ranks],
            "colour_agreement": float(
                np.mean(np.concatenate([d["feature"]["pred"] == d["feature"]["targets"] for d in ranks]))
            )
            if len(uq)
            else None,
            "seconds": round(max(d["times"][1] for d in ranks) - min(d["times"][0] for d in ranks), 2),
        }
        feature["exactly_once"] = feature["missing"] == feature["duplicates"] == out_of_range == 0
        # training draws
        lab = np.concatenate([d["train"]["labelled"] for d in ranks])
        tuq = np.concatenate([d["train"]["uq"] for d in ranks])
        ttgt = np.concatenate([d["train"]["targets"] for d in ranks])
        inside = (tuq >= 0) & (tuq < n_train)
        share = float(lab.mean()) if len(lab) else float("nan")
        n_batches = [len(d["train"]["batch_sizes"]) for d in ranks]
        train = {
            "draws": int(len(lab)),
            "labelled_draws": int(lab.sum()),
            "labelled_share": share,
            "labelled_share_error": abs(share - target),
            "batches_per_rank": n_batches,
            "expected_batches_per_rank": want_batches,
            "all_batches_full": bool(all((d["train"]["batch_sizes"] == batch).all() for d in ranks)),
            "unique_fraction": float(len(np.unique(tuq)) / max(1, len(tuq))),
            "draws_outside_0_n": int((~inside).sum()),
            "metadata_mismatches": int(
                (feat_lab[tuq[inside]] != lab[inside]).sum() + (feat_tgt[tuq[inside]] != ttgt[inside]).sum()
            ),
            "labelled_novel_draws": int((lab & (ttgt >= 0) & (ttgt >= data[(e, 0)]["n_old"])).sum()),
            "colour_agreement": float(
                np.mean(np.concatenate([d["train"]["pred"] == d["train"]["targets"] for d in ranks]))
            )
            if len(lab)
            else None,
            "seconds": round(max(d["times"][2] for d in ranks) - min(d["times"][1] for d in ranks), 2),
        }
        t0, t1 = min(d["times"][0] for d in ranks), max(d["times"][2] for d in ranks)
        out.append(
            {
                "epoch": e,
                "seconds": round(t1 - t0, 2),
                "feature": feature,
                "train": train,
                "memory": memory.peak(t0, t1),
            }
        )
    return {"labelled_share_target": target, "epochs": out}


# ---- decode + augment per core ----------------------------------------------------------------------------------


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
    from infosieve_fast.data.augment import AugmentConfig, DeviceAugment
    from infosieve_fast.data.stream import cap_aspect, decode_cpu, pad_into

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
            t0, c0, dec = time.perf_counter(), time.process_time(), 0.0
            for start in range(0, len(images), batch):
                d0 = time.process_time()
                canvas, sizes = decoded(images[start : start + batch])
                dec += time.process_time() - d0
                views_of(canvas, sizes)
            return time.perf_counter() - t0, time.process_time() - c0, dec

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


# ---- SS-k-means ---------------------------------------------------------------------------------------------------


def kmeans_round(n: int, dim: int, k: int, n_init: int, max_iter: int, seed: int) -> dict:
    """Seconds of one balanced (reference mode) SS-k-means round on synthetic clustered features: through
    `bench_kmeans.time_round` (features stored in its default dtype; also reports the peak memory) where it exists,
    else `semi_supervised_kmeans` on `bench_kmeans.make_features` (fp32)."""
    from benchmarks import bench_kmeans

    out = {"n": n, "dim": dim, "k": k, "n_init": n_init, "max_iter": max_iter, "mode": "balanced, reference"}
    if hasattr(bench_kmeans, "time_round"):
        detail = bench_kmeans.time_round(n, dim, k, "cpu", n_init=n_init, max_iter=max_iter, seed=seed)
        return out | {"via": "bench_kmeans.time_round", "seconds": round(detail["seconds"], 2), "detail": detail}
    from infosieve_fast.kmeans import semi_supervised_kmeans

    u, lab, tgt = bench_kmeans.make_features(n, dim, k, torch.device("cpu"), seed=seed)
    t0 = time.perf_counter()
    res = semi_supervised_kmeans(
        u, lab, tgt, k, n_init=n_init, max_iter=max_iter, balanced=True, balance="reference", seed=seed
    )
    seconds = time.perf_counter() - t0
    return out | {
        "via": "semi_supervised_kmeans",
        "seconds": round(seconds, 2),
        "n_iter": res.n_iter,
        "backend": res.backend,
        "labelled": int(len(lab)),
        "threads": torch.get_num_threads(),
    }


# ---- main -------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--draws", default=None, help="save the feature passes' uq and the training draws (.npz)")
    p.add_argument(
        "--shards-dir",
        default=str(Path(tempfile.gettempdir()) / "infosieve-bench-scale"),
        help="cache of the generated shards (one sub-folder per setting; reused when complete)",
    )
    p.add_argument("--n", type=int, default=100_000, help="synthetic train samples")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--size", type=int, default=64, help="stored (and decoded) side of the streamed images")
    p.add_argument("--shard-size-mb", type=float, default=8.0, help="shard size (8 MB: ~60 shards at 100k)")
    p.add_argument("--write-workers", type=int, default=os.cpu_count() or 2, help="make-shards encoding processes")
    p.add_argument("--world", type=int, default=2, help="rank processes")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument(
        "--rank-start",
        choices=("spawn", "fork"),
        default="spawn",
        help="how the rank processes start: spawn (fresh interpreters, as torchrun) or fork (faster)",
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128, help="training batch per rank")
    p.add_argument("--feature-batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-interval", type=float, default=0.25, help="seconds between memory samples")
    p.add_argument("--pss-interval", type=float, default=2.0, help="seconds between PSS samples (costly to read)")
    p.add_argument("--decode-n", type=int, default=2000, help="images of the decode+augment set")
    p.add_argument("--decode-size", type=int, default=256, help="stored shorter side of the decode+augment set")
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--decode-repeats", type=int, default=3)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--kmeans-n", type=int, default=200_000)
    p.add_argument("--kmeans-dim", type=int, default=768)
    p.add_argument("--kmeans-k", type=int, default=1000)
    p.add_argument(
        "--kmeans-n-init",
        type=int,
        default=1,
        help="restarts (1: the config's 10 would take 7-25 min on a shared 2-core CPU; see the module docstring)",
    )
    p.add_argument("--kmeans-max-iter", type=int, default=10)
    p.add_argument("--skip-kmeans", action="store_true")
    args = smoke.shrink(
        p.parse_args(argv), n=1200, classes=10, shard_size_mb=0.5, batch_size=32, feature_batch_size=64, epochs=2,
        decode_n=16, decode_batch=8, decode_repeats=1, kmeans_n=2000, kmeans_dim=16, kmeans_k=20, kmeans_max_iter=2,
    )
    if args.world < 1 or args.workers < 0 or args.epochs < 1 or args.n < args.batch_size * args.world:
        p.error("need --world >= 1, --workers >= 0, --epochs >= 1 and --n >= --batch-size x --world")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    report: dict = {
        **stamp(),
        "device": device_name(torch.device("cpu")),
        "command": " ".join(["python", "-m", "benchmarks.bench_scale", *(sys.argv[1:] if argv is None else argv)]),
        "torch": torch.__version__,
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_at_start": round(os.getloadavg()[0], 2),
            "platform": platform.platform(),
        },
    }
    base = Path(args.shards_dir)
    log = lambda msg: print(f"bench_scale: {msg}", file=sys.stderr, flush=True)

    # 1. shards
    folder = base / f"gcd-n{args.n}-c{args.classes}-s{args.size}-seed{args.seed}-v{GENERATOR_VERSION}"
    log(f"shards: {folder}")
    shards = write_synthetic_shards(
        folder,
        kind="class",
        n=args.n,
        n_classes=args.classes,
        size=args.size,
        seed=args.seed,
        shard_size_mb=args.shard_size_mb,
        workers=args.write_workers,
    )
    log(
        f"shards: {shards['n_shards']} shards, {shards['mb']} MB, {'reused' if shards['reused'] else 'written'} "
        f"in {shards['seconds']} s"
    )
    report["shards"] = shards

    # 2. streaming
    before = _memory_kb(os.getpid())  # a process that has imported torch: what every rank and worker starts from
    memory = TreeMemory(args.rss_interval, args.pss_interval)
    t0 = time.monotonic()
    try:
        data, logs = stream_rehearsal(
            folder,
            world=args.world,
            workers=args.workers,
            epochs=args.epochs,
            batch=args.batch_size,
            feature_batch=args.feature_batch_size,
            seed=args.seed,
            n_classes=args.classes,
            start=args.rank_start,
            memory=memory,
        )
    finally:
        memory.stop()
    t1 = time.monotonic()
    n_train, n_lab = shards["n_train"], shards["n_labelled"]
    got = {(d["n_train"], d["n_old"], d["n_classes"]) for d in data.values()}  # as every rank's source saw them
    stream = check_epochs(
        data,
        world=args.world,
        epochs=args.epochs,
        batch=args.batch_size,
        n_train=n_train,
        n_labelled=n_lab,
        memory=memory,
    )
    warnings = [line for text in logs.values() for line in text.splitlines() if "WARNING" in line]
    peak = memory.peak(t0, t1)
    ep_rss = [e["memory"]["rss_mb"] for e in stream["epochs"]]
    growth = (ep_rss[-1] - ep_rss[0]) if len(ep_rss) > 1 and None not in ep_rss else None
    stream |= {
        "world_size": args.world,
        "workers_per_rank": args.workers,
        "batch_size": args.batch_size,
        "feature_batch_size": args.feature_batch_size,
        "rank_start": args.rank_start,
        "seconds": round(t1 - t0, 1),
        "source_sizes": sorted(got),
        "data_warnings": len(warnings),
        "data_warning_lines": warnings[:20],
    }
    report["stream"] = stream
    report["memory"] = {
        "what": "whole process tree (main, ranks, DataLoader workers) during the streaming phase; rss = sum of VmRSS "
        "(a shared page counts once per process: an upper bound), pss = sum of proportional set sizes (the "
        "footprint; sampled every pss_interval_s), anon = sum of RssAnon; epoch_* = maxima within each epoch",
        "source": "psutil" if _has_psutil() else "/proc",
        "interval_s": args.rss_interval,
        "pss_interval_s": args.pss_interval,
        **peak,
        "this_process_before_mb": None
        if before is None
        else {
            k: None if math.isnan(x) else round(x / 1024, 1)
            for k, x in zip(("rss", "anon", "pss"), before, strict=True)
        },
        "epoch_max_rss_mb": ep_rss,
        "epoch_max_pss_mb": [e["memory"]["pss_mb"] for e in stream["epochs"]],
        "epoch_growth_mb": None if growth is None else round(growth, 1),
        "flat": None if growth is None else bool(ep_rss[-1] <= ep_rss[0] * (1 + FLAT_TOLERANCE)),
    }
    if args.draws:
        arrays = {}
        for (e, r), d in data.items():
            arrays[f"feature_uq_e{e}_r{r}"] = d["feature"]["uq"]
            for key in ("uq", "labelled", "targets", "batch_sizes"):
                arrays[f"train_{key}_e{e}_r{r}"] = d["train"][key]
        np.savez_compressed(args.draws, **arrays)
    del data
    epochs = stream["epochs"]
    checks = {
        "exactly_once": all(e["feature"]["exactly_once"] for e in epochs),
        "labelled_share_within_1pct": all(e["train"]["labelled_share_error"] <= SHARE_TOLERANCE for e in epochs),
        "equal_train_batches": all(len(set(e["train"]["batches_per_rank"])) == 1 for e in epochs),
        "expected_train_batches": all(
            e["train"]["batches_per_rank"] == [e["train"]["expected_batches_per_rank"]] * args.world for e in epochs
        ),
        "full_train_batches": all(e["train"]["all_batches_full"] for e in epochs),
        "metadata_consistent": all(
            e["train"]["metadata_mismatches"] == e["train"]["draws_outside_0_n"] == 0
            and e["train"]["labelled_novel_draws"] == 0
            for e in epochs
        ),
        "images_match_targets": all(
            min(e["feature"]["colour_agreement"] or 0, e["train"]["colour_agreement"] or 0) >= 0.99 for e in epochs
        ),
        "source_sizes": got == {(n_train, shards["n_old"], args.classes)},
        "no_data_warnings": not warnings,
    }
    checks["all_ok"] = all(checks.values())
    report["checks"] = checks
    log(f"streaming: {stream['seconds']} s, checks {'ok' if checks['all_ok'] else 'FAILED'}: {checks}")

    # 3. decode + augment
    decode = None
    if not args.skip_decode:
        dfolder = base / f"decode-n{args.decode_n}-s{args.decode_size}-seed{args.seed}-v{GENERATOR_VERSION}"
        log(f"decode set: {dfolder}")
        dshards = write_synthetic_shards(
            dfolder,
            kind="natural",
            n=args.decode_n,
            n_classes=2,
            size=args.decode_size,
            seed=args.seed,
            shard_size_mb=256,
            workers=args.write_workers,
        )
        decode = decode_augment(
            read_images(dfolder, args.decode_n), crop=args.crop, batch=args.decode_batch, repeats=args.decode_repeats
        )
        decode["shards"] = dshards
        log(f"decode+augment: {decode['images_per_cpu_s']} images per CPU second")
    report["decode_augment"] = decode

    # 4. SS-k-means
    km = None
    if not args.skip_kmeans:
        log(f"k-means: {args.kmeans_n} x {args.kmeans_dim}, K = {args.kmeans_k}, n_init {args.kmeans_n_init}")
        km = kmeans_round(
            args.kmeans_n, args.kmeans_dim, args.kmeans_k, args.kmeans_n_init, args.kmeans_max_iter, args.seed
        )
        log(f"k-means: {km['seconds']} s")
    report["kmeans"] = km

    report["summary"] = {
        "exactly_once": checks["exactly_once"],
        "labelled_share_error": max(e["train"]["labelled_share_error"] for e in epochs),
        "max_rss_mb": peak["rss_mb"],
        "decode_augment_images_per_s_per_core": None if decode is None else decode["images_per_cpu_s"],
        "kmeans_200k_k1000_seconds": None if km is None else km["seconds"],
    }
    report["machine"]["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    report["total_seconds"] = round(time.perf_counter() - t_start, 1)
    report = {k: report[k] for k in ("commit", "dirty", "device", "summary")} | report  # summary first
    emit_json(report, args.out)
    return report


def _has_psutil() -> bool:
    try:
        import psutil  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(0 if main()["checks"]["all_ok"] else 1)
