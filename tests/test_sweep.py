"""`infosieve sweep` (issue 22, item 1): seeds and grids parsed and planned, every run an ordinary run folder, a killed
sweep continued to the summary an uninterrupted one writes, another command refused, runs on devices in their own
processes, and a summary whose means and spreads equal those computed here from the runs' own files."""

import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from infosieve_fast import cli
from infosieve_fast.commands import sweep
from infosieve_fast.common.files import read_log
from infosieve_fast.config.settings import ConfigError, load_config
from infosieve_fast.evaluation.metrics import evaluate_split
from infosieve_fast.training import peak_memory as memory
from infosieve_fast.training import run_folder
from infosieve_fast.training.checkpoint import load_checkpoint
from infosieve_fast.training.preemption import PREEMPTED_EXIT, Preempted

SMALL = ["schedule.epochs=2", "train.train_subset=96", "data.batch_size=32", "train.max_steps_per_epoch=2",
         "kmeans.n_init=1", "model.proj_out_dim=256", "model.proj_hidden_dim=128", "model.proj_bottleneck_dim=64",
         "train.device=cpu"]  # fmt: skip
GRID = "loss.label_smoothing=0.1,0.5"
SEEDS = "1-2"


def sweep_argv(out, seeds=SEEDS, grid=GRID, extra=()):
    sets = [a for s in [*SMALL, *extra] for a in ("--set", s)]
    return ["sweep", "--config", "configs/demo.yaml", "--seeds", seeds, "--grid", grid, *sets, "--out", str(out)]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """A sweep run without interruption: 2 grid points x 2 seeds of a 2-epoch digits run."""
    out = tmp_path_factory.mktemp("sweep") / "whole"
    assert cli.main(sweep_argv(out)) == 0
    return out


# ------------------------------------------------------------------------------------------------ the plan
def test_seeds_take_ranges_and_lists():
    assert sweep.parse_seeds("1-5") == [1, 2, 3, 4, 5]
    assert sweep.parse_seeds("1,3,7") == [1, 3, 7]
    assert sweep.parse_seeds("0-2, 9") == [0, 1, 2, 9]
    for bad, why in (("3-1", "not a seed or a range"), ("a", "not a seed or a range"), ("1,,2", "not a seed"),
                     ("-1", "not a seed"), ("1-3,2", r"seed\(s\) \[2\] twice")):  # fmt: skip
        with pytest.raises(sweep.SweepError, match=why):
            sweep.parse_seeds(bad)


def test_grid_values_and_their_errors():
    assert sweep.parse_grid(["loss.beta=0.5,1", "data.mean=[0.1],[0.2]"], []) == {
        "loss.beta": ["0.5", "1"], "data.mean": ["[0.1]", "[0.2]"]}  # fmt: skip
    assert sweep.split_values("[1, 2],{a: 1, b: 2}, x") == ["[1, 2]", "{a: 1, b: 2}", "x"]
    for items, sets, why in ((["loss.beta"], [], "must look like KEY=V1,V2"), (["loss.beta=1,"], [], "KEY=V1,V2"),
                             (["train.seed=1,2"], [], "the seed is the sweep's --seeds"),
                             (["loss.beta=1", "loss.beta=2"], [], "named twice"),
                             (["loss.beta=1,2"], ["loss.beta=3"], "named twice"),
                             (["loss.beta=1,1"], [], "repeats a value")):  # fmt: skip
        with pytest.raises(sweep.SweepError, match=why):
            sweep.parse_grid(items, sets)


