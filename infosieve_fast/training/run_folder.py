"""A run folder's lifecycle: `train` opens a new run or resumes one, trains its epochs and evaluates it at the end
(`run_reader.py` reads a run back). Every rank makes the same calls; only rank 0 writes and prints.

RUN/config.yaml      the run's config: written when the run opens, rewritten by a resume's `--set`
RUN/fingerprint.json the environment the run started in (fingerprint.py); each resume's in fingerprint-resumes.jsonl
RUN/log.jsonl        one line per finished epoch (`Trainer.train_epoch`'s record, `epoch_log`'s entries)
RUN/checkpoint.pt    after every epoch, and after the final evaluation (with its k-means centres)
RUN/checkpoint-best.pt, RUN/best.json   the best epoch by `checkpoint.best`'s criterion (best_checkpoint.py)
RUN/resumes.jsonl    one line per resume with `--set`: the epoch it continued at, the strings and what they changed
RUN/unreadable.json  the train samples that could not be read (only when there are some)
RUN/metrics.json     All/Old/New before and after training: the run's result
RUN/clustering.npz   the final clustering of the unlabelled train samples, for `infosieve report`
RUN/tensorboard/     the log's numbers as scalars (`train.tensorboard`)
RUN/.lock            held while a run trains there: a second run on the folder is refused (run_lock.py)
"""

from __future__ import annotations

import contextlib
import json
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..common import distributed as dist
from ..common import files as common_files
from ..config.settings import Config, ConfigError, config_drift, save_config
from ..data.reading.base import GCDSource
from ..data.shard_format import DISCOVERY
from ..data.shard_manifest import run_manifest
from ..evaluation.discovery import PREDICTIONS, nothing_new, novel_pool_images
from ..methods import METHODS
from ..network.model import Backbone
from . import checkpoint as ckpt
from . import fingerprint
from .best_checkpoint import write_best
from .engine import Evaluation, Trainer, status_line
from .preemption import MidEpoch, Preempted, StoppedAtOnce, StopSignals
from .run_files import (
    BEST,
    BEST_CHECKPOINT,
    CLUSTERING,
    CONFIG,
    LOG,
    METRICS,
    RESUMES,
    TENSORBOARD,
    UNREADABLE,
    read_clustering,
)
from .run_lock import LOCK, held_run_folder
from .trainer_setup import started_run

# what a run killed before its first checkpoint can leave; a folder holding only these is started again
_LEFTOVERS = {CONFIG, LOG, RESUMES, UNREADABLE, TENSORBOARD, fingerprint.FINGERPRINT, BEST_CHECKPOINT, BEST, LOCK}


def train(
    cfg: Config,
    run_dir: str | Path,
    *,
    resume: bool = False,
    source: GCDSource | None = None,
    backbone: Backbone | None = None,
    stop_after: Callable[[int], bool] | None = None,
    overrides: Sequence[str] = (),
    device: torch.device | None = None,
) -> dict | None:
    """Train (or resume) a run in `run_dir`; returns metrics.json's content, or None if `stop_after` ended it early.

    `stop_after(epoch)` is asked after each epoch's checkpoint; True stops the run there (as a kill would).
    Resuming, `cfg` must equal the checkpoint's config except for the keys named by `overrides` (the `--set KEY=VALUE`
    strings already applied to `cfg`), which are recorded in RUN/resumes.jsonl and RUN/config.yaml; the backbone is
    built without `model.pretrained` (the checkpoint holds every weight). A folder with no checkpoint yet (a run killed
    before its first epoch ended) starts again from scratch, resumed or not.
    `device`: the run's device where the caller has started the run (`trainer_setup.started_run`, which also opens
    torchrun's process group); None: this call starts it. With a group, every rank calls this with the same arguments
    (all ranks read the checkpoint to resume; rank 0 writes the folder).
    SIGTERM or SIGUSR1 stops the run at its next step or epoch boundary with a checkpoint, and raises `Preempted`
    (preemption.py); before the run's first evaluation (while its data and model are set up), or a second time, it
    stops the run at once, its last checkpoint as it was. The folder is locked for the call (run_lock.py): a folder
    another live run holds is refused.
    """
    with contextlib.ExitStack() as stack:
        if device is None:
            device = stack.enter_context(started_run(cfg.train.device))
        stack.enter_context(held_run_folder(Path(run_dir)))
        stop = stack.enter_context(StopSignals())
        try:
            return _train(cfg, Path(run_dir), device, resume, source, backbone, stop_after, list(overrides), stop)
        except StoppedAtOnce as stopped:
            raise stopped_at_once(stopped, Path(run_dir)) from None


