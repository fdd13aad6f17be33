"""`infosieve sweep`: one config over seeds and a grid of `--set` values, each run an ordinary run folder.

    infosieve sweep --config C --seeds 1-5 --grid KEY=V1,V2 [--grid ...] [--set KEY=VALUE ...] --out SWEEP
                    [--devices cuda:0,cuda:1 | --devices cpu]

SWEEP/sweep.json     the plan: the config (as loaded, with the --set values), the seeds, the grid, the run names
SWEEP/runs/<name>/   one run folder per grid point and seed (`run_folder.train`, as `infosieve train` writes it)
SWEEP/logs/<name>.log  the console output of a run started on a device from --devices
SWEEP/summary.json   per grid point: mean, sd, min and max over the seeds of All/Old/New (v2, v1, v2b), of the code
                     measures, of the seconds per epoch and of the peak memory (`run_results.summarise_runs`)
SWEEP/summary.md     the same as tables

A run's seed is `train.seed`. Every run resumes on its own: the same command again skips the finished runs and
continues a half-finished one from its last checkpoint, so a killed sweep goes on where it stopped. A command whose
plan differs from SWEEP/sweep.json (another config, grid, seeds or --set) is refused. Without --devices the runs go
one after another in this process, on the config's `train.device`; with --devices one run per device at a time, each
in its own process (`CUDA_VISIBLE_DEVICES` names its GPU, or hides them all for `cpu`), with an equal share of the
CPU cores as its thread count (`OMP_NUM_THREADS`, unless it is set already).

SIGTERM or SIGUSR1 (a scheduler's preemption) stops the sweep as it stops `infosieve train`: the run in flight (every
run in flight, with --devices: the signal is passed on to them) writes its checkpoint, and the sweep exits with the
preempted status (`preemption.PREEMPTED_EXIT`) and the command that continues it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..analysis import run_reader
from ..analysis.run_results import PARTS, TREE, format_spread, markdown_table, read_run, saved_tree, summarise_runs
from ..common.files import write_json
from ..config.settings import Config, apply_overrides, config_drift, from_dict, from_saved, load_config
from ..methods import METHODS
from ..training import run_files, run_folder
from ..training.preemption import PREEMPTED_EXIT, Preempted, StopSignals

PLAN, SUMMARY_JSON, SUMMARY_MD, RUNS, LOGS = "sweep.json", "summary.json", "summary.md", "runs", "logs"
SEED_KEY = "train.seed"


class SweepError(ValueError):
    """A sweep command that cannot work: printed as `error: ...`, exit status 2."""


# ------------------------------------------------------------------------------------------------ the plan
def parse_seeds(text: str) -> list[int]:
    """'1-5', '1,3,7' or both ('1-3,7'): distinct non-negative integers, in the order given."""
    seeds: list[int] = []
    for part in text.replace(" ", "").split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match or (match[2] is not None and int(match[2]) < int(match[1])):
            raise SweepError(f"--seeds {text!r}: {part!r} is not a seed or a range LOW-HIGH; write e.g. 1-5 or 1,3,7")
        seeds.extend(range(int(match[1]), int(match[2] or match[1]) + 1))
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise SweepError(f"--seeds {text!r} names seed(s) {repeated} twice: each seed runs once per grid point")
    return seeds


def split_values(text: str) -> list[str]:
    """'0.1,0.2' -> ['0.1', '0.2']; commas inside [...] or {...} belong to the value ('[1, 2],[3, 4]')."""
    values, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            values.append(current.strip())
            current = ""
        else:
            current += char
    return values + [current.strip()]


def parse_grid(items: list[str], sets: list[str]) -> dict[str, list[str]]:
    """`--grid KEY=V1,V2` strings -> {KEY: [V1, V2]}, in the order given."""
    grid: dict[str, list[str]] = {}
    set_keys = {s.partition("=")[0].strip() for s in sets}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        values = split_values(text)
        if not sep or not key or "" in values:
            raise SweepError(f"--grid {item!r} must look like KEY=V1,V2 (e.g. loss.code_temperature=0.1,0.2)")
        if key == SEED_KEY:
            raise SweepError(f"--grid {item!r}: the seed is the sweep's --seeds, not a grid key")
        if key in grid or key in set_keys:
            raise SweepError(f"--grid {item!r}: {key} is named twice (by --grid or --set); give each key once")
        if len(set(values)) < len(values):
            raise SweepError(f"--grid {item!r} repeats a value: each value runs once")
        grid[key] = values
    return grid


def run_name(point: dict[str, str], seed: int) -> str:
    """The run folder of a grid point and seed: 'loss.code_temperature=0.1-seed1' ('seed1' with no grid)."""
    label = ",".join(f"{k}={v}" for k, v in point.items())
    safe = re.sub(r"[^A-Za-z0-9._=,+-]", "_", label)
    return f"{safe}-seed{seed}" if safe else f"seed{seed}"


def point_label(point: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items()) or "(no grid)"


def make_plan(config: str | Path, seeds: list[int], grid: dict[str, list[str]], sets: list[str]) -> dict:
    """sweep.json's content. Every planned run's config is loaded here, so a bad key or value fails before any run."""
    if any(s.partition("=")[0].strip() == SEED_KEY for s in sets):
        raise SweepError(f"--set {SEED_KEY}=...: the seeds are the sweep's --seeds")
    base = load_config(config, sets)
    points = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    runs = [{"name": run_name(point, seed), "point": point, "seed": seed} for point in points for seed in seeds]
    names = [r["name"] for r in runs]
    if len(set(names)) < len(names):
        raise SweepError(
            f"two grid points give one run folder name ({names}): use values that differ in letters or digits"
        )
    plan = {
        "config": str(Path(config).resolve()),
        "sets": list(sets),
        "grid": grid,
        "seeds": seeds,
        "base_config": base.to_dict(),
        "runs": runs,
    }
    for run in runs:
        run_config(plan, run)
    return plan


def run_config(plan: dict, run: dict) -> Config:
    """A planned run's config: the recorded base config with the run's grid values and seed."""
    overrides = [f"{k}={v}" for k, v in run["point"].items()] + [f"{SEED_KEY}={run['seed']}"]
    return from_dict(apply_overrides(from_saved(plan["base_config"]).to_dict(), overrides))


def sweep_command(plan: dict, out: Path) -> str:
    """The command that makes (and continues) the sweep `plan` in `out`."""
    argv = ["infosieve", "sweep", "--config", plan["config"], "--seeds", ",".join(map(str, plan["seeds"]))]
    argv += [a for k, values in plan["grid"].items() for a in ("--grid", f"{k}={','.join(values)}")]
    argv += [a for s in plan["sets"] for a in ("--set", s)] + ["--out", str(out)]
    return shlex.join(argv)


def open_sweep(out: Path, plan: dict) -> None:
    """Write SWEEP/sweep.json for a new sweep; for an existing one, refuse a plan that differs from the recorded."""
    path = out / PLAN
    if not path.is_file():
        if out.is_dir() and any(out.iterdir()):
            raise FileExistsError(f"{out} is not empty and holds no {PLAN}: choose another --out for the sweep")
        write_json(path, {**plan, "command": sweep_command(plan, out)})
        return
    recorded = read_plan(out)
    drift = config_drift(recorded["base_config"], plan["base_config"])  # the config file and the --set values
    differences = [f"config {k}: {a!r} recorded, {b!r} now" for k, (a, b) in drift.items()]
    for key in ("grid", "seeds"):  # in order: the order names the runs
        if json.dumps(recorded[key]) != json.dumps(plan[key]):
            differences.append(f"{key}: {recorded[key]} recorded, {plan[key]} now")
    if differences:
        raise SweepError(
            f"{path} records another sweep ({'; '.join(differences)}). Continue it with the recorded command "
            f"`{recorded['command']}`, or choose another --out for a new sweep"
        )


def read_plan(sweep_dir: str | Path) -> dict:
    path = Path(sweep_dir) / PLAN
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a folder written by `infosieve sweep`")
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------------------------ the runs
def run_dir(sweep_dir: Path, run: dict) -> Path:
    return sweep_dir / RUNS / run["name"]


def is_done(sweep_dir: Path, run: dict) -> bool:
    """Trained, evaluated (metrics.json) and, for a method with codes, its last checkpoint's codes measured (a
    tree.json that is not stale)."""
    folder = run_dir(sweep_dir, run)
    return (folder / run_files.METRICS).is_file() and has_current_tree(folder)


def has_current_tree(folder: Path) -> bool:
    """Whether the run's codes are measured: a tree.json that is not stale, or none to make (its method learns no
    codes)."""
    if not METHODS[load_config(folder / run_files.CONFIG, saved=True).method].labeller:
        return True
    return (folder / TREE).is_file() and saved_tree(folder)[0] is not None


def run_one(sweep_dir: Path, plan: dict, run: dict) -> None:
    """Train (or continue) one planned run in this process, then measure its codes (RUN/tree.json)."""
    folder = run_dir(sweep_dir, run)
    if not (folder / run_files.METRICS).is_file():
        run_folder.train(run_config(plan, run), folder, resume=True)  # with no checkpoint yet: from scratch
    if not has_current_tree(folder):
        write_json(folder / TREE, run_reader.code_tree(folder))


def run_in_order(sweep_dir: Path, plan: dict, pending: list[dict]) -> None:
    for i, run in enumerate(pending, 1):
        print(f"sweep: run {i}/{len(pending)}: {run['name']}", flush=True)
        run_one(sweep_dir, plan, run)
        write_summary(sweep_dir)


def run_on_devices(sweep_dir: Path, pending: list[dict], devices: list[str]) -> None:
    """One worker process per device at a time, each running one planned run (`python -m
    infosieve_fast.commands.sweep`), its output in SWEEP/logs/<name>.log. A failed run lets the others in flight finish,
    then stops the sweep. A stop signal is passed on to the runs in flight; once they have checkpointed, `Preempted`
    ends the sweep."""
    queue, free, running, failed, preempted = list(pending), list(devices), {}, [], []
    threads, passed_on = threads_per_process(len(devices)), False
    with StopSignals() as stop, stop.deferred():  # the loop asks for the signal between its polls
        try:
            while running or (queue and not (failed or preempted or stop.received)):
                if stop.received and not passed_on:
                    passed_on = True
                    for proc in running:
                        proc.send_signal(signal.Signals[stop.received])  # each run checkpoints, exits preempted
                while free and queue and not (failed or preempted or stop.received):
                    device, run = free.pop(0), queue.pop(0)
                    running[start_worker(sweep_dir, run, device, threads)] = (run, device)
                    print(f"sweep: {run['name']} started on {device} (log: {log_path(sweep_dir, run)})")
                proc = next((p for p in running if p.poll() is not None), None)
                if proc is None:
                    time.sleep(0.5)
                    continue
                run, device = running.pop(proc)
                free.append(device)
                if proc.returncode == PREEMPTED_EXIT:
                    preempted.append(run["name"])
                elif proc.returncode:
                    failed.append(f"{run['name']} (exit status {proc.returncode}; see {log_path(sweep_dir, run)})")
                else:
                    print(f"sweep: {run['name']} finished")
                    write_summary(sweep_dir)
        except KeyboardInterrupt:
            for proc in running:
                proc.send_signal(signal.SIGINT)  # each run stops with its last checkpoint kept
            for proc in running:
                proc.wait()
            raise
    if failed:
        raise SweepError(f"sweep runs failed: {'; '.join(failed)}. Fix the cause, then rerun the same command")
    if preempted or stop.received:
        stopped = f"{', '.join(preempted)} stopped at a checkpoint" if preempted else "stopped between runs"
        raise Preempted(f"{stop.received or 'a stop signal to a run'}: {stopped}")


def log_path(sweep_dir: Path, run: dict) -> Path:
    return sweep_dir / LOGS / f"{run['name']}.log"


def threads_per_process(processes: int) -> int:
    """The CPU cores this process may use, shared equally among `processes` running at once (at least one each).
    Each process's OpenMP pool would otherwise take every core, and pools that together oversubscribe the cores spin
    against each other and slow every process several times over (torchrun likewise gives its ranks one thread
    each unless told otherwise)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // processes)