def test_the_plan_holds_every_combination_with_its_seed():
    grid = {"loss.beta": ["0.5", "1"], "optim.lr": ["0.01", "0.1"]}
    plan = sweep.make_plan("configs/demo.yaml", [4, 7], grid, SMALL)
    assert [r["name"] for r in plan["runs"]] == [
        f"loss.beta={b},optim.lr={lr}-seed{s}" for b in ("0.5", "1") for lr in ("0.01", "0.1") for s in (4, 7)
    ]
    for run in plan["runs"]:
        cfg = sweep.run_config(plan, run)
        assert cfg.train.seed == run["seed"] and cfg.schedule.epochs == 2  # the --set values hold in every run
        assert (cfg.loss.beta, cfg.optim.lr) == (float(run["point"]["loss.beta"]), float(run["point"]["optim.lr"]))
        assert cfg == load_config("configs/demo.yaml", [*SMALL, *(f"{k}={v}" for k, v in run["point"].items()),
                                                        f"train.seed={run['seed']}"])  # fmt: skip
    assert sweep.make_plan("configs/demo.yaml", [1], {}, [])["runs"] == [{"name": "seed1", "point": {}, "seed": 1}]
    with pytest.raises(ConfigError, match="loss.beta must be >= 0"):  # every run's config is checked before any runs
        sweep.make_plan("configs/demo.yaml", [1], {"loss.beta": ["1", "-1"]}, [])
    with pytest.raises(sweep.SweepError, match="--set train.seed"):
        sweep.make_plan("configs/demo.yaml", [1], {}, ["train.seed=3"])


# ------------------------------------------------------------------------------------------------ the summary
def independent_spread(values):
    return statistics.mean(values), statistics.stdev(values), min(values), max(values)


def test_the_summary_is_the_runs_statistics(whole):
    summary = check_summary_is_the_runs_statistics(whole, seeds=2)
    assert [p["label"] for p in summary["points"]] == ["loss.label_smoothing=0.1", "loss.label_smoothing=0.5"]


def check_summary_is_the_runs_statistics(sweep_dir: Path, seeds: int) -> dict:
    """summary.json and summary.md of a finished sweep against statistics computed here from each run's own files
    (metrics.json, clustering.npz, tree.json, log.jsonl); returns the summary."""
    plan = json.loads((sweep_dir / "sweep.json").read_text())
    summary = json.loads((sweep_dir / "summary.json").read_text())
    markdown = (sweep_dir / "summary.md").read_text()
    assert "sample standard deviation (n − 1 in the denominator)" in markdown
    for point in summary["points"]:
        runs = [sweep_dir / "runs" / r["name"] for r in plan["runs"] if r["point"] == point["point"]]
        assert len(runs) == seeds and point["finished"] == point["planned"] == seeds and point["missing"] == []
        metrics = [json.loads((r / "metrics.json").read_text()) for r in runs]
        assert {m["protocol"] for m in metrics} == {"v2"}
        for part in ("all", "old", "new"):  # v2: the runs' metrics.json, by the statistics module
            mean, sd, low, high = independent_spread([m["after"][part] for m in metrics])
            s = point["accuracy"]["v2"][part]
            assert (s["mean"], s["sd"], s["min"], s["max"], s["n"]) == pytest.approx((mean, sd, low, high, seeds))
            if part == "all":
                cell = f"{mean:.4f} ± {sd:.4f} [{low:.4f}, {high:.4f}]"
                assert f"| {point['label']} | {seeds}/{seeds} | {cell} |" in markdown
        for protocol in ("v1", "v2b"):  # the same final clustering under the other protocols
            scores = []
            for r in runs:
                with np.load(r / "clustering.npz") as z:
                    scores.append(evaluate_split(z["targets"], z["preds"], z["targets"] < int(z["n_old"]), protocol))
            for part in ("all", "old", "new"):
                mean, sd, low, high = independent_spread([x[part] for x in scores])
                s = point["accuracy"][protocol][part]
                assert (s["mean"], s["sd"], s["min"], s["max"]) == pytest.approx((mean, sd, low, high))
        trees = [json.loads((r / "tree.json").read_text())["measures"] for r in runs]
        for key in ("all", "purity_8", "nmi_8", "mean_length"):
            assert point["codes"][key]["mean"] == pytest.approx(statistics.mean(t[key] for t in trees))
            assert point["codes"][key]["sd"] == pytest.approx(statistics.stdev(t[key] for t in trees))
        logs = [read_log(r / "log.jsonl") for r in runs]
        assert all(rec["peak_rss_bytes"] > 0 for log in logs for rec in log)  # recorded per epoch on the CPU
        per_run = [statistics.mean(rec["seconds"] for rec in log) for log in logs]
        assert point["seconds_per_epoch"]["mean"] == pytest.approx(statistics.mean(per_run))
        peaks = [max(rec["peak_rss_bytes"] for rec in log) / 2**20 for log in logs]
        assert point["peak_memory_mib"]["max"] == pytest.approx(max(peaks))
        assert point["peak_memory_kind"] == "host peak resident set"
    return summary