def stopped_at_once(stopped: StoppedAtOnce, run_dir: Path) -> Preempted:
    """The error of a run ended by `StoppedAtOnce`: when it came, and the way back."""
    ckpt.wait_for_checkpoint()
    when = "again, without waiting for the step" if stopped.again else "while the run was being set up"
    if (run_dir / ckpt.CHECKPOINT).is_file():
        way_back = (
            f"its last checkpoint, {run_dir / ckpt.CHECKPOINT}, is as it was: continue with "
            f"`infosieve train --resume {run_dir}`"
        )
    else:
        way_back = "it had no checkpoint yet: run the same command again (the folder is started afresh)"
    return Preempted(f"{stopped.signal_name} {when}: stopped at once; {way_back}")


def _train(
    cfg: Config,
    run_dir: Path,
    device: torch.device,
    resume: bool,
    source: GCDSource | None,
    backbone: Backbone | None,
    stop_after: Callable[[int], bool] | None,
    overrides: list[str],
    stop: StopSignals,
) -> dict | None:
    """The run, in the order of its work: the folder, everything the run needs, where it starts, its epochs, its end."""
    started = time.perf_counter()
    # The folder: a resume continues from its checkpoint (a finished run returns its result); a new run needs an empty
    # folder, or one that a run killed before its first checkpoint left.
    state = None
    if resume and (run_dir / ckpt.CHECKPOINT).is_file():
        state, finished = resume_run(cfg, run_dir, overrides, device)
        if finished:
            return finished_result(cfg, run_dir)
    else:
        prepare_new_folder(run_dir, device)

    # Everything the run needs, built once: data, model and loss, optimiser, compile and CUDA graph settings, the
    # evaluator and the best-checkpoint judge. A resumed run's weights all come from its checkpoint.
    trainer = Trainer(cfg, source, backbone, device=device, pretrained=state is None)
    trainer.stop = stop

    with stop.deferred():  # from here on, a stop signal waits for the next step, which checkpoints
        # Where the run starts: the checkpoint's epoch, or epoch 0 with the untrained model's All/Old/New ("before").
        if state is not None:
            trainer.load_state_dict(state)
            start, before = state["epoch"], state["before"]
            if dist.is_main_process():
                trainer.best.restore_files(run_dir, state)
        else:
            start, before = 0, open_new_run(trainer, run_dir)

        # The epochs: each trained, checked, judged and evaluated by the trainer, logged and checkpointed here.
        recorder = RunFolderRecorder(run_dir, before, start, cfg.train.tensorboard)
        if not trainer.train_epochs(start, recorder, stop_after):
            return None

        # The end: All/Old/New after training, the final checkpoint, clustering.npz and metrics.json.
        metrics = final_evaluation(trainer, run_dir, before)
        if dist.is_main_process():
            print_best(trainer, run_dir)
            resumed_at = None if state is None else start
            print_finished(run_dir, time.perf_counter() - started, resumed_at, cfg, trainer.evaluator.has_test_split())
        dist.barrier()
    return metrics


# ------------------------------------------------------------------------------------------------ open a new run
def prepare_new_folder(run_dir: Path, device: torch.device) -> None:
    """Refuse a folder that holds a run or other files; clear what a run killed before its first checkpoint left."""
    if dist.all_reduce_any(not _restartable(run_dir), device):
        if (run_dir / ckpt.CHECKPOINT).is_file():
            raise FileExistsError(
                f"run folder {run_dir} holds a run: continue it with `infosieve train --resume {run_dir}`, or choose "
                "another --out"
            )
        raise FileExistsError(f"run folder {run_dir} is not empty (and not a run folder): choose another --out")
    if dist.is_main_process() and any(p.name != LOCK for p in run_dir.iterdir()):  # rank 0's lock made it
        print(f"{run_dir} holds no checkpoint (the run was stopped before its first epoch ended): starting it again")
        ckpt.remove_temporary_files(run_dir)
        for name in (LOG, UNREADABLE, BEST_CHECKPOINT, BEST):
            (run_dir / name).unlink(missing_ok=True)