def start_worker(sweep_dir: Path, run: dict, device: str, threads: int) -> subprocess.Popen:
    """A worker process for `run` on `device`, with `threads` CPU threads unless OMP_NUM_THREADS says otherwise."""
    log_path(sweep_dir, run).parent.mkdir(parents=True, exist_ok=True)
    env = {
        "OMP_NUM_THREADS": str(threads),
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "" if device == "cpu" else device.removeprefix("cuda:"),
    }
    log = open(log_path(sweep_dir, run), "a")  # the child writes to it; this process closes it
    cmd = [sys.executable, "-m", "infosieve_fast.commands.sweep", str(sweep_dir), run["name"]]
    with log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def parse_devices(text: str, cfg: Config) -> list[str]:
    """'cuda:0,cuda:1' or 'cpu' (a device may repeat: two runs at a time on it). The config's `train.device` must let
    each worker take the device it is given: 'auto' (or 'cuda' for GPUs, 'cpu' for the CPU)."""
    devices = [d.strip() for d in text.split(",")]
    bad = [d for d in devices if not re.fullmatch(r"cpu|cuda:\d+", d)]
    if bad:
        raise SweepError(f"--devices {text!r}: {bad[0]!r} is not a device; write cuda:0,cuda:1 or cpu")
    wanted = cfg.train.device
    for device in devices:
        kind = device.split(":")[0]
        if wanted not in ("auto", kind):
            raise SweepError(
                f"--devices {text!r} with train.device={wanted}: each run is given its device by --devices, so the "
                f"config must say train.device=auto (or {kind}): add --set train.device=auto"
            )
    return devices


