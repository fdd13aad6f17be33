"""kmeans.n_clusters: the dataset's classes by default, a given K, or K estimated before training ("auto")."""

import pytest

from infosieve_fast.config.settings import ConfigError, load_config
from infosieve_fast.evaluation.estimate_k import estimate_k
from infosieve_fast.training.checkpoint import load_checkpoint
from infosieve_fast.training.engine import Trainer
from infosieve_fast.training.run_folder import train
from tests.test_engine import SMOKE


def _cfg(*extra):
    return load_config("configs/demo.yaml", [*SMOKE, "schedule.epochs=1", "train.device=cpu", *extra])


@pytest.mark.parametrize(("rule", "says"), [("neighbours", "lack the labelled neighbours"), ("score", "plausible K")])
def test_auto_estimates_k_once_before_training_and_keeps_it(rule, says, tmp_path, capsys):
    cfg = _cfg("kmeans.n_clusters=auto", f"kmeans.k_rule={rule}")
    train(cfg, tmp_path / "run")
    out = capsys.readouterr().out
    # the view the features came from (the digits have no stored size: the crop of each upscaled image)
    assert "kmeans.n_clusters=auto: the features are those of the centre 32 px crop of each image\n" in out
    state = load_checkpoint(tmp_path / "run")
    fresh = Trainer(_cfg())  # the same seed: the same initial backbone
    fs = fresh.evaluator.features("test")
    want = estimate_k(fs.feats.numpy(), fs.targets.numpy(), fs.labelled.numpy(), fresh.source.n_old, rule=rule)["k"]
    assert state["n_clusters"] == want and len(state["centers"]) == want
    assert f"kmeans.n_clusters=auto: estimated K = {want} (the dataset has 10 classes); " in out and says in out


def test_a_given_k_is_used_for_every_round(tmp_path):
    train(_cfg("kmeans.n_clusters=14"), tmp_path / "run")
    state = load_checkpoint(tmp_path / "run")
    assert state["n_clusters"] == 14 and state["centers"].shape[0] == 14
    default = Trainer(_cfg())
    assert default.evaluator.clusters(default.evaluator.features("test")) == 10  # the digits


@pytest.mark.parametrize("bad", ["'12'", "1", "true", "many"])
def test_bad_values_are_refused_at_load(bad):
    with pytest.raises(ConfigError, match="kmeans.n_clusters"):
        _cfg(f"kmeans.n_clusters={bad}")
