"""estimate-k: GCD's search recovers K on separated blobs and on real CUB-100 features; the CLI and its errors."""

import json

import numpy as np
import pytest

from infosieve_fast import cli
from infosieve_fast.data.splits import gcd_split
from infosieve_fast.estimate_k import estimate_k, load_features


def _blobs(k: int, per: int, dim: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, dim)) * 4
    y = np.repeat(np.arange(k), per)
    return centres[y] + rng.normal(size=(len(y), dim)), y


def test_separated_blobs_give_their_number():
    x, y = _blobs(12, 30)
    labelled, _ = gcd_split(y, list(range(6)), 0.5, 0)
    res = estimate_k(x, y, labelled, 6, k_max=30, n_seeds=2)
    assert res["k"] == 12
    curve = {int(k): v for k, v in res["criteria"]["labelled_accuracy"].items()}
    assert curve[12] > 0.95 and all(v <= curve[12] for v in curve.values())
    assert set(res["criteria"]["unlabelled_silhouette"]) == set(res["criteria"]["labelled_accuracy"])


def test_real_cub100_features_within_15_percent(realdata, tmp_path, capsys):
    """The issue's check: EfficientNet-Lite0 features of the 100 CUB species, the first 50 known."""
    out = tmp_path / "k.json"
    path = realdata / "features" / "cub100_efflite0_224_feats.npz"
    assert cli.main(["estimate-k", "--features", str(path), "--known-classes", "50", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res == json.loads(capsys.readouterr().out)
    assert 85 <= res["k"] <= 115, res["k"]
    assert res["search"]["k_min"] == 50 and res["search"]["k_max"] == 200


def test_bad_inputs_are_named(tmp_path, capsys):
    x, y = _blobs(4, 10)
    with pytest.raises(ValueError, match="k_max=3 must exceed the 3 known classes"):
        estimate_k(x, y, y < 2, 3, k_max=3)
    with pytest.raises(ValueError, match="labelled and unlabelled"):
        estimate_k(x, y, np.ones(len(y), bool), 2)
    np.savez(tmp_path / "f.npz", F=x)
    with pytest.raises(ValueError, match=r"lacks \['y'\]"):
        load_features(str(tmp_path / "f.npz"), 2)
    np.savez(tmp_path / "g.npz", F=x, y=y)
    with pytest.raises(ValueError, match="--known-classes must lie in 1..3"):
        load_features(str(tmp_path / "g.npz"), 4)
    assert cli.main(["estimate-k"]) == 2
    assert "exactly one of --run" in capsys.readouterr().err
