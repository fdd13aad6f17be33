"""Every command that README.md and docs/ show runs here, at smoke size, so none can rot unseen.

Commands are read from the Markdown itself: the lines of ```bash blocks (backslash continuations joined, comments
dropped) and inline code spans that call `python`, `infosieve`, `torchrun` or `bash` with arguments. Each must match
one entry of `PLAN`:
- run: the command as written, placeholders bound to what this test makes (a one-epoch demo run, a folder of real
  images, temporary output paths), the benchmarks at their own smoke sizes (INFOSIEVE_BENCH_SMOKE=1,
  benchmarks/smoke.py), `infosieve train` with one epoch, `infosieve sweep` with one epoch of 96 samples and 2 steps
  a run;
- parse: commands that need what CI cannot have (a dataset download, pretrained DINO weights, several GPUs): their
  arguments are parsed by the real command-line parser, so a renamed flag still fails;
- gpu: a CUDA command of benchmarks/tools/gpu_check.sh, whose CPU rehearsal runs here;
- ci: installing and testing, which CI itself does.
A command that matches no entry fails the test: a new documented command must say how it is checked. A ```sh block
holds a SLURM batch script: it runs as a whole, with stand-ins for `srun` and `scontrol` (`test_slurm_script_...`).

A simple `infosieve ...` or `python -m MODULE ...` command (with `NAME=value` prefixes) runs in this test's own
interpreter, one at a time (tests/in_process.py: `cli.main(argv)` or `runpy` as `__main__`, in the repository with the
command's environment, its output captured, its changes to the interpreter put back), so ~40 commands do not pay ~40
imports of torch. Any other command line (pipes, `$(...)`, `bash` scripts, `torchrun`) runs in `bash` as written.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from infosieve_fast import cli
from tests.in_process import in_process_call, run_in_process

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CALLS = (
    "python ",
    "python3 ",
    "infosieve ",
    "torchrun ",
    "bash ",
    "GPU_CHECK_COMMIT=",
    "INFOSIEVE_BENCH_SMOKE=",
    "PYTHONPATH=",
)
ONE_EPOCH = ["--set", "schedule.epochs=1", "--set", "kmeans.n_init=1"]
TWO_STEPS = ["--set", "train.max_steps_per_epoch=2"]  # the demo's trainings: a run folder to read, not a model


@dataclass(frozen=True)
class Entry:
    pattern: str  # a regex that must match the whole command
    how: str  # "run" | "parse" | "ci"
    why: str = ""


DATASETS = "(cub|scars|aircraft|pets|herbarium19|cifar10|cifar100|imagenet100|imagenet1k)"  # configs/<name>.yaml
PLAN = [
    Entry(r"python3 -m venv .*|pip install .*", "ci", "the install: CI runs the README's install command"),
    Entry(r"pytest", "ci", "the tests: CI runs them"),
    Entry(r"infosieve train --config configs/demo(-gcd|-simgcd|-selex)?\.yaml( --out \S+)?( --set \S+)*", "run"),
    Entry(r"infosieve train --resume \S+", "run"),
    Entry(
        r"infosieve estimate-k --run \S+( --rule score)? --json benchmarks/results/\S+",
        "parse",
        "rewrites a committed result; the same search runs here on the demo's run (infosieve estimate-k --run RUN)",
    ),
    Entry(r"infosieve (eval|tree|report|estimate-k) --run \S+( --depth \d+)?", "run"),
    Entry(
        r"infosieve eval --run \S+ --split test",
        "parse",
        "needs a run on shards with a test split (tests/test_eval_logging.py scores one)",
    ),
    Entry(
        r"infosieve predict --run \S+ --images /data/mine/unlabelled --out \S+",
        "parse",
        "needs a run on your own images (tests/test_discovery.py runs it on a run on real birds)",
    ),
    Entry(r"infosieve predict --run \S+ --images \S+ --out \S+", "run"),
    Entry(
        r'infosieve (name --run \S+( novel-\d+=("[^"]*"|\S+))+|export --run \S+ --out \S+)',
        "parse",
        "needs a run on your own images (tests/test_discovery_gallery.py names and exports one on real birds)",
    ),
    Entry(
        r"infosieve estimate-k --features \S+ --known-classes \d+ --rule score --json \S+",
        "parse",
        "over a minute on 2 cores; tests/test_estimate_k.py runs the same search on the same features",
    ),
    Entry(
        rf"infosieve make-shards --dataset {DATASETS} .*",
        "parse",
        "needs the dataset download "
        "(tests/test_data_splits.py and tests/test_layout_imagenet1k.py run the layouts on stand-ins)",
    ),
    Entry(
        r"infosieve make-shards --dataset discovery .*",
        "parse",
        "needs your own images (tests/test_discovery.py runs the same command on a folder of real birds it builds)",
    ),
    Entry(r"infosieve train --config configs/(dinov2-)?cub\.yaml .*", "parse", "needs CUB-200-2011 and DINO weights"),
    Entry(
        r"infosieve train --config configs/cub100-tree\.yaml --data\.shards /data/shards/mine\S* .*",
        "parse",
        "needs your own images (tests/test_discovery.py trains this config on a folder of real birds it builds)",
    ),
    Entry(r"infosieve sweep --config configs/demo(-gcd|-simgcd|-selex)?\.yaml .*", "run"),
    Entry(r"infosieve compare SWEEP RUN --out \S+ --json \S+", "run"),
    Entry(
        rf"infosieve sweep --config configs/(dinov2-)?{DATASETS}\.yaml .*",
        "parse",
        "needs the dataset and the DINO (or DINOv2) weights; tests/test_sweep.py runs sweeps on the digits",
    ),
    Entry(r"python -m benchmarks\.cub_subset( --[\w-]+ \S+)+", "run"),
    Entry(r"python -m benchmarks\.folder_features( --[\w-]+ \S+)+", "run"),
    Entry(
        r"infosieve make-shards --dataset cubfiles --root runs/\S+ .*",
        "parse",
        "reads the folder the command above it writes (tests/test_cub_subset.py reads such a folder as cubfiles, and "
        "benchmarks/bench_tree.py makes the same shards from it)",
    ),
    Entry(
        r"infosieve sweep --config configs/cub100-(tree|heldout(-gcd|-simgcd|-selex)?)\.yaml .*",
        "parse",
        "hours on 2 CPU cores (tests/test_sweep.py runs sweeps on the digits; bench_tree.py trains cub100-tree and "
        "cub100-heldout, tests/test_methods_wiring.py a short run of each method)",
    ),
    Entry(
        r"infosieve compare runs/\S+ .*",
        "parse",
        "compares the sweep of the command above it, which needs a dataset (tests/test_compare.py compares sweeps)",
    ),
    Entry(
        r"torchrun --nnodes=\d+ --node_rank=\d+ --nproc_per_node=\d+ --master_addr=\S+ --master_port=\d+ "
        r"-m infosieve_fast\.cli .*",
        "parse",
        "needs several machines (tests/test_multinode.py runs two nodes on this one)",
    ),
    Entry(
        r"torchrun --nproc_per_node=\d+ --max-restarts=\d+ -m infosieve_fast\.cli .*",
        "parse",
        "needs several GPUs (tests/test_preemption.py runs a restarted launch on two gloo ranks; the SLURM script's "
        "test below runs torchrun with one)",
    ),
    Entry(
        r"torchrun --nproc_per_node=\d+ -m infosieve_fast\.cli .*",
        "parse",
        "needs several GPUs (tests/test_engine_ddp.py runs the same path on gloo ranks)",
    ),
    Entry(
        r"python -m benchmarks\.bench_kmeans --device cuda .*",
        "gpu",
        "CUDA: benchmarks/tools/gpu_check.sh runs it, and its CPU rehearsal runs here (the gpu_check.sh entry)",
    ),
    Entry(r"python -m benchmarks\.(bench_|tools\.(check|gpu)_)\w+( .*)?", "run"),
    Entry(
        r"(GPU_CHECK_COMMIT=\$\(git rev-parse HEAD\) RESULTS_DIR=\S+ |INFOSIEVE_BENCH_SMOKE=1 )"
        r"bash benchmarks/tools/gpu_check\.sh",
        "run",
    ),
    Entry(r"python -m benchmarks\.tools\.provenance( --commit \S+)?", "run"),
    Entry(r"python -m benchmarks\.plot_methods --out docs/\S+\.png", "run"),
]


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for every command in the docs, in order of appearance."""
    found = []
    for doc in DOCS:
        prose, fenced, pending = [], None, ""
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if line.startswith("```"):
                fenced = line[3:].strip() if fenced is None else None
                prose.append("")
                continue
            prose.append(line if fenced is None else "")
            if fenced == "bash":
                text = pending + re.sub(r"\s+#.*$", "", line).strip()
                if text.endswith("\\"):
                    pending = text[:-1].strip() + " "
                elif text and not text.startswith("#"):
                    found.append((f"{doc.relative_to(ROOT)}:{number}", text))
                    pending = ""
        text = "\n".join(prose)
        for span in re.finditer(r"`([^`]+)`", text):  # a span may wrap onto the next line
            command = " ".join(span.group(1).split())
            if command.startswith(CALLS) and len(command.split()) > 2:
                found.append((f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, span.start()) + 1}", command))
    return sorted(found, key=lambda item: (item[0].split(":")[0], int(item[0].split(":")[1])))


