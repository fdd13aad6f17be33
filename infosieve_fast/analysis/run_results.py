"""A run folder's results read back, and summarised over seeds, for `infosieve sweep` and `infosieve compare`.

- All/Old/New: RUN/metrics.json's `after`, under the run's protocol (`train.eval_protocol`); the other two of v1, v2
  and v2b score the same final clustering, RUN/clustering.npz (targets and clusters of the unlabelled train samples).
- the code measures: RUN/tree.json's `measures` (written by `infosieve tree`, and by the sweep after each run), only
  while the checkpoint it records is still the run's: a run trained on after it (`train --resume`) has a stale tree,
  whose numbers are left out with a note that says how to refresh it (`saved_tree`).
- the time per epoch: the mean of log.jsonl's `seconds`; the peak memory: the largest of its per-epoch
  `peak_gpu_bytes` (CUDA) or `peak_rss_bytes` (the process's peak resident set on the CPU).
- the checkpoint: every number here is the last checkpoint's (metrics.json is written from it). RUN/best.json, where
  present, is reported beside it: a best checkpoint was kept, but these numbers are not its.
Statistics over seeds use the sample standard deviation (n - 1 in the denominator); a value a run could not score
(null: no label to score it) is left out and `n` counts the values used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common.files import read_log
from ..config.settings import Config, load_config
from ..evaluation.metrics import PROTOCOLS, evaluate_split
from ..training.run_files import CLUSTERING, CONFIG, LOG, METRICS, read_best
from .run_reader import describe_run

TREE = "tree.json"
PARTS = ("all", "old", "new")
PEAK_KEYS = {"peak_gpu_bytes": "GPU memory allocated by torch", "peak_rss_bytes": "host peak resident set"}


@dataclass
class RunResult:
    path: Path
    cfg: Config
    log: list[dict]
    metrics: dict | None  # metrics.json: "before", "after" (under the run's protocol), "protocol"
    accuracy: dict[str, dict[str, float]] | None  # protocol -> All/Old/New after training
    codes: dict | None  # tree.json's measures (None when it is stale)
    best: dict | None  # best.json
    codes_note: str | None = None  # why `codes` is None though tree.json exists, or that its age is unknown

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def finished(self) -> bool:
        return self.metrics is not None

    @property
    def seconds_per_epoch(self) -> float | None:
        seconds = [r["seconds"] for r in self.log if "seconds" in r]
        return float(np.mean(seconds)) if seconds else None

    @property
    def peak_memory(self) -> tuple[float, str] | None:
        """(MiB, what was measured): the largest per-epoch peak of log.jsonl; None when no epoch recorded one."""
        for key, what in PEAK_KEYS.items():
            peaks = [r[key] for r in self.log if key in r]
            if peaks:
                return max(peaks) / 2**20, what
        return None

    @property
    def checkpoint(self) -> str:
        """Which checkpoint the numbers come from ("last, epoch E"), and the best one kept beside it."""
        if self.best is None:
            return describe_run(self.path, "last")
        best = self.best
        return f"{describe_run(self.path, 'last')} (not the best kept: {best['criterion']}, epoch {best['epoch']})"

    def record(self) -> dict:
        """The JSON-ready summary of the run."""
        peak = self.peak_memory
        return {
            "run": str(self.path),
            "seed": self.cfg.train.seed,
            "epochs": self.cfg.schedule.epochs,
            "epochs_done": len(self.log),
            "finished": self.finished,
            "protocol": self.cfg.train.eval_protocol,
            "before": self.metrics["before"] if self.metrics else None,
            "accuracy": self.accuracy,
            "codes": self.codes,
            "codes_note": self.codes_note,
            "seconds_per_epoch": self.seconds_per_epoch,
            "peak_memory_mib": None if peak is None else peak[0],
            "peak_memory_kind": None if peak is None else peak[1],
            "checkpoint": self.checkpoint,
        }


def read_run(run_dir: str | Path) -> RunResult:
    """What `run_dir` records (a run that has not finished has no accuracy and no codes)."""
    run = Path(run_dir)
    if not (run / CONFIG).is_file():
        raise FileNotFoundError(
            f"{run} holds no {CONFIG}: pass a run folder written by `infosieve train` or a sweep's runs/<name>"
        )
    cfg = load_config(run / CONFIG, saved=True)
    metrics = _read_json(run / METRICS)
    tree, note = saved_tree(run)
    return RunResult(
        run,
        cfg,
        read_log(run / LOG),
        metrics,
        protocol_accuracies(run, metrics),
        None if tree is None else tree["measures"],
        read_best(run),
        note,
    )


def saved_tree(run_dir: str | Path) -> tuple[dict | None, str | None]:
    """RUN/tree.json as (tree, note): (tree, None) when the checkpoint it records is the run's last checkpoint now;
    (None, note) when it is an older one (the run trained on after `infosieve tree`); (tree, note) for a tree.json that
    records no checkpoint (written before trees did: its age is unknown); (None, None) when there is none.
    (RUN/tree-best.json is not read back: `report --checkpoint best` computes the best checkpoint's tree again.)"""
    path = Path(run_dir) / TREE
    tree = _read_json(path)
    if tree is None:
        return None, None
    refresh = f"`infosieve tree --run {run_dir}`"
    current = describe_run(run_dir, "last")
    if "checkpoint" not in tree:
        return tree, (
            f"{path} does not record its checkpoint (an older infosieve wrote it): it may be older than the run's "
            f"'{current}'; run {refresh} to refresh it"
        )
    if tree["checkpoint"] == current:
        return tree, None
    return None, (
        f"{path} is stale: it is of the checkpoint '{tree['checkpoint']}', the run's is now '{current}'; run {refresh} "
        "to refresh it"
    )


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def protocol_accuracies(run: Path, metrics: dict | None) -> dict[str, dict[str, float]] | None:
    """All/Old/New after training under v1, v2 and v2b: the run's own protocol from metrics.json, the others scored
    on the same final clustering (clustering.npz); None for the ones a run folder without clustering.npz lacks."""
    if metrics is None:
        return None
    out: dict[str, dict[str, float] | None] = dict.fromkeys(PROTOCOLS)
    out[metrics["protocol"]] = metrics["after"]
    if (run / CLUSTERING).is_file():
        with np.load(run / CLUSTERING) as z:
            targets, preds, n_old = z["targets"], z["preds"], int(z["n_old"])
        for protocol in PROTOCOLS:
            if protocol != metrics["protocol"]:
                out[protocol] = evaluate_split(targets, preds, targets < n_old, protocol)
    return out


# ------------------------------------------------------------------------------------------------ over seeds
def spread(values: list[float]) -> dict | None:
    """mean, sd (sample standard deviation, n - 1 in the denominator; None for one value), min, max and n of the
    values that are not None; None when there is none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    sd = float(a.std(ddof=1)) if a.size > 1 else None
    return {"mean": float(a.mean()), "sd": sd, "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


def summarise_runs(runs: list[RunResult]) -> dict:
    """`spread` over the finished `runs` of every number a run reports: accuracy[protocol][part], before[part] (the
    evaluation before training, under each run's protocol), codes[measure], seconds_per_epoch and peak_memory_mib
    (with the kind of memory measured)."""
    done = [r for r in runs if r.finished]
    before = {part: spread([r.metrics["before"][part] for r in done]) for part in PARTS}
    accuracy = {
        p: {part: spread([r.accuracy[p][part] for r in done if r.accuracy[p] is not None]) for part in PARTS}
        for p in PROTOCOLS
    }
    measures = sorted({k for r in done if r.codes for k in r.codes})
    codes = {k: spread([r.codes[k] for r in done if r.codes and k in r.codes]) for k in measures}
    peaks = [r.peak_memory for r in done if r.peak_memory is not None]
    return {
        "accuracy": accuracy,
        "before": before,
        "codes": codes,
        "seconds_per_epoch": spread([r.seconds_per_epoch for r in done if r.seconds_per_epoch is not None]),
        "peak_memory_mib": spread([p[0] for p in peaks]),
        "peak_memory_kind": ", ".join(sorted({p[1] for p in peaks})) or None,
    }


# ------------------------------------------------------------------------------------------------ tables
def format_spread(s: dict | None, digits: int = 4, with_range: bool = True) -> str:
    """'mean ± sd [min, max]' (one run: its value; no run: '—')."""
    if s is None:
        return "—"
    text = f"{s['mean']:.{digits}f}"
    if s["sd"] is not None:
        text += f" ± {s['sd']:.{digits}f}"
        if with_range:
            text += f" [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"
    return text


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
