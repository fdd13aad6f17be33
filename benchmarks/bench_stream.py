"""Streaming rehearsal on the CPU: ~100k synthetic samples through the streaming data path over rank processes, with
exactly-once, labelled-share and memory checks.

    python -m benchmarks.bench_stream --out benchmarks/results/stream_cpu.json      # full size
    python -m benchmarks.bench_stream --n 2000 --rank-start fork                    # tiny

1. Shards (`synthetic_shards.write_synthetic_shards`, cached under `--shards-dir`, reused when complete; make_shards
   verifies every shard's sha256 and the counts are checked again): `--n` synthetic "class" images of `--classes`
   classes, stored shorter side `--size` (64) as JPEG quality 95. Class c = a flat colour from a palette + stripes of
   a class-specific orientation and frequency + noise; the GCD split is make-shards' own: classes 0..C/2-1 known,
   half of their images labelled.
2. Streaming (`ShardSource`, `memory_threshold_mb=0`): `--world` rank processes (spawned as torchrun would, or forked:
   `--rank-start`), each with `--workers` DataLoader workers; `--epochs` epochs, each = the feature pass
   (`feature_batches`) then the training batches (`train_batches`) on every rank; the ranks meet at a barrier before
   every epoch (as DDP's collectives would make them). Checks: every sample exactly once per feature pass over the
   ranks; every epoch's labelled share of the training draws within 1% (absolute) of the reference's (U+L)/(2U+L);
   the same number of full training batches on every rank, n_train // (batch * world); each draw's labelled flag and
   target equal the feature pass's for that uq; each image's mean colour names its target's palette colour (image
   and metadata stay together).
   Memory (`process_memory.TreeMemory`): the resident memory of the whole process tree (this process, the ranks,
   their DataLoader workers) is sampled every `--rss-interval` s: the sum of RSS (an upper bound) and of anonymous
   RSS, and every `--pss-interval` s the sum of PSS (the real footprint); maximum overall and per epoch (flat =
   the last epoch's RSS maximum within 10% of the first's).

JSON on stdout and in `--out`: commit / dirty / device as the other benchmarks, a `summary` (exactly_once,
labelled_share_error = the largest per-epoch |share - target|, max_rss_mb), then shards, stream, memory and checks.
`--draws FILE.npz` saves every rank's feature-pass uq and training draws (uq, labelled, target) per epoch. Exit
status 1 when a data check fails.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from queue import Empty

import numpy as np
import torch

from benchmarks import smoke
from benchmarks.harness import Stopwatch, cpu_report, finish_cpu_report
from benchmarks.process_memory import TreeMemory, has_psutil, memory_mb
from benchmarks.synthetic_shards import add_cache_arguments, cached_synthetic_shards, palette
from infosieve_fast.data.reading.sampler import reference_labelled_share

SHARE_TOLERANCE = 0.01
FLAT_TOLERANCE = 0.10  # the last epoch's peak may exceed the first's by this fraction and still count as flat


def log(msg: str) -> None:
    print(f"bench_stream: {msg}", file=sys.stderr, flush=True)


# ---- the rank processes -----------------------------------------------------------------------------------------


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


def _run_epochs(rank: int, cfg: dict, barrier, queue) -> None:
    """Rank `rank`'s own ShardSource (rank r of world w, num_workers DataLoader workers); every epoch = feature pass +
    training batches, sent as ("epoch", rank, epoch, data)."""
    from infosieve_fast.data.reading.stream import ReadOptions, ShardSource

    # a spawned process inherits "spawn" as its default start method, so its DataLoaders would spawn their workers
    # (a fresh interpreter + torch import per worker, every pass); a torchrun-started rank has the platform default,
    # which the parent passes on
    mp.set_start_method(cfg["start_method"], force=True)
    torch.set_num_threads(1)
    colours = torch.from_numpy(palette(cfg["n_classes"], cfg["seed"]))
    src = ShardSource(
        cfg["shards"],
        ReadOptions(memory_threshold_mb=0, num_workers=cfg["workers"], seed=cfg["seed"]),
        rank=rank,
        world_size=cfg["world"],
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


def rank_main(rank: int, cfg: dict, barrier, queue) -> None:
    """One rank: its epochs (`_run_epochs`), then ("done", rank, stderr) at the end, or ("error", rank, traceback);
    stderr (its own and its workers': the data path's warnings) is captured and sent back."""
    log_file = tempfile.TemporaryFile(mode="w+b")
    saved = os.dup(2)
    os.dup2(log_file.fileno(), 2)
    try:
        _run_epochs(rank, cfg, barrier, queue)
    except BaseException:
        sys.stderr.flush()
        queue.put(("error", rank, traceback.format_exc()))
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        log_file.seek(0)
        text = log_file.read().decode("utf-8", "replace")
        if text:
            sys.stderr.write(text)
        queue.put(("done", rank, text))


def _receive(procs: list, barrier, queue) -> tuple[dict, dict, list[str]]:
    """The ranks' messages until every rank is done: ({(epoch, rank): data}, {rank: stderr}, errors)."""
    data, logs, errors, quiet = {}, {}, [], 0
    while len(logs) < len(procs):
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
    return data, logs, errors


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
    import infosieve_fast.data.reading.stream  # noqa: F401  (imported once here: forked ranks start with it)

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
        ctx.Process(target=rank_main, args=(r, cfg, barrier, queue), name=f"bench-stream-rank{r}") for r in range(world)
    ]
    for p in procs:
        p.start()
    memory.start()  # after the start: no sampling thread when the ranks fork
    try:
        data, logs, errors = _receive(procs, barrier, queue)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        raise RuntimeError("the streaming rehearsal failed:\n" + "\n".join(errors))
    return data, logs