def entry_for(command: str) -> Entry | None:
    return next((e for e in PLAN if re.fullmatch(e.pattern, command)), None)


def test_every_documented_command_has_a_plan():
    commands = documented_commands()
    assert any(c.startswith("python -m benchmarks.bench_train ") for _, c in commands)  # the reader found them
    for where, command in commands:
        entry = entry_for(command)
        assert entry, f"{where}: {command!r} is documented but matches no entry of PLAN: say how CI checks it"
        assert entry.how in {"run", "parse", "gpu", "ci"}
        assert entry.how == "run" or entry.why, f"{where}: {command!r} is not run, and its entry gives no reason"


def test_every_benchmark_script_is_run_by_a_documented_command_or_the_gpu_check():
    shown = " ".join(c for _, c in documented_commands())
    gpu_check = (ROOT / "benchmarks" / "tools" / "gpu_check.sh").read_text()
    scripts = [p for p in (ROOT / "benchmarks").rglob("*.py") if p.name.startswith(("bench_", "gpu_", "check_"))]
    modules = {p.name: ".".join(p.relative_to(ROOT).with_suffix("").parts) for p in scripts}
    missing = [n for n, m in modules.items() if not re.search(rf"-m {re.escape(m)}(\s|$)", shown + " " + gpu_check)]
    assert not missing, f"benchmarks run by no documented command and not by gpu_check.sh: {missing}"