def test_every_run_is_an_ordinary_run_folder(whole, capsys):
    run = whole / "runs" / "loss.label_smoothing=0.5-seed2"
    cfg = load_config(run / "config.yaml")
    assert cfg == load_config("configs/demo.yaml", [*SMALL, "loss.label_smoothing=0.5", "train.seed=2"])
    assert load_checkpoint(run)["epoch"] == 2
    assert cli.main(["train", "--resume", str(run)]) == 0  # as `infosieve train` left it: finished, nothing reruns
    assert "already finished its 2 epochs" in capsys.readouterr().out


def test_a_run_whose_tree_is_stale_is_measured_again(whole, tmp_path):
    """A run trained on after its tree.json was written (its tree records an older checkpoint) is not done: the sweep
    measures its codes again rather than summarising the old ones."""
    sweep_dir = tmp_path / "copy"
    shutil.copytree(whole, sweep_dir)
    run = json.loads((sweep_dir / "sweep.json").read_text())["runs"][0]
    tree_path = sweep.run_dir(sweep_dir, run) / "tree.json"
    fresh = json.loads(tree_path.read_text())
    assert sweep.is_done(sweep_dir, run) and fresh["checkpoint"] == "last, epoch 2"
    tree_path.write_text(json.dumps(fresh | {"checkpoint": "last, epoch 1", "measures": {}}))
    assert not sweep.is_done(sweep_dir, run)
    sweep.run_one(sweep_dir, json.loads((sweep_dir / "sweep.json").read_text()), run)
    assert json.loads(tree_path.read_text()) == fresh and sweep.is_done(sweep_dir, run)


def strip_machine_numbers(summary: dict) -> dict:
    """The summary without what differs between two machines' or two sittings' runs of one plan: the folder, the
    seconds per epoch and the peak memory."""
    points = [{k: v for k, v in p.items() if k not in ("seconds_per_epoch", "peak_memory_mib")}
              for p in summary["points"]]  # fmt: skip
    return {**{k: v for k, v in summary.items() if k not in ("sweep", "command")}, "points": points}


def test_a_killed_sweep_continues_to_the_uninterrupted_summary(whole, tmp_path, monkeypatch, capsys):
    out = tmp_path / "killed"
    original = run_folder.train
    calls = []

    def killed_in_its_second_run(cfg, folder, **kwargs):
        calls.append(folder.name)
        if len(calls) == 1:
            return original(cfg, folder, **kwargs)
        original(cfg, folder, stop_after=lambda epoch: epoch == 0, **kwargs)  # one epoch checkpointed
        raise KeyboardInterrupt  # then the kill

    monkeypatch.setattr(run_folder, "train", killed_in_its_second_run)
    with pytest.raises(SystemExit) as stop:
        cli.main(sweep_argv(out))
    assert stop.value.code == 130
    err = capsys.readouterr().err
    assert f"continue with `infosieve sweep --config {Path('configs/demo.yaml').resolve()} --seeds 1,2" in err
    first, second = (out / "runs" / name for name in calls)
    assert (first / "metrics.json").is_file() and (first / "tree.json").is_file()
    assert load_checkpoint(second)["epoch"] == 1 and not (second / "metrics.json").exists()
    partial = json.loads((out / "summary.json").read_text())  # written after every finished run
    assert [p["finished"] for p in partial["points"]] == [1, 0]

    resumed = []

    def recorded(cfg, folder, **kwargs):
        resumed.append(folder.name)
        return original(cfg, folder, **kwargs)

    monkeypatch.setattr(run_folder, "train", recorded)
    assert cli.main(sweep_argv(out)) == 0
    text = capsys.readouterr().out
    assert "4 runs, 1 finished, 3 to go" in text and f"resuming {second} at epoch 2/2" in text
    assert first.name not in resumed and resumed[0] == second.name  # the finished run is not trained again
    for run in json.loads((out / "sweep.json").read_text())["runs"]:  # bit-identical runs
        assert (out / "runs" / run["name"] / "metrics.json").read_bytes() == (
            whole / "runs" / run["name"] / "metrics.json"
        ).read_bytes()
    continued = json.loads((out / "summary.json").read_text())
    assert strip_machine_numbers(continued) == strip_machine_numbers(json.loads((whole / "summary.json").read_text()))

    assert cli.main(sweep_argv(out)) == 0  # once more: nothing left to run
    assert "4 runs, 4 finished, 0 to go" in capsys.readouterr().out


