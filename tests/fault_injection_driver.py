"""Kill a short demo training with SIGKILL at seeded random moments, resume it each time, and run it once untouched.

    python tests/fault_injection_driver.py WORKDIR SEED KILLS [signals]   (from the repository root)

Used by tests/test_fault_injection.py, which compares WORKDIR/killed with WORKDIR/reference. No test hook lives in the
package: the driver imports it once (and never computes with torch itself), then runs every attempt in a forked child,
a fresh process from that point on, which patches one function to kill itself with SIGKILL at that function's n-th
call in the attempt and then runs `cli.main(["train", ...])` exactly as the command line does (`--config ... --out`
the first time, `--resume` after). The moments:

- mid-step: inside a training step, after the forward pass and the loss, before backward and the optimizer step;
- mid-checkpoint-write: half of checkpoint.pt's bytes written to its temporary file;
- mid-log-append: half of a log.jsonl line written (fsynced);
- kmeans: inside SS-k-means, at its first centre update (a per-epoch round, or the before/after evaluation's);
- feature-pass: in a feature pass (the per-epoch one, or the before/after evaluation's);
- after-log: between an epoch's log line and its checkpoint;
- after-checkpoint: right after a checkpoint (before the next epoch starts);
- mid-metrics-write: half of metrics.json written to its temporary file.

The first four attempts take the first four kinds in a seeded order, each at a moment during the epochs (so that every
kind finds training left to interrupt); the rest draw any kind and any call. WORKDIR/attempts.json lists them.

With `signals`, a smaller run (2 epochs of 4 steps) is stopped by signals instead: SIGTERM and SIGUSR1 (in a seeded
order) each at a random step that leaves the run mid-epoch, then SIGTERM in a random k-means round, then any:
- sigterm, sigusr1: the signal, sent by the process to itself right after a training step's update (the run stops
  before the next step, mid-epoch, or after the epoch when it was the epoch's last step);
- sigterm-kmeans: SIGTERM inside an SS-k-means round of an epoch (or of the evaluation before training): the round
  and the pass finish and the run stops before the epoch's first step.
Each such attempt must exit with the preempted status (`preemption.PREEMPTED_EXIT`), having logged the stop.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import sys
from pathlib import Path

from infosieve_fast.common import files

REQUIRED = ["mid-step", "mid-checkpoint-write", "mid-log-append", "kmeans"]
OTHERS = ["feature-pass", "after-log", "after-checkpoint", "mid-metrics-write"]
SIGNAL_KINDS = ["sigterm", "sigusr1", "sigterm-kmeans"]
EPOCHS, STEPS = 3, 3  # the run below: 192 samples in batches of 64
SMALL = ["train.train_subset=64", "data.batch_size=16"]  # the signal runs: 2 epochs of 4 steps (set by `main`)
OVERRIDES = [
    f"schedule.epochs={EPOCHS}",
    "train.train_subset=192",
    "data.batch_size=64",
    "kmeans.n_init=2",
    "model.proj_out_dim=256",
    "model.proj_hidden_dim=128",
    "model.proj_bottleneck_dim=64",
    "train.device=cpu",
]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def signal_calls(kind: str, position: dict | None) -> int:
    """How many training steps (sigterm, sigusr1) or per-epoch and before-training k-means rounds (sigterm-kmeans) an
    attempt starting from checkpoint `position` ({"epoch", "step", "mid_epoch"}; None: no checkpoint) runs."""
    at = position or {"epoch": 0, "step": 0, "mid_epoch": False}
    epoch, step, mid = at["epoch"], at["step"], at["mid_epoch"]
    if kind in ("sigterm", "sigusr1"):
        return STEPS * (EPOCHS - epoch) - step
    return EPOCHS - epoch - mid + (position is None)  # a mid-epoch resume skips its epoch's round


def calls(kind: str, epoch: int | None, during_training: bool) -> int:
    """How many calls of `kind`'s function an attempt starting from checkpoint `epoch` (None: no checkpoint) makes;
    `during_training`: only those before the last epoch's checkpoint."""
    fresh = epoch is None
    left = EPOCHS - (epoch or 0)
    if kind in ("mid-step",):
        return STEPS * left
    if kind in ("mid-log-append", "after-log"):
        return left
    if kind in ("mid-checkpoint-write", "after-checkpoint"):
        return left if during_training else left + 1  # + the save after the final evaluation
    if kind in ("kmeans", "feature-pass"):
        return left + fresh if during_training else left + fresh + 1  # + the final evaluation's
    if kind == "mid-metrics-write":
        return 0 if during_training else 1
    raise ValueError(kind)


