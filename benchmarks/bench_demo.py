"""The demo's result, measured: `infosieve train --config configs/demo.yaml` as the README runs it (or another digits
config, `--config configs/demo-tree.yaml`), its All/Old/New before and after training, the final clustering's clusters
per digit and what the codes hold (`infosieve tree`'s measures), with the commit and the torch version that produced
them (CPU arithmetic differs between torch releases, so the same code may end elsewhere on another torch). The run
prints as it trains, then the result is printed as one JSON object.

    python -m benchmarks.bench_demo --out /tmp/demo_now --json benchmarks/results/demo_cpu.json

Smoke size (INFOSIEVE_BENCH_SMOKE=1): one epoch of 256 samples, one k-means init.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks import smoke
from benchmarks.harness import Stopwatch, cpu_report, finish_cpu_report
from infosieve_fast import cli
from infosieve_fast.analysis.run_reader import code_tree
from infosieve_fast.training.run_files import read_clustering

SMOKE_SETS = ("schedule.epochs=1", "train.train_subset=256", "kmeans.n_init=1")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/demo.yaml", help="a digits config (default configs/demo.yaml)")
    p.add_argument("--out", required=True, help="the demo's run folder (a new one)")
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting changed from the demo's")
    args = smoke.shrink(p.parse_args(argv), SMOKE_SETS)
    report, started = cpu_report("bench_demo", argv), Stopwatch()
    command = ["train", "--config", args.config, "--out", args.out, *[a for s in args.set for a in ("--set", s)]]
    if cli.main(command) != 0:
        raise SystemExit(f"infosieve {' '.join(command)} failed (its error is above)")
    metrics = json.loads((Path(args.out) / "metrics.json").read_text())
    summary = {"config": args.config, "sets": args.set, "before": metrics["before"], "after": metrics["after"]}
    summary |= {"protocol": metrics["protocol"], "final_clusters_by_class": clusters_by_class(args.out)}
    summary["code_measures"] = code_tree(args.out, max_depth=1)["measures"]
    return finish_cpu_report(report, summary, started, args.json)


def clusters_by_class(run: str) -> dict[str, list[int]]:
    """Per digit, how many of its unlabelled train samples each cluster of the final clustering holds (the counts
    behind the report's confusion matrix)."""
    c = read_clustering(run)
    n_clusters = int(max(c["preds"].max(), c["targets"].max())) + 1
    return {
        str(t): np.bincount(c["preds"][c["targets"] == t], minlength=n_clusters).tolist()
        for t in np.unique(c["targets"])
    }


if __name__ == "__main__":
    main()