@pytest.fixture(scope="module")
def bound(tmp_path_factory, realdata) -> dict[str, str]:
    """What the placeholders stand for: the demo run (trained by the README's first command), real images to sort,
    and fresh output paths."""
    tmp = tmp_path_factory.mktemp("documented")
    images = tmp / "images"
    images.mkdir()
    with gzip.open(realdata / "mnist_t10k" / "t10k-images-idx3-ubyte.gz") as f:
        digits = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    for i in range(12):
        Image.fromarray(digits[i]).save(images / f"{i:04d}.png")
    return {"tmp": str(tmp), "run": str(tmp / "demo-run"), "images": str(images), "realdata": str(realdata),
            "sweep": str(tmp / "sweep"), "features": str(tmp / "features")}  # fmt: skip


def bind(command: str, bound: dict[str, str], name: str) -> str:
    """The command with its placeholders and output paths replaced by `bound`'s (nothing is written in the repo)."""
    out = Path(bound["tmp"]) / name
    command = command.replace("$INFOSIEVE_REALDATA", bound["realdata"])
    command = re.sub(r"runs/demo-<timestamp>|/tmp/demo_readme|\bRUN\b(?!_)", bound["run"], command)
    command = re.sub(r"\bSWEEP\b", bound["sweep"], command)
    command = re.sub(r"NEW_IMAGES/|/tmp/mnist200(?=\s|$)", bound["images"], command)
    command = re.sub(r"--out /tmp/demo_\w+", f"--out {out}", command)
    # a features file one command writes (--out) and others read: one path for all of them, by its name
    command = re.sub(r"(?<=\s)runs/([\w.-]+\.npz)\b", lambda m: f"{bound['features']}/{m.group(1)}", command)
    command = re.sub(
        r"(?<=\s)(benchmarks/results/|docs/|runs/|/tmp/)?[\w.-]+\.(json|jsonl|csv)\b",
        lambda m: str(out / Path(m.group(0)).name),
        command,
    )
    command = re.sub(r"--plots \S+", f"--plots {out}/plots", command)
    command = re.sub(r"(?<=--out )docs/\S+\.png", lambda m: str(out / Path(m.group(0)).name), command)
    command = re.sub(r"(?<=--out )runs/\S+", str(out / "runs"), command)
    command = command.replace("$OUT", str(out)).replace("$(git rev-parse HEAD)", "smoke")
    command = re.sub(r"--commit C$", "--commit HEAD", command)
    command = command.replace("--set KEY=VALUE", "--set loss.beta=0.5")  # a search's template: its first candidate
    if "bench_tree" in command and "--out" not in command and "--diagnose" not in command:
        # the ablation's cached backbone views are shared by its commands; each bench_tree command trains its own runs
        shared = Path(bound["tmp"]) / "bench_tree_ablation"
        command += f" --out {shared if 'bench_tree_ablation' in command else out / 'runs'}"
    if command.startswith("infosieve train --config"):
        command += f" {shlex.join(ONE_EPOCH + TWO_STEPS)}" + ("" if "--out" in command else f" --out {out}/run")
    if command.startswith("infosieve sweep"):
        small = ("train.train_subset=96", "data.batch_size=32", "train.max_steps_per_epoch=2")
        command += f" {shlex.join([*ONE_EPOCH, *(a for s in small for a in ('--set', s))])}"
    return command


