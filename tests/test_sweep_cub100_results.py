"""The committed real-bird sweep (docs/reproduce.md, "Real birds on the CPU"): three seeds of the published objective
and of `loss.code_distance=euclidean`, EfficientNet-Lite0 on cub100 species 0-19, killed once and continued. Its
summary is checked against statistics computed here from the runs' own files, and the kill against the resumed run's
records."""

import json
from pathlib import Path

from infosieve_fast.common.files import read_log
from tests.test_sweep import check_summary_is_the_runs_statistics

SWEEP = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sweep_cub100_code_distance"
POINTS = ["loss.code_distance=rowsum", "loss.code_distance=euclidean"]


def test_the_summary_is_the_runs_statistics():
    summary = check_summary_is_the_runs_statistics(SWEEP, seeds=3)
    assert [p["label"] for p in summary["points"]] == POINTS
    assert Path(summary["config"]).name == "cub100-heldout.yaml" and summary["seeds"] == [1, 2, 3]


def test_the_killed_run_continued_from_its_last_checkpoint_to_the_end():
    plan = json.loads((SWEEP / "sweep.json").read_text())
    resumed = []
    for run in plan["runs"]:
        folder = SWEEP / "runs" / run["name"]
        epochs = [record["epoch"] for record in read_log(folder / "log.jsonl")]
        assert epochs == list(range(6))  # every epoch once, in order, killed or not
        if (folder / "fingerprint-resumes.jsonl").is_file():
            resumed += [json.loads(line) for line in (folder / "fingerprint-resumes.jsonl").read_text().splitlines()]
    assert len(resumed) == 1 and 0 < resumed[0]["epoch"] < 6  # killed once, mid-run, and continued