# ---- the data checks --------------------------------------------------------------------------------------------


def _agreement(ranks: list[dict], part: str) -> float | None:
    """The fraction of `part`'s images whose mean colour names their target (None without images)."""
    hits = np.concatenate([d[part]["pred"] == d[part]["targets"] for d in ranks])
    return float(np.mean(hits)) if len(hits) else None


def _feature_pass(ranks: list[dict], n_train: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """One epoch's feature pass over the ranks: its record (exactly once?), and the labelled flag and target it gave
    each uq."""
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
        "colour_agreement": _agreement(ranks, "feature"),
        "seconds": round(max(d["times"][1] for d in ranks) - min(d["times"][0] for d in ranks), 2),
    }
    feature["exactly_once"] = feature["missing"] == feature["duplicates"] == out_of_range == 0
    return feature, feat_lab, feat_tgt


def _train_draws(
    ranks: list[dict], feat_lab: np.ndarray, feat_tgt: np.ndarray, *, batch: int, world: int, target: float
) -> dict:
    """One epoch's training draws over the ranks, against the feature pass's labelled flags and targets."""
    n_train = len(feat_lab)
    lab = np.concatenate([d["train"]["labelled"] for d in ranks])
    tuq = np.concatenate([d["train"]["uq"] for d in ranks])
    ttgt = np.concatenate([d["train"]["targets"] for d in ranks])
    inside = (tuq >= 0) & (tuq < n_train)
    share = float(lab.mean()) if len(lab) else float("nan")
    return {
        "draws": int(len(lab)),
        "labelled_draws": int(lab.sum()),
        "labelled_share": share,
        "labelled_share_error": abs(share - target),
        "batches_per_rank": [len(d["train"]["batch_sizes"]) for d in ranks],
        "expected_batches_per_rank": n_train // (batch * world),
        "all_batches_full": bool(all((d["train"]["batch_sizes"] == batch).all() for d in ranks)),
        "unique_fraction": float(len(np.unique(tuq)) / max(1, len(tuq))),
        "draws_outside_0_n": int((~inside).sum()),
        "metadata_mismatches": int(
            (feat_lab[tuq[inside]] != lab[inside]).sum() + (feat_tgt[tuq[inside]] != ttgt[inside]).sum()
        ),
        "labelled_novel_draws": int((lab & (ttgt >= 0) & (ttgt >= ranks[0]["n_old"])).sum()),
        "colour_agreement": _agreement(ranks, "train"),
        "seconds": round(max(d["times"][2] for d in ranks) - min(d["times"][1] for d in ranks), 2),
    }


def check_epochs(
    data: dict, *, world: int, epochs: int, batch: int, n_train: int, n_labelled: int, memory: TreeMemory
) -> dict:
    """The data checks of every epoch, from the ranks' raw data."""
    target = reference_labelled_share(n_labelled, n_train - n_labelled)
    out = []
    for e in range(epochs):
        ranks = [data[(e, r)] for r in range(world)]
        feature, feat_lab, feat_tgt = _feature_pass(ranks, n_train)
        train = _train_draws(ranks, feat_lab, feat_tgt, batch=batch, world=world, target=target)
        t0, t1 = min(d["times"][0] for d in ranks), max(d["times"][2] for d in ranks)
        seconds = round(t1 - t0, 2)
        out.append({"epoch": e, "seconds": seconds, "feature": feature, "train": train, "memory": memory.peak(t0, t1)})
    return {"labelled_share_target": target, "epochs": out}


