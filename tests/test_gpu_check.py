"""benchmarks/gpu_check.sh's step selection (GPU_CHECK_STEPS), on its CPU rehearsal: the named steps run and land in
the archive, the others say they were not selected, and an unknown name is refused before anything runs."""

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def rehearse(tmp_path: Path, steps: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "INFOSIEVE_BENCH_SMOKE": "1", "PYTHON": sys.executable, "GPU_CHECK_STEPS": steps}
    return subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_only_the_selected_steps_run(tmp_path):
    done = rehearse(tmp_path, "preflight")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with tarfile.open(tmp_path / "cpu-rehearsal-gpu-check.tar.gz") as archive:
        names = {Path(n).name for n in archive.getnames()}
        summary = archive.extractfile("cpu-rehearsal/summary.txt").read().decode()
    assert {"preflight.json", "preflight.log", "targets.json"} <= names
    assert "kmeans-imagenet1k.json" not in names and "kernels.json" not in names
    assert "preflight: ok" in summary
    assert "| issue | target | measured | bound | holds | from |" in summary  # benchmarks/gpu_targets.py's table
    for name in ("kmeans-in1k", "epoch-in1k", "cache-herb19", "train", "kernels", "parity", "resume", "demo"):
        assert f"{name}: not selected (GPU_CHECK_STEPS=preflight)" in summary, name


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    done = rehearse(tmp_path, "preflight,kernel")
    assert done.returncode == 2
    assert "no step is called 'kernel'" in done.stderr and "kernels" in done.stderr
    assert not list(tmp_path.iterdir())


def test_the_selectable_names_are_the_steps_the_script_runs():
    script = SCRIPT.read_text()
    listed = re.search(r"^STEP_NAMES=(\S+)$", script, re.MULTILINE).group(1).split(",")
    assert listed == re.findall(r"^step (\S+) \d+ ", script, re.MULTILINE)