# ------------------------------------------------------------------------------------------------ the summary
def summarise(sweep_dir: str | Path) -> dict:
    """summary.json's content: per grid point, `run_results.summarise_runs` over its seeds' finished runs."""
    sweep_dir = Path(sweep_dir)
    plan = read_plan(sweep_dir)
    points = []
    for point in [dict(zip(plan["grid"], v, strict=True)) for v in itertools.product(*plan["grid"].values())]:
        runs = [r for r in plan["runs"] if r["point"] == point]
        results = [read_run(run_dir(sweep_dir, r)) for r in runs if is_done(sweep_dir, r)]
        points.append(
            {
                "point": point,
                "label": point_label(point),
                "planned": len(runs),
                "finished": len(results),
                "runs": [r["name"] for r in runs],
                "missing": [r["name"] for r in runs if not is_done(sweep_dir, r)],
                **summarise_runs(results),
            }
        )
    return {
        "sweep": str(sweep_dir),
        "command": plan["command"],
        "config": plan["config"],
        "seeds": plan["seeds"],
        "statistics": (
            "mean, sd, min and max over the seeds' finished runs; sd is the sample standard deviation "
            "(n - 1 in the denominator), null for a single run"
        ),
        "checkpoint": "last: every number is the last checkpoint's (RUN/metrics.json, clustering.npz, tree.json)",
        "points": points,
    }