def _restartable(run_dir: Path) -> bool:
    """True when `run_dir` holds nothing but what a run killed before its first checkpoint leaves."""
    names = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()
    return not any(n not in _LEFTOVERS and not (n.startswith(".") and n.endswith(".tmp")) for n in names)


def open_new_run(trainer: Trainer, run_dir: Path) -> dict[str, float]:
    """Create the folder with its config.yaml and fingerprint.json, and return the untrained model's All/Old/New (the
    "before" row)."""
    if dist.is_main_process():
        print(f"run folder: {run_dir}")  # once its checks passed: the folder it names now exists
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(trainer.cfg, run_dir / CONFIG)
        fingerprint.write(run_dir, fingerprint.collect(trainer.cfg, trainer.device, dist.get_world_size()))
    with status_line("before training: test-view feature pass + SS-k-means"):
        before = trainer.evaluate()
    print_table({"before": before}, trainer.cfg.train.eval_protocol)
    return before


# ------------------------------------------------------------------------------------------------ resume a run
def resume_run(cfg: Config, run_dir: Path, overrides: list[str], device: torch.device) -> tuple[dict, bool]:
    """The run's checkpoint (loaded on `device`, its config checked against `cfg`) and whether the run has finished
    (every epoch, metrics.json, nothing changed). A run that goes on has its folder taken back to the checkpoint and
    its `--set` changes recorded; `Trainer.load_state_dict` then continues it."""
    state = ckpt.load_checkpoint(run_dir, map_location=device)
    changed = check_drift(cfg, state, run_dir, overrides)
    if state["epoch"] >= cfg.schedule.epochs and (run_dir / METRICS).is_file():
        if changed:
            refuse_set_on_finished_run(run_dir, state["epoch"], changed)
        return state, True
    reopen_run(cfg, run_dir, state["epoch"], overrides, changed)
    if dist.is_main_process():
        fingerprint.record_resume(run_dir, cfg, device, dist.get_world_size(), state["epoch"])
    return state, False


def check_drift(cfg: Config, state: dict, run_dir: Path, overrides: list[str]) -> dict:
    """The differences between the checkpoint's config and `cfg` that `overrides` explain; any other is refused."""
    drift = config_drift(state["config"], cfg.to_dict())
    named = [o.partition("=")[0].strip() for o in overrides]
    recorded = _recorded_overrides(run_dir, state["epoch"])
    explained = {k: v for k, v in drift.items() if any(k == n or k.startswith(n + ".") for n in named)}
    fixed = [k for k in explained if k.startswith("model.") and k != "model.pretrained" or k == "optim.name"]
    if fixed:
        raise ConfigError(
            f"--set {', '.join(fixed)} on resume: the checkpoint's weights and optimizer state are built for the saved "
            "network and optimizer, so they cannot continue with these changed; start a new run with --config instead"
        )
    chosen = [k for k in explained if k.startswith("checkpoint.")]
    if chosen:
        raise ConfigError(
            f"--set {', '.join(chosen)} on resume: the best checkpoint's criterion (and the labelled images it holds "
            "out of training) is fixed for a run's whole length; start a new run with --config instead"
        )
    refused = {k: v for k, v in drift.items() if k not in explained and not (k in recorded and recorded[k] == v[1])}
    if refused:
        listed = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in refused.items())
        raise ConfigError(
            f"{run_dir / CONFIG} differs from its checkpoint's config ({listed}). A resumed run keeps its "
            f"settings: restore config.yaml, or change a setting on purpose with `infosieve train --resume {run_dir} "
            f"--set KEY=VALUE` (recorded in {run_dir / RESUMES})"
        )
    return explained


def refuse_set_on_finished_run(run_dir: Path, epochs: int, changed: dict) -> None:
    """A `--set` that leaves a finished run no epoch to train would only rewrite its config.yaml, which would then no
    longer describe the run behind metrics.json: refused before anything is written."""
    raise ConfigError(
        f"--set {', '.join(changed)} on resume: {run_dir} is finished (its {epochs} epochs trained, its result in "
        f"{run_dir / METRICS}), so the change would train nothing; continue it with --set schedule.epochs="
        f"{epochs + 1} (or more) alongside, or start a new run with --config"
    )