def test_a_preempted_sweep_exits_preempted_and_goes_on_to_the_same_runs(whole, tmp_path, monkeypatch, capsys):
    out = tmp_path / "preempted"
    argv = sweep_argv(out, seeds="1", grid="loss.label_smoothing=0.1,0.5")
    original, calls = run_folder.train, []

    def sigterm_in_its_second_run(cfg, folder, **kwargs):
        calls.append(folder.name)
        if len(calls) == 2:  # the scheduler's signal after the first epoch's checkpoint
            kwargs["stop_after"] = lambda epoch: os.kill(os.getpid(), signal.SIGTERM) and False
        return original(cfg, folder, **kwargs)

    monkeypatch.setattr(run_folder, "train", sigterm_in_its_second_run)
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == PREEMPTED_EXIT
    err = capsys.readouterr().err
    assert "preempted: SIGTERM: stopped at the start of epoch 2/2" in err
    assert f"continue the sweep with `infosieve sweep --config {Path('configs/demo.yaml').resolve()}" in err
    second = out / "runs" / calls[1]
    assert read_log(second / "log.jsonl")[-1]["preempted"]["signal"] == "SIGTERM"
    assert load_checkpoint(second)["epoch"] == 1 and not (second / "metrics.json").exists()

    monkeypatch.setattr(run_folder, "train", original)
    assert cli.main(argv) == 0
    for name in calls:  # the preempted run continued to the numbers of the sweep that was never stopped
        want = (whole / "runs" / name / "metrics.json").read_bytes()
        assert (out / "runs" / name / "metrics.json").read_bytes() == want


def test_a_command_that_differs_from_the_recorded_sweep_is_refused(whole, tmp_path, capsys):
    before = (whole / "sweep.json").read_text()
    refused = [
        (sweep_argv(whole, seeds="1"), "seeds: [1, 2] recorded, [1] now"),
        (sweep_argv(whole, grid="loss.label_smoothing=0.1,0.3"), "grid: "),
        (sweep_argv(whole, extra=["optim.lr=0.01"]), "config optim.lr: 0.002 recorded, 0.01 now"),
    ]
    for argv, why in refused:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {whole / 'sweep.json'} records another sweep") and why in err
        assert "Continue it with the recorded command `infosieve sweep --config" in err
    assert (whole / "sweep.json").read_text() == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert cli.main(sweep_argv(tmp_path / "other")) == 2
    assert "is not empty and holds no sweep.json" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ devices