def data_checks(stream: dict, shards: dict, n_classes: int) -> dict:
    """The pass/fail of every data check over all epochs; `all_ok` when every one passed."""
    epochs, world = stream["epochs"], stream["world_size"]
    checks = {
        "exactly_once": all(e["feature"]["exactly_once"] for e in epochs),
        "labelled_share_within_1pct": all(e["train"]["labelled_share_error"] <= SHARE_TOLERANCE for e in epochs),
        "equal_train_batches": all(len(set(e["train"]["batches_per_rank"])) == 1 for e in epochs),
        "expected_train_batches": all(
            e["train"]["batches_per_rank"] == [e["train"]["expected_batches_per_rank"]] * world for e in epochs
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
        # (n_train, n_old, n_classes) as every rank's source saw them
        "source_sizes": {tuple(s) for s in stream["source_sizes"]} == {(shards["n_train"], shards["n_old"], n_classes)},
        "no_data_warnings": stream["data_warnings"] == 0,
    }
    checks["all_ok"] = all(checks.values())
    return checks


# ---- the run ----------------------------------------------------------------------------------------------------


def memory_record(args: argparse.Namespace, peak: dict, before: dict | None, epochs: list[dict]) -> dict:
    """The JSON's `memory`: the tree's maxima while streaming, per epoch, and whether they stayed flat."""
    ep_rss = [e["memory"]["rss_mb"] for e in epochs]
    growth = (ep_rss[-1] - ep_rss[0]) if len(ep_rss) > 1 and None not in ep_rss else None
    return {
        "what": "whole process tree (main, ranks, DataLoader workers) during the streaming phase; rss = sum of VmRSS "
        "(a shared page counts once per process: an upper bound), pss = sum of proportional set sizes (the "
        "footprint; sampled every pss_interval_s), anon = sum of RssAnon; epoch_* = maxima within each epoch",
        "source": "psutil" if has_psutil() else "/proc",
        "interval_s": args.rss_interval,
        "pss_interval_s": args.pss_interval,
        **peak,
        "this_process_before_mb": before,
        "epoch_max_rss_mb": ep_rss,
        "epoch_max_pss_mb": [e["memory"]["pss_mb"] for e in epochs],
        "epoch_growth_mb": None if growth is None else round(growth, 1),
        "flat": None if growth is None else bool(ep_rss[-1] <= ep_rss[0] * (1 + FLAT_TOLERANCE)),
    }


def measure_stream(args: argparse.Namespace, folder: Path, shards: dict) -> tuple[dict, dict, dict]:
    """Stream the shards on the ranks with the memory sampled: (raw data by (epoch, rank), `stream`, `memory`)."""
    before = memory_mb(os.getpid())  # a process that has imported torch: what every rank and worker starts from
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
    stream = check_epochs(
        data,
        world=args.world,
        epochs=args.epochs,
        batch=args.batch_size,
        n_train=shards["n_train"],
        n_labelled=shards["n_labelled"],
        memory=memory,
    )
    warnings = [line for text in logs.values() for line in text.splitlines() if "WARNING" in line]
    stream |= {
        "world_size": args.world,
        "workers_per_rank": args.workers,
        "batch_size": args.batch_size,
        "feature_batch_size": args.feature_batch_size,
        "rank_start": args.rank_start,
        "seconds": round(t1 - t0, 1),
        "source_sizes": sorted({(d["n_train"], d["n_old"], d["n_classes"]) for d in data.values()}),
        "data_warnings": len(warnings),
        "data_warning_lines": warnings[:20],
    }
    return data, stream, memory_record(args, memory.peak(t0, t1), before, stream["epochs"])


def save_draws(path: str, data: dict) -> None:
    """Every rank's feature-pass uq and training draws per epoch, as one .npz."""
    arrays = {}
    for (e, r), d in data.items():
        arrays[f"feature_uq_e{e}_r{r}"] = d["feature"]["uq"]
        for key in ("uq", "labelled", "targets", "batch_sizes"):
            arrays[f"train_{key}_e{e}_r{r}"] = d["train"][key]
    np.savez_compressed(path, **arrays)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--draws", default=None, help="save the feature passes' uq and the training draws (.npz)")
    add_cache_arguments(p)
    p.add_argument("--n", type=int, default=100_000, help="synthetic train samples")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--size", type=int, default=64, help="stored (and decoded) side of the streamed images")
    p.add_argument("--shard-size-mb", type=float, default=8.0, help="shard size (8 MB: ~60 shards at 100k)")
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
    args = smoke.shrink(
        p.parse_args(argv), n=1200, classes=10, shard_size_mb=0.5, batch_size=32, feature_batch_size=64, epochs=2
    )
    if args.world < 1 or args.workers < 0 or args.epochs < 1 or args.n < args.batch_size * args.world:
        p.error("need --world >= 1, --workers >= 0, --epochs >= 1 and --n >= --batch-size x --world")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = Stopwatch()
    report = cpu_report("bench_stream", argv)
    name = f"gcd-n{args.n}-c{args.classes}-s{args.size}-seed{args.seed}"
    folder, shards = cached_synthetic_shards(
        args,
        name,
        kind="class",
        n=args.n,
        n_classes=args.classes,
        size=args.size,
        seed=args.seed,
        shard_size_mb=args.shard_size_mb,
    )
    data, stream, memory = measure_stream(args, folder, shards)
    if args.draws:
        save_draws(args.draws, data)
    del data
    checks = data_checks(stream, shards, args.classes)
    report |= {"shards": shards, "stream": stream, "memory": memory, "checks": checks}
    log(f"streaming: {stream['seconds']} s, checks {'ok' if checks['all_ok'] else 'FAILED'}: {checks}")
    summary = {
        "exactly_once": checks["exactly_once"],
        "labelled_share_error": max(e["train"]["labelled_share_error"] for e in stream["epochs"]),
        "max_rss_mb": memory["rss_mb"],
    }
    return finish_cpu_report(report, summary, started, args.out)


if __name__ == "__main__":
    sys.exit(0 if main()["checks"]["all_ok"] else 1)