CODE_COLUMNS = (
    ("all", "code All", 4),
    ("old", "code Old", 4),
    ("new", "code New", 4),
    ("purity_8", "depth-8 purity", 4),
    ("nmi_8", "depth-8 NMI", 4),
    ("mean_length", "mean code length", 1),
)


def summary_markdown(summary: dict) -> str:
    protocols = ("v2", "v1", "v2b")
    acc_header = ["grid point", "runs"] + [f"{p} {part.capitalize()}" for p in protocols for part in PARTS]
    acc_rows, cost_rows = [], []
    for pt in summary["points"]:
        runs = f"{pt['finished']}/{pt['planned']}"
        acc_rows.append(
            [pt["label"], runs] + [format_spread(pt["accuracy"][p][part]) for p in protocols for part in PARTS]
        )
        cost_rows.append(
            [pt["label"], runs]
            + [format_spread(pt["codes"].get(key), digits) for key, _, digits in CODE_COLUMNS]
            + [
                format_spread(pt["seconds_per_epoch"], 1),
                format_spread(pt["peak_memory_mib"], 0)
                + (f" ({pt['peak_memory_kind']})" if pt["peak_memory_kind"] else ""),
            ]
        )
    cost_header = ["grid point", "runs"] + [name for _, name, _ in CODE_COLUMNS] + ["s/epoch", "peak memory (MiB)"]
    missing = [name for pt in summary["points"] for name in pt["missing"]]
    return "\n".join(
        [
            f"# Sweep {summary['sweep']}",
            "",
            f"`{summary['command']}`",
            "",
            f"Seeds {', '.join(map(str, summary['seeds']))}. Each cell: mean ± sd [min, max] over the seeds; sd is the "
            "sample standard deviation (n − 1 in the denominator). Every number is the last checkpoint's.",
            *(
                [""] + [f"Not finished yet: {', '.join(missing)} (rerun the command above to continue)."]
                if missing
                else []
            ),
            "",
            "## All / Old / New on the unlabelled train samples",
            "",
            markdown_table(acc_header, acc_rows),
            "",
            "## The codes (SS-k-means on the codes; prefixes at depth 8), time per epoch, peak memory",
            "",
            markdown_table(cost_header, cost_rows),
            "",
        ]
    )