def _recorded_overrides(run_dir: Path, epoch: int) -> dict:
    """The changes that resumes at `epoch` recorded (config.yaml holds them, the checkpoint not yet)."""
    changed: dict = {}
    for record in common_files.read_log(run_dir / RESUMES):
        if record.get("epoch") == epoch:
            changed.update({k: v[1] for k, v in record.get("changed", {}).items()})
    return changed


def finished_result(cfg: Config, run_dir: Path) -> dict:
    """A resume of a run that has finished and changes nothing: its metrics.json, nothing reruns."""
    if dist.is_main_process():
        print(f"{run_dir} already finished its {cfg.schedule.epochs} epochs; its result is in {run_dir / METRICS}")
        print_next_steps(run_dir, shards=cfg.data.shards, codes=METHODS[cfg.method].labeller)
    return json.loads((run_dir / METRICS).read_text())


def reopen_run(cfg: Config, run_dir: Path, start: int, overrides: list[str], changed: dict) -> None:
    """Rank 0 takes the folder back to its checkpoint (epoch `start`): drops temporary files and later log lines,
    records the `--set` changes, and says where the run goes on."""
    if not dist.is_main_process():
        return
    ckpt.remove_temporary_files(run_dir)
    common_files.rewrite_log(run_dir / LOG, [r for r in common_files.read_log(run_dir / LOG) if r["epoch"] < start])
    if overrides:  # recorded first: a kill before the next checkpoint leaves config.yaml explained
        common_files.append_log(
            run_dir / RESUMES,
            {"epoch": start, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "set": overrides, "changed": changed},
        )
        save_config(cfg, run_dir / CONFIG)
    if start < cfg.schedule.epochs:
        print(f"resuming {run_dir} at epoch {start + 1}/{cfg.schedule.epochs}")
    else:
        print(f"resuming {run_dir}: its {cfg.schedule.epochs} epochs are done; the final evaluation runs")
    for key, (a, b) in changed.items():
        print(f"  --set {key}: {a!r} -> {b!r} (recorded in {run_dir / RESUMES})")


