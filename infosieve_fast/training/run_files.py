"""The names of a run folder's files (`run_folder.py` lists what each holds), shared by what writes a run and what
reads it back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CONFIG, LOG, METRICS, RESUMES = "config.yaml", "log.jsonl", "metrics.json", "resumes.jsonl"
UNREADABLE, CLUSTERING, TENSORBOARD = "unreadable.json", "clustering.npz", "tensorboard"
BEST_CHECKPOINT, BEST = "checkpoint-best.pt", "best.json"


def read_best(run_dir: str | Path) -> dict | None:
    """RUN/best.json, None when the run keeps no best checkpoint (yet)."""
    path = Path(run_dir) / BEST
    return json.loads(path.read_text()) if path.is_file() else None


def read_clustering(run_dir: str | Path) -> dict | None:
    """RUN/clustering.npz as {"uq", "targets", "preds", "n_old"} (`Evaluation.unlabelled_table`), None before the run
    has finished."""
    path = Path(run_dir) / CLUSTERING
    if not path.is_file():
        return None
    with np.load(path) as z:
        return {k: z[k] for k in z.files}
