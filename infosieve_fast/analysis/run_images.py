"""The user's own image files behind a discovery run's train samples (`make-shards --dataset discovery`).

make-shards numbers the train samples (`uq`) in the order the layout reader lists them, and records the folder it read
in the shards' `manifest.json`. Reading that folder again gives every sample's file back: what the report's gallery
shows and what `infosieve export` copies. A folder whose image count changed since make-shards is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..data.shard_format import DISCOVERY
from ..data.shard_manifest import run_manifest
from ..data.writing.layout_discovery import read_discovery


@dataclass(frozen=True)
class RunImages:
    """The discovery folder `root` and, by uq, each train sample's path relative to it (`labelled/...` or
    `unlabelled/...`)."""

    root: Path
    names: list[str]

    def path(self, uq: int) -> Path:
        return self.root / self.names[uq]


def run_images(run: str | Path, shards: str | None) -> RunImages:
    """The image files of the run's train samples, from the folder its shards (the run's `data.shards`) were made
    of."""
    run = Path(run)
    manifest = run_manifest(run, shards)
    if manifest["dataset"] != DISCOVERY:
        raise ValueError(
            f"{run} trained on {manifest['dataset']!r} shards: naming, galleries and export are for runs on your own "
            "images (make-shards --dataset discovery)"
        )
    root = Path(manifest["root"])
    raw = read_discovery(root)
    read = manifest["fingerprint"]["n_train"]
    if len(raw.train) != read:
        raise ValueError(
            f"{root} holds {len(raw.train):,} images but make-shards read {read:,} there: "
            "the folder changed since the run's shards were made; restore it, or make the shards and train again"
        )
    return RunImages(root, list(raw.train_names))