# ------------------------------------------------------------------------------------------------ the epochs
class RunFolderRecorder:
    """The run folder's side of the epochs (`Trainer.train_epochs`): rank 0 writes each epoch's log line and
    checkpoint (and TensorBoard's scalars) and prints its line; a stop signal's checkpoint and log record."""

    def __init__(self, run_dir: Path, before: dict, start: int, tensorboard: bool):
        self.run_dir, self.before = run_dir, before
        self.board = tensorboard_writer(run_dir, start) if tensorboard and dist.is_main_process() else None

    def epoch_done(self, trainer: Trainer, record: dict) -> None:
        """An epoch's record logged and its checkpoint written by rank 0 (in the background with
        `train.background_checkpoint`), and its console line."""
        if self.board is not None:
            log_scalars(self.board, record)
        if dist.is_main_process():
            write_epoch(self.run_dir, trainer, record, self.before)
            epoch, epochs = record["epoch"] + 1, trainer.cfg.schedule.epochs
            learns_codes = trainer.model.labeller is not None
            codes = f"age {record['age']:.2f}  base {record['base']:.3f}  " if learns_codes else ""
            print(
                f"epoch {epoch}/{epochs}  loss {record['loss_total']:.4f}  lr {record['lr']:.3g}  "
                f"{codes}{record['seconds']:.1f}s"
            )  # the labeller's age and positional base only where a method learns codes
        dist.barrier()  # the checkpoint is written (or being written, in the background) before any rank moves on

    def stopped_mid_epoch(self, trainer: Trainer, mid: MidEpoch) -> Preempted:
        """Rank 0 writes the checkpoint of a stopped epoch (the weights and optimizer after `mid.step` steps, and
        `mid`); the error that says where the run stopped."""
        if dist.is_main_process():
            state = trainer.best.stamp(trainer.state_dict(mid.epoch, self.before))
            state["mid_epoch"] = mid.to_state()
            ckpt.save_checkpoint(self.run_dir, state)
        return self.preempted(trainer, mid.epoch, mid.step)

    def preempted(self, trainer: Trainer, epoch: int, step: int) -> Preempted:
        """Once the checkpoint that resumes at `epoch`, `step` is durable: rank 0 appends log.jsonl's `preempted`
        record (a resume drops it with the epoch's other lines); the error every rank raises, which says where the run
        stopped."""
        ckpt.wait_for_checkpoint()
        signal_name, epochs = trainer.stop.received, trainer.cfg.schedule.epochs
        if dist.is_main_process():
            at = {"signal": signal_name, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            common_files.append_log(self.run_dir / LOG, {"epoch": epoch, "preempted": at})
        dist.barrier()
        where = f"epoch {epoch + 1}/{epochs} at step {step}" if step else f"the start of epoch {epoch + 1}/{epochs}"
        return Preempted(
            f"{signal_name}: stopped at {where}; the checkpoint is in {self.run_dir / ckpt.CHECKPOINT}, continue with "
            f"`infosieve train --resume {self.run_dir}`"
        )

    def ended_early(self) -> None:
        """`stop_after` ended the run: a rank that goes on to resume must find the checkpoint rank 0 was writing."""
        ckpt.wait_for_checkpoint()
        dist.barrier()


def write_epoch(run_dir: Path, trainer: Trainer, record: dict, before: dict) -> None:
    """An epoch's unreadable list, log line and checkpoint, then the best checkpoint when the epoch is the new best.
    The log line first: a kill between the two leaves a line the checkpoint lacks, dropped on resume (the other order
    would lose the epoch's line). With `train.background_checkpoint` the checkpoint (a host snapshot taken here) is
    written while the next epoch runs: a kill before it is durable is the same case, the run resumes from the previous
    checkpoint and drops this line (and trains the epoch again, which rewrites the best files identically)."""
    write_unreadable(run_dir, trainer)
    common_files.append_log(run_dir / LOG, record)
    save = ckpt.save_checkpoint_in_background if trainer.cfg.train.background_checkpoint else ckpt.save_checkpoint
    state = trainer.best.stamp(trainer.state_dict(record["epoch"] + 1, before))
    save(run_dir, state, trainer.cfg.checkpoint.keep_last)
    if trainer.best.holds(state):
        write_best(run_dir, state)


def write_unreadable(run_dir: Path, trainer: Trainer) -> None:
    """`RUN/unreadable.json`: the train samples left out because they could not be read (only when there are some)."""
    if not trainer.unreadable:
        return
    describe = getattr(trainer.source, "describe", lambda uq: {"uq": uq})
    entries = [describe(uq) for uq in trainer.unreadable]
    common_files.write_json(run_dir / UNREADABLE, {"count": len(entries), "samples": entries})


def tensorboard_writer(run_dir: Path, start_epoch: int):
    """`train.tensorboard`: a SummaryWriter on RUN/tensorboard; a resumed run drops the events after its checkpoint."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run_dir / TENSORBOARD), purge_step=start_epoch + 1)


def log_scalars(board, record: dict) -> None:
    """Every number of an epoch's log record as a scalar at step epoch + 1 (eval dicts as eval/all, ...)."""
    step = record["epoch"] + 1
    for key, value in record.items():
        if isinstance(value, dict):
            for part, v in value.items():
                if isinstance(v, int | float):  # not None (a part no label can score) nor words (compile_graphs)
                    board.add_scalar(f"{key}/{part}", v, step)
        elif key != "epoch" and isinstance(value, int | float):
            board.add_scalar(key, value, step)
    board.flush()


# ------------------------------------------------------------------------------------------------ the end
def final_evaluation(trainer: Trainer, run_dir: Path, before: dict) -> dict:
    """All/Old/New after training; rank 0 saves the checkpoint again with the final centres (and the best record), the
    clustering and metrics.json (the run's result, returned)."""
    cfg = trainer.cfg
    with status_line("after training: test-view feature pass + SS-k-means"):
        final = trainer.evaluate_full()
    metrics = {"before": before, "after": final.metrics, "protocol": cfg.train.eval_protocol}
    trainer.centers = final.clustering.centers.cpu()
    if dist.is_main_process():
        ckpt.save_checkpoint(run_dir, trainer.best.stamp(trainer.state_dict(cfg.schedule.epochs, before)))
        write_clustering(run_dir, final, trainer.source.n_old)
        common_files.write_json(run_dir / METRICS, metrics)
    print_table({"before": before, "after": final.metrics}, cfg.train.eval_protocol)
    return metrics


def write_clustering(run_dir: Path, final: Evaluation, n_old: int) -> None:
    """`RUN/clustering.npz`: the final clustering of the unlabelled train samples (uq, target, cluster) that the
    reported metrics score, for `infosieve report`."""
    import numpy as np

    common_files.atomic_write(run_dir / CLUSTERING, lambda f: np.savez(f, **final.unlabelled_table(n_old)))


def print_best(trainer: Trainer, run_dir: Path) -> None:
    """Where the best checkpoint is, when the run keeps one (`checkpoint.best`)."""
    best = trainer.best
    if best.enabled:
        print(
            f"best checkpoint: {best.best['criterion']} {best.best['value']:.6g} at epoch {best.best['epoch']}, "
            f"in {run_dir / BEST_CHECKPOINT} (read it with --checkpoint best)"
        )


def print_table(metrics: dict[str, dict[str, float | None]], protocol: str) -> None:
    """All/Old/New per row; n/a for a part no label can score (an unlabelled pool's)."""
    if not dist.is_main_process():
        return
    print(f"\n{'accuracy (' + protocol + ')':<16}{'All':>8}{'Old':>8}{'New':>8}")
    for name, m in metrics.items():
        print(f"{name:<16}" + "".join("     n/a" if m[p] is None else f"{m[p]:>8.4f}" for p in ("all", "old", "new")))


def print_finished(run_dir: Path, seconds: float, resumed_at: int | None, cfg: Config, test_split: bool) -> None:
    """The session's time and the way on; `resumed_at`: the epoch this session started at (None: a new run);
    `test_split`: whether the run's data has a test split to score."""
    session = ""
    if resumed_at is not None:
        at = "for the final evaluation" if resumed_at >= cfg.schedule.epochs else f"at epoch {resumed_at + 1}"
        session = f" (this session, resumed {at})"
    print(f"\nfinished in {format_duration(seconds)}{session}; run folder: {run_dir}")
    print_next_steps(run_dir, test_split, cfg.data.shards, METHODS[cfg.method].labeller)


def format_duration(seconds: float) -> str:
    seconds = round(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def print_next_steps(run_dir: Path, test_split: bool = False, shards: str | None = None, codes: bool = True) -> None:
    """The commands that read the run; `--split test` only where the run's data has a test split; the tree only where
    the run's method learns `codes`; on your own images (`shards` made by `make-shards --dataset discovery`) also
    predict, name and export (`own_images_steps`)."""
    run = shlex.quote(str(run_dir))
    print("next:")
    test = " (--split test: the held-out split)" if test_split else ""
    print(f"  infosieve eval --run {run}     # All/Old/New from the checkpoint{test}")
    if codes:
        print(f"  infosieve tree --run {run}     # the category tree of the learned codes")
    shows = "the tree" if codes else "the cluster gallery"
    print(f"  infosieve report --run {run}   # report.html: losses, schedules, accuracy, confusion, {shows}")
    for line in own_images_steps(run_dir, shards):
        print(f"  {line}")


def own_images_steps(run: Path, shards: str | None) -> list[str]:
    """The next commands of a finished run on your own images (`shards` made by `make-shards --dataset discovery`):
    predict the pool, then name the novel clusters and export them for the next round, or, where no pool image went
    to a novel cluster, `nothing_new` in place of name and export. [] for other runs and before the final
    clustering."""
    clustering = read_clustering(run)
    if not shards or clustering is None:
        return []
    try:
        manifest = run_manifest(run, shards)
    except (FileNotFoundError, ValueError):  # shards of another tool, or a manifest that cannot be read: not ours
        return []
    if manifest["dataset"] != DISCOVERY:
        return []
    folder, pool = shlex.quote(str(run)), shlex.quote(str(Path(manifest["root"]) / "unlabelled"))
    steps = [
        f"infosieve predict --run {folder} --images {pool} --out {shlex.quote(str(run / PREDICTIONS))}   "
        "# every pool image: its cluster, name and margin"
    ]
    if not novel_pool_images(clustering):
        return [*steps, f"# {nothing_new(int(clustering['n_old']))}"]
    return [
        *steps,
        f"infosieve name --run {folder} novel-K=NAME   # name the novel clusters you recognise in the report",
        f"infosieve export --run {folder} --out NEW_FOLDER   # named clusters as labelled classes, for the next round",
    ]
