"""A run folder read back: the names of its files, its last or best checkpoint, a Trainer holding it, its category
tree and the centres new images are assigned to. `eval`, `tree`, `predict`, `report`, `compare`, the sweep and the
best checkpoint read runs through here; `run_folder.py` writes them (its docstring lists the files)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..evaluation.tree import build_tree, code_strings
from ..training import checkpoint as ckpt
from ..training.run_files import BEST_CHECKPOINT, read_clustering
from ..training.run_source import run_config

if TYPE_CHECKING:  # the file readers (`compare`, the best checkpoint's) stay without the training stack
    from ..training.engine import Trainer

CHECKPOINTS = ("last", "best")


def run_folder_problem(run_dir: str | Path) -> str | None:
    """What is wrong with `--run RUN_DIR` when it names no folder (then a file missing in it is not the problem to
    report), else None."""
    path = Path(run_dir)
    if path.is_dir():
        return None
    problem = "a file, not a folder" if path.exists() else "no such folder"
    return (
        f"--run {run_dir}: {problem}; pass the run folder an `infosieve train` run wrote (it printed "
        "`run folder: ...`; by default runs/<config>-<timestamp>)"
    )


def describe(state: dict, which: str) -> str:
    """What `eval`, `report` and `compare` say they read: "last, epoch E" or "best (criterion, epoch E)"."""
    if which == "last":
        return f"last, epoch {state['epoch']}"
    return f"best ({state['best']['criterion']}, epoch {state['best']['epoch']})"


def checkpoint_name(which: str) -> str:
    """The file name of a run's `which` ("last" or "best") checkpoint."""
    if which not in CHECKPOINTS:
        raise ValueError(f"--checkpoint must be one of {', '.join(CHECKPOINTS)}, got {which!r}")
    return ckpt.CHECKPOINT if which == "last" else BEST_CHECKPOINT


def load_run_checkpoint(run_dir: str | Path, which: str = "last", map_location="cpu") -> tuple[dict, str]:
    """(state, `describe`'s words) of the run's last or best checkpoint."""
    name = checkpoint_name(which)
    if which == "best" and not (Path(run_dir) / name).is_file():
        raise FileNotFoundError(
            f"no {name} in {run_dir}: the run keeps only its last checkpoint (checkpoint.best: none). Read "
            "it with --checkpoint last, or train with --set checkpoint.best=labelled_holdout (or kmeans_objective)"
        )
    state = ckpt.load_checkpoint(run_dir, map_location=map_location, name=name)
    return state, describe(state, which)


def describe_run(run_dir: str | Path, which: str = "last") -> str:
    """`describe` of a run folder's checkpoint, read memory-mapped (cheap: no tensor is loaded)."""
    name = checkpoint_name(which)
    if not (Path(run_dir) / name).is_file():
        return f"{which}: no {name} in {run_dir}"
    return describe(ckpt.load_checkpoint(run_dir, name=name, mmap=True), which)


def trainer_from_run(run_dir: str | Path, checkpoint: str = "last") -> Trainer:
    """A trainer holding a run folder's last (or best) checkpoint (its config and weights), for commands that read a
    run."""
    return read_run(run_dir, checkpoint)[0]


def read_run(run_dir: str | Path, checkpoint: str = "last") -> tuple[Trainer, str]:
    """`trainer_from_run`, and what it read: "last, epoch E" or "best (criterion, epoch E)". The run's data source is
    rebuilt from its config, checked first (run_source.py: a recorded command or URL runs only when typed)."""
    from ..training.engine import Trainer

    state, read = load_run_checkpoint(run_dir, checkpoint)
    trainer = Trainer(run_config(state["config"], run_dir), pretrained=False)
    trainer.load_model_state(state)
    return trainer, read


def code_tree(run_dir: str | Path, max_depth: int = 8, checkpoint: str = "last") -> dict:
    """The implicit category tree of a run's last (or best) checkpoint: `trainer_tree`, under "checkpoint" what was
    read and, for a run with an unlabelled pool, under "code_separation" whether the codes carry the classes
    (code_separation.py) and under "novel_clusters" each novel cluster's nearest known classes and, where they do, its
    place in the tree (cluster_places.py): of the final clustering (RUN/clustering.npz) for the last checkpoint, of
    the best's own clustering, computed again, for the best."""
    from ..common.labels import NO_LABEL
    from ..evaluation.code_metrics import code_features
    from ..evaluation.code_separation import code_separation
    from .cluster_names import checkpoint_names
    from .cluster_places import place_clusters

    trainer, read = read_run(run_dir, checkpoint)
    fs = code_features(trainer.evaluator)
    tree = trainer_tree(trainer, max_depth, fs) | {"checkpoint": read}
    if not (fs.targets == NO_LABEL).any():
        return tree
    n_old = trainer.source.n_old
    if checkpoint == "best":
        final = trainer.evaluate_full()
        clustering, centers = final.unlabelled_table(n_old), final.clustering.centers
    elif trainer.centers is not None:  # the final evaluation's, saved with RUN/clustering.npz
        clustering, centers = read_clustering(run_dir), trainer.centers
    else:  # a run stopped before its final clustering
        return tree
    length, uq = trainer.cfg.model.code_length, fs.uq.tolist()
    codes = dict(zip(uq, code_strings(fs.feats[:, :length], fs.feats[:, length:]), strict=True))
    targets = dict(zip(uq, fs.targets.tolist(), strict=True))
    names, given = list(trainer.source.class_names), checkpoint_names(run_dir, checkpoint)
    tree["code_separation"] = separation = code_separation(codes, targets)
    carries = separation["carries"]
    tree["novel_clusters"] = place_clusters(codes, targets, clustering, names, centers, given, max_depth, carries)
    return tree


def assignment_centers(trainer: Trainer, run_dir: str | Path, checkpoint: str) -> torch.Tensor:
    """The train clustering's centres that test or new images are assigned to: the last checkpoint holds the final
    evaluation's; the best one holds its epoch's pseudo-label round (features of the weights before that epoch), so
    its evaluation's SS-k-means runs again."""
    if checkpoint == "best":
        return trainer.evaluate_full().clustering.centers
    if trainer.centers is None:
        raise ValueError(f"{run_dir}'s checkpoint holds no k-means centres (it predates them): train it again")
    return trainer.centers


def trainer_tree(trainer: Trainer, max_depth: int = 8, fs=None) -> dict:
    """The implicit category tree of a trainer's weights: codes of the train samples (test view), cut by the mask.
    The root also holds `measures`: `code_metrics.evaluate_codes` of the same codes (on the unlabelled samples).
    `fs`: `code_metrics.code_features(trainer.evaluator)`, if already computed."""
    from ..evaluation.code_metrics import code_features, evaluate_codes

    fs = fs if fs is not None else code_features(trainer.evaluator)
    length = trainer.cfg.model.code_length
    tree = build_tree(code_strings(fs.feats[:, :length], fs.feats[:, length:]), fs.targets.cpu(), max_depth)
    tree["measures"] = evaluate_codes(trainer.evaluator, fs)
    tree["class_names"] = list(trainer.source.class_names)  # target order: what the report labels nodes with
    return tree