def test_devices_run_each_run_in_its_own_process(whole, tmp_path, capsys, monkeypatch):
    out = tmp_path / "devices"
    argv = sweep_argv(out, seeds="1,2", grid="loss.label_smoothing=0.1", extra=["train.device=auto"])
    # a CPU run's numbers depend on its thread count (fingerprint cpu_threads): the workers get the in-process runs'
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    assert cli.main([*argv, "--devices", "cpu,cpu"]) == 0
    assert "started on cpu" in capsys.readouterr().out
    for seed in (1, 2):
        name = f"loss.label_smoothing=0.1-seed{seed}"
        log = (out / "logs" / f"{name}.log").read_text()
        assert f"run folder: {out / 'runs' / name}" in log  # the worker's own output
        # CUDA hidden from the worker, so train.device=auto trained on the CPU, as the in-process runs did
        assert json.loads((out / "runs" / name / "fingerprint.json").read_text())["device"] == "cpu"
        metrics = json.loads((out / "runs" / name / "metrics.json").read_text())
        assert metrics == json.loads((whole / "runs" / name / "metrics.json").read_text())
    assert [p["finished"] for p in json.loads((out / "summary.json").read_text())["points"]] == [2]


def test_each_worker_sees_only_its_gpu_and_its_share_of_the_cores(tmp_path, monkeypatch):
    started = []

    class FakePopen:
        def __init__(self, cmd, stdout, stderr, env):
            started.append((cmd, env["CUDA_VISIBLE_DEVICES"], env["OMP_NUM_THREADS"]))

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run = {"name": "seed1"}
    for device in ("cuda:1", "cuda:0", "cpu"):
        sweep.start_worker(tmp_path, run, device, threads=3)
    assert [(gpu, threads) for _, gpu, threads in started] == [("1", "3"), ("0", "3"), ("", "3")]
    assert started[0][0][1:] == ["-m", "infosieve_fast.commands.sweep", str(tmp_path), "seed1"]
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's own setting wins
    sweep.start_worker(tmp_path, run, "cpu", threads=3)
    assert started[-1][2] == "5"


@pytest.mark.parametrize(("cores", "processes", "threads"), [(8, 1, 8), (8, 3, 2), (2, 2, 1), (2, 4, 1)])
def test_workers_share_the_cores_this_process_may_use(monkeypatch, cores, processes, threads):
    monkeypatch.setattr(sweep.os, "sched_getaffinity", lambda pid: set(range(100, 100 + cores)), raising=False)
    assert sweep.threads_per_process(processes) == threads


def test_a_failed_worker_stops_the_sweep_once_the_runs_in_flight_end(tmp_path, monkeypatch):
    class Worker:
        """A worker process that ends with `code` after `polls` polls."""

        def __init__(self, code, polls):
            self.code, self.polls, self.returncode = code, polls, None

        def poll(self):
            self.polls -= 1
            if self.polls <= 0:
                self.returncode = self.code
            return self.returncode

    workers = iter([Worker(3, 1), Worker(0, 5)])  # seed1 fails at once, seed2 is still running then
    started = []

    def start(sweep_dir, run, device, threads):
        started.append((run["name"], device))
        return next(workers)

    monkeypatch.setattr(sweep, "start_worker", start)
    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    summaries = []
    monkeypatch.setattr(sweep, "write_summary", summaries.append)
    runs = [{"name": f"seed{s}"} for s in (1, 2, 3)]
    with pytest.raises(sweep.SweepError) as err:
        sweep.run_on_devices(tmp_path, runs, ["cuda:0", "cuda:1"])
    assert started == [("seed1", "cuda:0"), ("seed2", "cuda:1")]  # seed3 never starts
    assert summaries == [tmp_path]  # seed2 ran to its end and was summarised
    assert str(err.value) == (f"sweep runs failed: seed1 (exit status 3; see {tmp_path / 'logs' / 'seed1.log'}). "
                              "Fix the cause, then rerun the same command")  # fmt: skip


class StandInWorker:
    """A worker process that ends with `code` after `polls` polls, or with the preempted status once signalled."""

    def __init__(self, code, polls):
        self.code, self.polls, self.returncode, self.signals = code, polls, None, []

    def poll(self):
        self.polls -= 1
        if self.polls <= 0 or self.signals:
            self.returncode = PREEMPTED_EXIT if self.signals else self.code
        return self.returncode

    def send_signal(self, sig):
        self.signals.append(sig)