def training_kmeans(replacement) -> None:
    """Make the training's SS-k-means rounds (the per-epoch ones and the evaluations') call `replacement`: the name
    `semi_supervised_kmeans` in each loaded module of the package that imported it (engine.py, or a module the rounds
    moved to)."""
    from infosieve_fast import kmeans

    # k-means itself; K's estimate is no training round
    own = ("infosieve_fast.kmeans", "infosieve_fast.evaluation.estimate_k")
    patched = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("infosieve_fast.") and name not in own
        and getattr(module, "semi_supervised_kmeans", None) is kmeans.semi_supervised_kmeans
    ]  # fmt: skip
    assert patched, "no module of the package holds semi_supervised_kmeans: the driver cannot reach k-means"
    for module in patched:
        module.semi_supervised_kmeans = replacement


def patch(kind: str, n: int) -> None:
    """In the child: make the n-th call of `kind`'s function kill the process."""
    import torch

    from infosieve_fast import kmeans
    from infosieve_fast.kmeans import restarts as kmeans_restarts
    from infosieve_fast.network import model
    from infosieve_fast.training import checkpoint, loss_monitor

    count = [0]

    def hit() -> bool:
        count[0] += 1
        return count[0] == n

    if kind in ("sigterm", "sigusr1"):
        record, sig = loss_monitor.LossMonitor.record, signal.SIGTERM if kind == "sigterm" else signal.SIGUSR1

        def signalling(self, parts):
            record(self, parts)
            if hit():
                os.kill(os.getpid(), sig)

        loss_monitor.LossMonitor.record = signalling
    elif kind == "sigterm-kmeans":
        update = kmeans_restarts._update_centers
        rounds, signalled = kmeans.semi_supervised_kmeans, [False]

        def round_(*args, **kwargs):
            if len(args) > 1 and args[1] is not None and hit():  # a round with labelled samples: an epoch's or before
                signalled[0] = True
            return rounds(*args, **kwargs)

        def updating(*args, **kwargs):
            if signalled[0]:
                signalled[0] = False
                os.kill(os.getpid(), signal.SIGTERM)
            return update(*args, **kwargs)

        training_kmeans(round_)
        kmeans_restarts._update_centers = updating
    elif kind == "mid-step":
        record = loss_monitor.LossMonitor.record

        def recording(self, parts):
            record(self, parts)
            if hit():
                die()

        loss_monitor.LossMonitor.record = recording
    elif kind == "mid-checkpoint-write":
        save = torch.save

        def half_save(obj, f, *args, **kwargs):
            if not hit():
                return save(obj, f, *args, **kwargs)
            buf = io.BytesIO()
            save(obj, buf, *args, **kwargs)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            os.fsync(f.fileno())
            die()

        torch.save = half_save
    elif kind in ("mid-log-append", "after-log"):
        append = files.append_log

        def appending(path, record):
            if Path(path).name != "log.jsonl" or not hit():
                return append(path, record)
            if kind == "after-log":
                append(path, record)
            else:
                line = json.dumps(record) + "\n"
                with open(path, "a") as f:
                    f.write(line[: len(line) // 2])
                    f.flush()
                    os.fsync(f.fileno())
            die()

        files.append_log = appending
    elif kind == "after-checkpoint":
        save_checkpoint = checkpoint.save_checkpoint

        def saving(run_dir, state):
            save_checkpoint(run_dir, state)
            if hit():
                die()

        checkpoint.save_checkpoint = saving
    elif kind == "kmeans":
        ss_kmeans, update = kmeans.semi_supervised_kmeans, kmeans_restarts._update_centers
        armed = [False]

        def clustering(*args, **kwargs):
            armed[0] = hit()
            return ss_kmeans(*args, **kwargs)

        def updating(*args, **kwargs):
            if armed[0]:
                die()
            return update(*args, **kwargs)

        training_kmeans(clustering)
        kmeans_restarts._update_centers = updating
    elif kind == "feature-pass":
        features = model.InfoSieve.features

        def featuring(self, images):
            out = features(self, images)
            if hit():
                die()
            return out

        model.InfoSieve.features = featuring
    elif kind == "mid-metrics-write":
        write_json = files.write_json

        def writing(path, data):
            if Path(path).name != "metrics.json":
                return write_json(path, data)
            text = (json.dumps(data, indent=2) + "\n").encode()
            files.atomic_write(Path(path), lambda f: (f.write(text[: len(text) // 2]), f.flush(), die()))

        files.write_json = writing
    else:
        raise ValueError(kind)


def fork(target, log: Path) -> int:
    """Run `target()` in a forked child (stdout/stderr to `log`); its wait status."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = target()
        except SystemExit as stop:  # the command line's exit with a status (a preempted run's)
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return os.waitpid(pid, 0)[1]


def checkpoint_epoch(run: Path, log: Path) -> int | None:
    """The epoch the run's checkpoint would resume at (None: no checkpoint), read in a child (the driver computes
    nothing with torch)."""

    def read() -> int:
        from infosieve_fast.training.checkpoint import load_checkpoint

        return load_checkpoint(run)["epoch"] if (run / "checkpoint.pt").is_file() else 255

    status = fork(read, log)
    assert os.WIFEXITED(status), f"reading the checkpoint failed: see {log}"
    epoch = os.WEXITSTATUS(status)
    return None if epoch == 255 else epoch


def checkpoint_position(run: Path, log: Path) -> dict | None:
    """{"epoch", "step", "mid_epoch"} of the run's checkpoint (None: no checkpoint), read in a child."""
    out = log.with_suffix(".json")

    def read() -> int:
        from infosieve_fast.training.checkpoint import load_checkpoint

        state = load_checkpoint(run) if (run / "checkpoint.pt").is_file() else None
        mid = None if state is None else state.get("mid_epoch")
        position = None if state is None else {"epoch": state["epoch"], "step": mid["step"] if mid else 0}
        out.write_text(json.dumps(position and {**position, "mid_epoch": mid is not None}))
        return 0

    status = fork(read, log)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"reading the checkpoint failed: see {log}"
    return json.loads(out.read_text())


def signal_attempts(work: Path, rng: random.Random, count: int) -> list[dict]:
    """`count` attempts each stopped by a drawn signal kind at a drawn moment; each must exit preempted, with the
    stop's record last in log.jsonl and its one-line note on stderr."""
    from infosieve_fast import cli
    from infosieve_fast.training.preemption import PREEMPTED_EXIT

    run, attempts = work / "killed", []
    # the first two stop once each mid-epoch, past the epoch's first step; the third in an epoch's k-means
    first = [*rng.sample(["sigterm", "sigusr1"], 2), "sigterm-kmeans"]
    for i in range(count):
        position = checkpoint_position(run, work / f"position-{i}.out")
        kinds = [k for k in SIGNAL_KINDS if signal_calls(k, position) > 0]
        if not kinds:  # stopped after the last epoch: only the final evaluation is left
            break
        kind = first[i] if i < len(first) and first[i] in kinds else rng.choice(kinds)
        done = 0 if position is None else position["epoch"] * STEPS + position["step"]
        moments = [n for n in range(1, signal_calls(kind, position) + 1) if i >= 2 or (done + n) % STEPS]
        n, argv = rng.choice(moments), train_argv(run)

        def attempt(kind=kind, n=n, argv=argv) -> int:
            patch(kind, n)
            return cli.main(argv)

        out = work / f"attempt-{i}.out"
        status = fork(attempt, out)
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
        attempts.append({"kind": kind, "call": n, "position": position, "command": argv[1], "exit": code})
        assert code == PREEMPTED_EXIT, f"attempt {i} ({kind}, call {n}) exited {status}: see {out}"
        last = json.loads((run / "log.jsonl").read_text().splitlines()[-1])
        expected = "SIGUSR1" if kind == "sigusr1" else "SIGTERM"
        assert last["preempted"]["signal"] == expected, f"attempt {i}: log.jsonl ends with {last}"
        notes = [line for line in out.read_text().splitlines() if line.startswith("preempted: ")]
        assert len(notes) == 1 and expected in notes[0], f"attempt {i}: no one-line note in {out}"
    return attempts


def train_argv(run: Path) -> list[str]:
    if (run / "config.yaml").is_file():
        return ["train", "--resume", str(run)]
    return ["train", "--config", "configs/demo.yaml", "--out", str(run), *(a for o in OVERRIDES for a in ("--set", o))]


def main(workdir: str, seed: str, kills: str, mode: str = "kills") -> int:
    global EPOCHS, STEPS
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from infosieve_fast import cli
    from infosieve_fast.training import engine, run_folder  # noqa: F401  (imported once, before any fork)

    if mode == "signals":
        EPOCHS, STEPS = 2, 4
        OVERRIDES[:3] = [f"schedule.epochs={EPOCHS}", *SMALL]
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    status = fork(lambda: cli.main(train_argv(work / "reference")), work / "reference.out")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the reference run failed: see {work}/reference.out"

    rng = random.Random(int(seed))
    if mode == "signals":
        attempts = signal_attempts(work, rng, int(kills))
        return final_resume(work, attempts, work / "killed")
    kinds = rng.sample(REQUIRED, len(REQUIRED)) + [rng.choice(REQUIRED + OTHERS) for _ in range(int(kills) - 4)]
    run, attempts = work / "killed", []
    for i, kind in enumerate(kinds):
        epoch = checkpoint_epoch(run, work / f"epoch-{i}.out")
        during = i < len(REQUIRED)
        if calls(kind, epoch, during) == 0:  # nothing of this kind left in the run: another kind
            kind = rng.choice([k for k in REQUIRED + OTHERS if calls(k, epoch, during) > 0])
        n = rng.randint(1, calls(kind, epoch, during))
        argv = train_argv(run)

        def attempt(kind=kind, n=n, argv=argv) -> int:
            patch(kind, n)
            return cli.main(argv)

        status = fork(attempt, work / f"attempt-{i}.out")
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        attempts.append({"kind": kind, "call": n, "checkpoint_epoch": epoch, "command": argv[1], "killed": killed})
        assert killed, f"attempt {i} ({kind}, call {n}) was not killed (status {status}): see {work}/attempt-{i}.out"
    return final_resume(work, attempts, run)


def final_resume(work: Path, attempts: list[dict], run: Path) -> int:
    """The last `--resume`, untouched, to the end; then WORKDIR/attempts.json."""
    from infosieve_fast import cli

    epoch = checkpoint_epoch(run, work / "epoch-final.out")
    status = fork(lambda: cli.main(train_argv(run)), work / "final.out")
    exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
    attempts.append({"kind": None, "checkpoint_epoch": epoch, "command": "--resume", "exit": exit_code})
    (work / "attempts.json").write_text(json.dumps(attempts, indent=1) + "\n")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the last resume failed: see {work}/final.out"
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