def write_summary(sweep_dir: Path) -> dict:
    summary = summarise(sweep_dir)
    write_json(sweep_dir / SUMMARY_JSON, summary)
    (sweep_dir / SUMMARY_MD).write_text(summary_markdown(summary))
    return summary


# ------------------------------------------------------------------------------------------------ the command
def run_sweep(plan: dict, out: str | Path, devices: str | None = None) -> dict:
    """Record `plan` in `out` (or check it against the recorded one), run every unfinished run, and write the
    summary; returns it."""
    out = Path(out)
    worker_devices = parse_devices(devices, from_saved(plan["base_config"])) if devices else None
    open_sweep(out, plan)
    pending = [r for r in plan["runs"] if not is_done(out, r)]
    print(f"sweep {out}: {len(plan['runs'])} runs, {len(plan['runs']) - len(pending)} finished, {len(pending)} to go")
    if worker_devices:
        run_on_devices(out, pending, worker_devices)
    else:
        run_in_order(out, plan, pending)
    summary = write_summary(out)
    print(summary_markdown(summary))
    print(f"wrote {out / SUMMARY_JSON} and {out / SUMMARY_MD}")
    return summary


def run_cli(args: argparse.Namespace) -> int:
    plan = make_plan(args.config, parse_seeds(args.seeds), parse_grid(args.grid, args.set), list(args.set))
    try:
        run_sweep(plan, args.out, args.devices)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: finished runs are kept and a half-finished run continues from its last checkpoint; "
            f"continue with `{sweep_command(plan, Path(args.out))}`",
            file=sys.stderr,
        )
        raise SystemExit(130) from None
    except Preempted as stopped:  # SIGTERM or SIGUSR1: the run in flight has its checkpoint
        print(f"preempted: {stopped}\ncontinue the sweep with `{sweep_command(plan, Path(args.out))}`", file=sys.stderr)
        raise SystemExit(PREEMPTED_EXIT) from None
    return 0


def worker_main(argv: list[str]) -> int:
    """`python -m infosieve_fast.commands.sweep SWEEP NAME`: run one planned run (started by `run_on_devices`)."""
    sweep_dir, name = Path(argv[0]), argv[1]
    plan = read_plan(sweep_dir)
    run = next(r for r in plan["runs"] if r["name"] == name)
    try:
        run_one(sweep_dir, plan, run)
    except KeyboardInterrupt:
        return 130
    except Preempted as stopped:
        print(f"preempted: {stopped}", file=sys.stderr)
        return PREEMPTED_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