@pytest.mark.parametrize("where", ["worker", "sweep"])
def test_a_stop_signal_ends_the_device_sweep_once_its_runs_have_checkpointed(where, tmp_path, monkeypatch):
    """A worker that exits preempted (the signal reached it alone) or a signal to the sweep (passed on to every run in
    flight): no further run starts, the others end, and `Preempted` names the runs stopped at a checkpoint."""
    first = StandInWorker(PREEMPTED_EXIT if where == "worker" else 0, 1 if where == "worker" else 50)
    workers, started, handler = iter([first, StandInWorker(0, 1)]), [], signal.getsignal(signal.SIGUSR1)

    def start(sweep_dir, run, device, threads):
        started.append(run["name"])
        if len(started) == 2 and where == "sweep":
            os.kill(os.getpid(), signal.SIGUSR1)
        return next(workers)

    monkeypatch.setattr(sweep, "start_worker", start)
    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    summaries = []
    monkeypatch.setattr(sweep, "write_summary", summaries.append)
    with pytest.raises(Preempted) as err:
        sweep.run_on_devices(tmp_path, [{"name": f"seed{s}"} for s in (1, 2, 3)], ["cpu", "cpu"])
    assert started == ["seed1", "seed2"] and summaries == [tmp_path]  # seed3 never starts; seed2 ran to its end
    cause = "a stop signal to a run" if where == "worker" else "SIGUSR1"
    assert str(err.value) == f"{cause}: seed1 stopped at a checkpoint"
    assert first.signals == ([] if where == "worker" else [signal.SIGUSR1])
    assert signal.getsignal(signal.SIGUSR1) == handler  # the sweep's handler is gone again


def test_devices_and_the_config_device_must_agree():
    cfg = load_config("configs/demo.yaml", ["train.device=cpu"])
    assert sweep.parse_devices("cpu,cpu", cfg) == ["cpu", "cpu"]
    with pytest.raises(sweep.SweepError, match="add --set train.device=auto"):
        sweep.parse_devices("cuda:0,cuda:1", cfg)
    auto = load_config("configs/demo.yaml")
    assert sweep.parse_devices("cuda:0, cuda:1", auto) == ["cuda:0", "cuda:1"]
    with pytest.raises(sweep.SweepError, match="'cuda' is not a device; write cuda:0,cuda:1 or cpu"):
        sweep.parse_devices("cuda", auto)


# ------------------------------------------------------------------------------------------------ peak memory
def resident_mapping(size: int) -> mmap.mmap:
    """`size` bytes of this process's own anonymous mapping, every page written (resident until it is closed: no
    allocator can keep it, as malloc may keep a freed array)."""
    mapping = mmap.mmap(-1, size)
    mapping.write(b"\x01" * size)
    return mapping


def test_peak_memory_per_epoch(monkeypatch):
    cpu = torch.device("cpu")
    held = resident_mapping(64 * 2**20)
    assert memory.reset_peak_memory(cpu)
    with_it = memory.peak_memory(cpu)["peak_rss_bytes"]  # the resident set now, with the 64 MiB
    held.close()  # unmapped: the resident set falls by 64 MiB
    assert memory.reset_peak_memory(cpu)
    without = memory.peak_memory(cpu)["peak_rss_bytes"]
    assert with_it - without >= 48 * 2**20  # the reset forgot the earlier peak
    again = resident_mapping(64 * 2**20)
    assert memory.peak_memory(cpu)["peak_rss_bytes"] - without >= 48 * 2**20  # and the next one is seen
    again.close()
    # CUDA: the allocator's peak since the epoch's reset (faked here: no GPU)
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 123 * 2**20)
    gpu = torch.device("cuda", 1)
    assert memory.reset_peak_memory(gpu) and calls == [("reset", gpu)]
    assert memory.peak_memory(gpu) == {"peak_gpu_bytes": 123 * 2**20}
    # where the peak cannot be reset, no peak is recorded (the process's peak would not be the epoch's)
    monkeypatch.setattr(memory.Path, "write_text", lambda self, text: (_ for _ in ()).throw(PermissionError()))
    assert not memory.reset_peak_memory(cpu)