COMMAND_TIMEOUT_S = 300


def command_env() -> dict[str, str]:
    """What every command runs with, beside this process's environment: smoke sizes, this checkout importable, and one
    thread (smoke sizes gain nothing from a second, and an OpenMP pool that shares its cores with other work spins:
    a bench_tree command in this process took 57 s with two threads, 14 s with one, on a loaded 2-core machine)."""
    return {
        "INFOSIEVE_BENCH_SMOKE": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }


def run_shell(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    with subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:  # fmt: skip
        try:
            out, err = proc.communicate(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # this command's test fails, with what it printed; the others still run
            os.killpg(proc.pid, signal.SIGKILL)  # the shell and every process it started
            out, err = proc.communicate()
            err += f"\ntimed out after {COMMAND_TIMEOUT_S} s"
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _documented(how: str) -> list[tuple[str, str]]:
    return [(w, c) for w, c in documented_commands() if getattr(entry_for(c), "how", None) == how]


def _unique(commands: list[tuple[str, str]]) -> list[tuple[str, str]]:
    seen, out = set(), []
    for where, command in commands:
        key = re.sub(r"--out /tmp/demo_\w+|--json \S+|--out \S+\.json", "", command).strip()
        key = re.sub(r"^(\w+=(\$\([^)]*\)|\S+)\s+)+", "", key)  # the environment a command is shown with
        if key not in seen:
            seen.add(key)
            out.append((where, command))
    return out


def runs_in_bash(command: str) -> bool:
    """Whether the documented `command`, once bound, runs in bash rather than in this process."""
    placeholders = dict.fromkeys(("tmp", "run", "images", "realdata", "sweep", "features"), "/x")
    return in_process_call(bind(command, placeholders, "x")) is None


DEMO_TRAIN = "infosieve train --config configs/demo.yaml"
# in the docs' order, those that run in bash last: they run in the background meanwhile (`outcomes`)
RUN_COMMANDS = sorted(_unique(_documented("run")), key=lambda item: runs_in_bash(item[1]))


@pytest.fixture(scope="module")
def bound_commands(bound) -> dict[tuple[str, str], str]:
    """Every documented command to run, bound (`bind`); the README's demo training writes RUN."""
    demo = next(key for key in RUN_COMMANDS if key[1] == DEMO_TRAIN)
    return {(w, c): bind(f"{DEMO_TRAIN} --out /tmp/demo_readme" if (w, c) == demo else c, bound, re.sub(r"\W", "_", w))
            for w, c in RUN_COMMANDS}  # fmt: skip


def writers_read_by(command: str, commands: list[str], bound: dict[str, str]) -> list[str]:
    """The commands that write the folders and feature files `command` reads (RUN, SWEEP, runs/*.npz; `compare SWEEP
    RUN` reads both folders), in the docs' order: they run first."""
    read = [bound[f] for f in ("run", "sweep") if bound[f] in command]
    features = re.findall(rf"{re.escape(bound['features'])}/\S+\.npz", command)
    read += [path for path in features if f"--out {path}" not in command]
    return [c for c in commands if c != command and any(re.search(rf"--out {re.escape(f)}(\s|$)", c) for f in read)]


@pytest.fixture(scope="module")
def outcomes(bound, bound_commands, request) -> dict[str, subprocess.CompletedProcess | Future]:
    """The outcome of every bound command started so far: a command that reads the same once bound (the docs show
    `eval --run RUN` more than once) runs once. The commands of this session's selection (`-k` picks some) that run in
    bash and read no other command's output start at once, one after another on a thread of their own: they take the
    second core while the others run in this process."""
    selected = {
        (item.callspec.params["where"], item.callspec.params["command"])
        for item in request.session.items
        if item.originalname == "test_documented_command_runs_at_smoke_size"
    }
    everything = list(bound_commands.values())
    in_bash = [c for key, c in bound_commands.items() if key in selected and in_process_call(c) is None
               and not writers_read_by(c, everything, bound)]  # fmt: skip
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield {c: pool.submit(run_shell, c, {**os.environ, **command_env()}) for c in dict.fromkeys(in_bash)}


@pytest.fixture
def run_once(outcomes, monkeypatch, capfd):
    """`run_once(command)`: its outcome, running it first where it has not run. A simple command runs in this
    interpreter (tests/in_process.py) with its output captured by capfd; any other in bash."""

    def run(command: str) -> subprocess.CompletedProcess:
        if command not in outcomes:
            call = in_process_call(command)
            if call is None:
                outcomes[command] = run_shell(command, {**os.environ, **command_env()})
            else:
                capfd.readouterr()  # what came before is not this command's
                status = run_in_process(call, ROOT, command_env(), COMMAND_TIMEOUT_S, monkeypatch)
                outcomes[command] = subprocess.CompletedProcess(command, status, *capfd.readouterr())
        done = outcomes[command]
        return done.result() if isinstance(done, Future) else done

    return run


@pytest.mark.parametrize(("where", "command"), RUN_COMMANDS, ids=lambda x: x if ":" in x else "")
def test_documented_command_runs_at_smoke_size(where, command, bound, bound_commands, run_once):
    bound_command = bound_commands[where, command]
    for writer in writers_read_by(bound_command, list(bound_commands.values()), bound):
        done = run_once(writer)
        assert done.returncode == 0, f"{where}: {command}\nreads what `{writer}` writes; it exited {done.returncode}"
    done = run_once(bound_command)
    assert done.returncode == 0, (
        f"{where}: {command}\nran as: {bound_command}\nexit {done.returncode}\n{done.stdout[-3000:]}\n"
        f"{done.stderr[-3000:]}"
    )


@pytest.mark.parametrize(("where", "command"), _documented("parse"), ids=lambda x: x if ":" in x else "")
def test_documented_command_parses(where, command):
    argv = shlex.split(command)
    argv = argv[argv.index("infosieve_fast.cli") + 1 :] if argv[0] == "torchrun" else argv[1:]
    cli.build_parser().parse_args(argv)  # exits (SystemExit) on an unknown flag or a missing argument


def batch_scripts() -> list[tuple[str, str]]:
    """(where, text) of every ```sh block of the docs (SLURM batch scripts)."""
    found = []
    for doc in DOCS:
        block, start = None, 0
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if line.startswith("```"):
                if block is not None:
                    found.append((f"{doc.relative_to(ROOT)}:{start}", "\n".join(block) + "\n"))
                    block = None
                elif line[3:].strip() == "sh":
                    block, start = [], number
            elif block is not None:
                block.append(line)
    return found


# One task: the command itself, in the background; with STAND_IN_SIGNAL, SLURM's --signal once the run folder opened
# (torchrun passes it on); `scontrol` records what it was asked.
STAND_INS = """
srun() {
    "$@" &
    local pid=$!
    if [ -n "$STAND_IN_SIGNAL" ]; then
        until [ -f "$RUN/config.yaml" ]; do sleep 0.2; done
        kill -s "$STAND_IN_SIGNAL" "$pid"
    fi
    wait "$pid"
}
scontrol() { echo "$*" >> "$STAND_IN_LOG"; }
SLURM_JOB_ID=7
"""


def bind_batch_script(text: str, run: Path) -> str:
    """The script at smoke size: one process on the CPU, the demo's digits for one epoch, `RUN` in `run`."""
    text = re.sub(r"\s*\\\n\s*", " ", text)
    assert re.search(r"^#SBATCH --signal=USR1@\d+$", text, re.M) and re.search(r"^#SBATCH --requeue$", text, re.M)
    text = re.sub(r"^RUN=\S+$", f"RUN={run}", text, flags=re.M)
    text = re.sub(r"--nproc_per_node=\d+", "--nproc_per_node=1", text)
    smoke = shlex.join([*ONE_EPOCH, *TWO_STEPS, "--set", "train.device=cpu"])
    bound, n = re.subn(r"--config configs/\S+\.yaml --data\.shards \S+ --set model\.pretrained=\S+",
                       f"--config configs/demo.yaml {smoke}", text)  # fmt: skip
    assert n == 1, f"the batch script's training command changed: bind it here\n{text}"
    return STAND_INS + bound


@pytest.mark.parametrize(("where", "script"), batch_scripts(), ids=lambda x: x if ":" in x else "")
def test_slurm_script_stops_on_its_signal_requeues_and_resumes(where, script, tmp_path):
    run, requeues = tmp_path / "run", tmp_path / "scontrol.log"
    bound = bind_batch_script(script, run)
    env = {**os.environ, **command_env(), "STAND_IN_LOG": str(requeues), "STAND_IN_SIGNAL": "USR1"}
    first = run_shell(bound, env)  # the time limit's signal: the run stops and the job queues itself again
    assert first.returncode == 0, f"{where}\n{first.stdout[-3000:]}\n{first.stderr[-3000:]}"
    assert requeues.read_text() == "requeue 7\n", first.stderr[-3000:]
    stop = json.loads((run / "log.jsonl").read_text().splitlines()[-1])
    assert stop["preempted"]["signal"] == "SIGUSR1" and not (run / "metrics.json").exists()
    env.pop("STAND_IN_SIGNAL")
    second = run_shell(bound, env)  # the requeued job: resumes where the first stopped, to the end
    assert second.returncode == 0, f"{where}\n{second.stdout[-3000:]}\n{second.stderr[-3000:]}"
    assert f"resuming {run} at epoch 1/1" in second.stdout and (run / "metrics.json").is_file()
    assert requeues.read_text() == "requeue 7\n"  # no second requeue
