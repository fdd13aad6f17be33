"""benchmarks/plot_methods.py: the bars are the compare files' v2 means and sample sds, the ticks their `before`
means, each group named by what its entry's label does not share with the others."""

import json

import pytest
from PIL import Image

from benchmarks import plot_methods


def entry(label: str, after: dict, before: dict | None) -> dict:
    spread = {p: {"mean": m, "sd": s} for p, (m, s) in after.items()}
    out = {"label": label, "accuracy": {"v2": spread}}
    if before is not None:
        out["before"] = {p: {"mean": m, "sd": None} for p, m in before.items()}
    return out


def test_bars_are_the_files_numbers_and_names_drop_the_shared_prefix(tmp_path):
    result = {"entries": [
        entry("methods-cub-infosieve: (no grid)", {"all": (0.5, 0.1), "old": (0.6, 0.2), "new": (0.4, None)},
              {"all": 0.45, "old": 0.55, "new": None}),
        entry("methods-cub-gcd: (no grid)", {"all": (0.7, 0.0), "old": (0.8, 0.01), "new": (0.65, 0.02)}, None),
    ]}  # fmt: skip
    assert plot_methods.bars(result) == [
        {"method": "infosieve", "mean": [0.5, 0.6, 0.4], "sd": [0.1, 0.2, 0.0], "before": [0.45, 0.55, None]},
        {"method": "gcd", "mean": [0.7, 0.8, 0.65], "sd": [0.0, 0.01, 0.02], "before": [None, None, None]},
    ]
    assert plot_methods.method_names(["runs-a", "runs-ab"]) == ["a", "ab"]  # whole words: not "" and "b"
    assert plot_methods.method_names(["solo: (no grid)"]) == ["solo"]

    path = tmp_path / "c.json"
    path.write_text(json.dumps(result))
    out = plot_methods.main([str(path), "--out", str(tmp_path / "fig" / "m.png")])
    assert Image.open(out).size == (550, 360)  # one panel, 5.5 x 3.6 in at 100 dpi


def test_a_missing_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        plot_methods.main([str(tmp_path / "nope.json"), "--out", str(tmp_path / "m.png")])
    assert f"no compare file at {tmp_path / 'nope.json'}" in capsys.readouterr().err
