"""The names of a run folder's files (`run_folder.py` lists what each holds), shared by what writes a run and what
reads it back."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG, LOG, METRICS, RESUMES = "config.yaml", "log.jsonl", "metrics.json", "resumes.jsonl"
UNREADABLE, CLUSTERING, TENSORBOARD = "unreadable.json", "clustering.npz", "tensorboard"
BEST_CHECKPOINT, BEST = "checkpoint-best.pt", "best.json"


def read_best(run_dir: str | Path) -> dict | None:
    """RUN/best.json, None when the run keeps no best checkpoint (yet)."""
    path = Path(run_dir) / BEST
    return json.loads(path.read_text()) if path.is_file() else None
