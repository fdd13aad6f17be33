"""Semi-supervised k-means: infosieve_fast.kmeans against the reference's loop-based transcription.

Cases (synthetic L2-normalised Gaussian-mixture features, GCD split: first half of the classes known, half of their
points labelled): (a) CUB size 6,000 x 768, K = 200; (b) ImageNet-100 size 127,000 x 768, K = 100. Same n_init x
max_iter for both sides (10 x 10 by default). The reference is timed with ``--ref-inits`` restarts per case (its
restarts are independent and cost the same each, so the 10-restart time is that time x 10 / ref_inits; the JSON
records both) and our engine is also run with the same restarts, which share the RNG stream with the reference, for an
equal-restarts inertia comparison.

    python -m benchmarks.bench_kmeans --json benchmarks/results/kmeans_cpu.json
    python -m benchmarks.bench_kmeans --device cuda --ref-inits 0,0 --json benchmarks/results/kmeans_h100.json

``--scale imagenet1k`` (1,281,167 x 768, K = 1000) / ``--scale cpu200k`` (200,000 x 768, K = 1000): one pseudo-label
round at scale, no baseline. Synthetic features of that size are generated in place on the device (fp16 by default),
then one ``semi_supervised_kmeans`` call (balanced, ``balance="reference"``, n_init x max_iter) runs per
``--distance-precision``; the JSON has its seconds and its peak memory beyond the features (CUDA:
``torch.cuda.max_memory_allocated()`` minus the features' bytes; CPU: growth of the peak RSS). Runs after the first
record whether their labels equal the first run's. Other scripts call :func:`time_round`.

    python -m benchmarks.bench_kmeans --device cuda --scale imagenet1k --distance-precision fp32,tf32,bf16 \
        --json benchmarks/results/kmeans_imagenet1k.json

Works without FAISS (the torch backend is used, ``"backend"`` in the JSON says which ran).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path

import torch

from benchmarks import smoke
from benchmarks.harness import call_times, sync, timed
from benchmarks.published.kmeans import ReferenceSSKMeans, sqdist
from benchmarks.tools.provenance import device_name, emit_json, git_state, versions
from infosieve_fast.kmeans import faiss_available, semi_supervised_kmeans

CASES = {"a": (6000, 768, 200), "b": (127000, 768, 100)}
SCALES = {"imagenet1k": (1_281_167, 768, 1000), "cpu200k": (200_000, 768, 1000)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def make_features(n, d, k, device, seed=0, noise=0.03):
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(k, d, generator=g), dim=1)
    y = torch.randint(0, k, (n,), generator=g)
    x = torch.nn.functional.normalize(centres[y] + noise * torch.randn(n, d, generator=g), dim=1)
    lab = (y < k // 2) & (torch.rand(n, generator=g) < 0.5)
    return x[~lab].to(device), x[lab].to(device), y[lab].to(device)


def scale_features(n, d, k, device, dtype=torch.float16, seed=0, noise=0.03, chunk=65536):
    """``make_features``' recipe (L2-normalised mixture of ``k`` classes, GCD split) generated in place on ``device``
    in row chunks and stored in ``dtype``, so that ImageNet-1k size needs little beyond the features themselves."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(k, d, generator=g, device=device), dim=1)
    y = torch.randint(0, k, (n,), generator=g, device=device)
    lab = (y < k // 2) & (torch.rand(n, generator=g, device=device) < 0.5)
    feats = []
    for ys in (y[~lab], y[lab]):
        x = torch.empty(ys.shape[0], d, dtype=dtype, device=device)
        for s in range(0, ys.shape[0], chunk):
            yc = ys[s : s + chunk]
            noisy = centres[yc] + noise * torch.randn(yc.shape[0], d, generator=g, device=device)
            x[s : s + chunk] = torch.nn.functional.normalize(noisy, dim=1)
        feats.append(x)
    return feats[0], feats[1], y[lab]


def _proc_status_kib(key):
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def run_round(
    u,
    l,
    t,
    k,
    *,
    n_init=10,
    max_iter=10,
    balanced=True,
    balance="reference",
    distance_precision="fp32",
    backend="auto",
    seed=0,
):
    """One timed ``semi_supervised_kmeans`` call -> (record, labels). Peak memory beyond the features: on CUDA
    ``torch.cuda.max_memory_allocated()`` minus the features' bytes; on the CPU (Linux) the growth of the peak RSS
    over the RSS before the call (the peak is reset first through /proc/self/clear_refs)."""
    dev = u.device
    feature_bytes = u.numel() * u.element_size() + l.numel() * l.element_size()
    if dev.type == "cuda":
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        rss_before = _proc_status_kib("VmRSS")
    with timed(dev) as clock:
        res = semi_supervised_kmeans(
            u,
            l,
            t,
            k,
            n_init=n_init,
            max_iter=max_iter,
            balanced=balanced,
            balance=balance,
            distance_precision=distance_precision,
            backend=backend,
            seed=seed,
        )
    seconds = clock.seconds
    if dev.type == "cuda":
        beyond = torch.cuda.max_memory_allocated(dev) - feature_bytes
        how = "torch.cuda.max_memory_allocated() - feature bytes"
    else:
        beyond = (_proc_status_kib("VmHWM") - rss_before) * 1024
        how = "peak RSS (VmHWM, reset before the call) - RSS before the call"
    record = {
        "n_unlabelled": u.shape[0],
        "n_labelled": l.shape[0],
        "d": u.shape[1],
        "k": k,
        "feature_dtype": str(u.dtype).removeprefix("torch."),
        "feature_bytes": feature_bytes,
        "n_init": n_init,
        "max_iter": max_iter,
        "balanced": balanced,
        "balance": balance,
        "distance_precision": distance_precision,
        "backend": res.backend,
        "seconds": seconds,
        "peak_bytes_beyond_features": beyond,
        "peak_gib_beyond_features": beyond / 2**30,
        "memory_measure": how,
        "inertia": res.inertia,
        "n_iter": res.n_iter,
        "searched_rows": res.searched_rows,
        "rechecked_rows": res.rechecked_rows,
        "max_cluster_size": int(torch.bincount(res.labels, minlength=k).max()),
    }
    return record, res.labels


def _warm_up(device, **kw):
    """First CUDA calls (cuBLAS handles, kernel loads) on a small problem with the same settings."""
    if torch.device(device).type == "cuda":
        u, l, t = scale_features(4000, 64, 20, device)
        run_round(u, l, t, 20, n_init=2, max_iter=2, **kw)


def time_round(
    n,
    d,
    k,
    device,
    *,
    dtype=torch.float16,
    n_init=10,
    max_iter=10,
    balanced=True,
    balance="reference",
    distance_precision="fp32",
    backend="auto",
    seed=0,
) -> dict:
    """Seconds and peak memory of one pseudo-label round on ``n`` x ``d`` synthetic features (``scale_features``,
    stored in ``dtype`` on ``device``) with ``k`` clusters: a JSON-ready dict (see ``run_round``), plus the device,
    commit and thread count. E.g. ``time_round(200_000, 768, 1000, "cpu")``."""
    u, l, t = scale_features(n, d, k, device, dtype, seed=seed)
    kw = {"balanced": balanced, "balance": balance, "distance_precision": distance_precision, "backend": backend}
    _warm_up(device, **kw)
    record, _ = run_round(u, l, t, k, n_init=n_init, max_iter=max_iter, seed=seed, **kw)
    commit, dirty = git_state()
    return {
        "n": n,
        **record,
        "device": device_name(torch.device(device)),
        "torch": versions()["torch"],
        "threads": torch.get_num_threads(),
        "commit": commit,
        "dirty": dirty,
    }


def main_scale(args):
    """``--scale``: features generated once, one round per ``--distance-precision``; JSON written after each run."""
    n, d, k = args.shape or SCALES[args.scale]
    device = torch.device(args.device)
    u, l, t = scale_features(n, d, k, device, DTYPES[args.feature_dtype])
    commit, dirty = git_state()
    out = {
        "scale": args.scale,
        "n": n,
        "commit": commit,
        "dirty": dirty,
        "device": device_name(device),
        "torch": versions()["torch"],
        "threads": torch.get_num_threads(),
        "faiss": faiss_available(),
        "faiss_gpu": faiss_available(gpu=True),
        "command": " ".join(sys.argv),
        "runs": [],
    }
    first = None
    for prec in args.distance_precision.split(","):
        kw = {"balance": "reference", "distance_precision": prec, "backend": args.backend}
        _warm_up(device, **kw)
        load_before = os.getloadavg()[0]  # a shared machine's other work slows a CPU round
        record, labels = run_round(u, l, t, k, n_init=args.n_init, max_iter=args.max_iter, **kw)
        record["loadavg_1min_before_after"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        if first is None:
            first = labels
        else:
            record["labels_equal_to_first_run"] = bool(torch.equal(labels, first))
        out["runs"].append(record)
        print(json.dumps(record), flush=True)
        if args.json:
            emit_json(out, args.json, indent=2, echo=False)
    return out


def run_ours(u, l, t, k, mode, n_init, max_iter, backend, repeat=1):
    """Best wall time of ``repeat`` identical runs (the machine may be shared)."""
    kw = {"plain": {}, "capacity": {"balanced": True}, "reference": {"balanced": True, "balance": "reference"}}[mode]
    times = []
    for _ in range(repeat):
        with timed(u.device) as clock:
            res = semi_supervised_kmeans(u, l, t, k, n_init=n_init, max_iter=max_iter, seed=0, backend=backend, **kw)
        times.append(clock.seconds)
    dt = min(times)
    sizes = torch.bincount(res.labels, minlength=k)
    return {
        "seconds": dt,
        "inertia": res.inertia,
        "n_iter": res.n_iter,
        "backend": res.backend,
        "max_cluster_size": int(sizes.max()),
    }


def run_reference(u, l, t, k, balanced, n_init, max_iter, distance="gemm"):
    cs = math.ceil((len(u) + len(l)) / k) if balanced else None
    ref = ReferenceSSKMeans(
        k,
        n_init=n_init,
        max_iter=max_iter,
        random_state=0,
        cluster_size=cs,
        variant="infosieve" if balanced else "gcd",
        kpp_deletion="fixed",
        empty="keep",
        sqdist_mode=distance,
    )
    with timed(u.device) as clock:
        ref.fit_mix(u, l, t)
    return {
        "seconds_measured": clock.seconds,
        "n_init_measured": n_init,
        "inertia": ref.inertia_,
        "max_cluster_size": int(torch.bincount(ref.labels_, minlength=k).max()),
    }


def sqdist_chunk_ratio(d, k, device):
    """Seconds of one 1024-row chunk of the published broadcast (a-b)² distance vs the GEMM form used here."""
    a, b = torch.randn(1024, d, device=device), torch.randn(k, d, device=device)
    out = {}
    for mode in ("broadcast", "gemm"):
        calls = call_times(lambda mode=mode: sqdist(a, b, mode=mode), torch.device(device), warmup=1, repeats=3)
        out[mode] = statistics.mean(calls.seconds)
    return out


def _shape(text: str) -> tuple[int, int, int]:
    n, d, k = (int(x) for x in text.split(","))
    return n, d, k


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--cases", default="a,b")
    ap.add_argument("--n-init", type=int, default=10)
    ap.add_argument("--max-iter", type=int, default=10)
    ap.add_argument("--ref-inits", default="2,1", help="reference restarts actually run per case (0 = skip)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--modes", default="plain,capacity,reference")
    ap.add_argument("--repeat", type=int, default=2, help="our runs per measurement; the best time is kept")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--ref-distance",
        default="gemm",
        choices=("gemm", "broadcast"),
        help="the baseline's chunk distance: gemm (faster than published, conservative) or broadcast (as published)",
    )
    ap.add_argument("--scale", choices=sorted(SCALES), help="one round at this size instead of the cases (see above)")
    ap.add_argument("--distance-precision", default="fp32", help="--scale: comma-separated, of fp32, tf32, bf16")
    ap.add_argument("--feature-dtype", default="fp16", choices=sorted(DTYPES), help="--scale: how features are stored")
    ap.add_argument("--shape", type=_shape, help="N,D,K in place of every case's and --scale's size")
    args = smoke.shrink(ap.parse_args(argv), shape=(2000, 32, 20), n_init=2, max_iter=2, repeat=1)
    if args.scale:
        return main_scale(args)
    device = torch.device(args.device)
    cases = args.cases.split(",")
    ref_inits = dict(zip(CASES, [int(x) for x in args.ref_inits.split(",")], strict=False))
    modes = args.modes.split(",")
    commit, dirty = git_state()
    out = {
        "commit": commit,
        "dirty": dirty,
        "device": device_name(device),
        "torch": versions()["torch"],
        "threads": torch.get_num_threads(),
        "faiss": faiss_available(),
        "n_init": args.n_init,
        "max_iter": args.max_iter,
        "repeat": args.repeat,
        "command": " ".join(sys.argv),
        "ref_distance": args.ref_distance,
        "cases": {},
        "notes": (
            "reference = benchmarks/published/kmeans.py (loop-based transcription of docs/reference.md §5.1/§5.2) with "
            "the chunk distance named by ref_distance: 'gemm' is faster than the published broadcast (a-b)^2 "
            "form (see sqdist_chunk_seconds), so its speed-ups are conservative; 'broadcast' is as published. "
            "Reference 'balanced' = InfoSieve's two-phase variant, compared with our balance='reference' "
            "(same algorithm) and 'capacity'."
        ),
    }
    if device.type == "cuda":  # warm up kernels and the allocator
        u, l, t = make_features(2000, 64, 20, device)
        semi_supervised_kmeans(u, l, t, 20, n_init=2, backend=args.backend)
    for c in cases:
        n, d, k = args.shape or CASES[c]
        u, l, t = make_features(n, d, k, device)
        res = {"n": n, "d": d, "k": k, "n_labelled": len(l), "ours": {}, "reference": {}, "speedup": {}}
        res["sqdist_chunk_seconds"] = sqdist_chunk_ratio(d, k, device)
        for m in modes:
            res["ours"][m] = run_ours(u, l, t, k, m, args.n_init, args.max_iter, args.backend, args.repeat)
            print(c, "ours", m, res["ours"][m], flush=True)
        r_init = ref_inits.get(c, 0)
        for name, balanced, ours_mode in (("plain", False, "plain"), ("balanced", True, "reference")):
            if not r_init or ours_mode not in modes:
                continue
            ref = run_reference(u, l, t, k, balanced, r_init, args.max_iter, args.ref_distance)
            ref["seconds_for_n_init"] = ref["seconds_measured"] * args.n_init / r_init
            same = run_ours(u, l, t, k, ours_mode, r_init, args.max_iter, args.backend)
            ref["ours_inertia_same_inits"] = same["inertia"]
            res["reference"][name] = ref
            for m in modes if balanced else ["plain"]:
                if balanced == (m != "plain"):
                    res["speedup"][f"{m}_vs_reference_{name}"] = ref["seconds_for_n_init"] / res["ours"][m]["seconds"]
            print(c, "reference", name, ref, flush=True)
        out["cases"][c] = res
        print(json.dumps({c: res["speedup"]}), flush=True)
        if args.json:  # after every case, so a run cut short keeps the cases it finished
            emit_json(out, args.json, indent=2, echo=False)
    return out


if __name__ == "__main__":
    main()
