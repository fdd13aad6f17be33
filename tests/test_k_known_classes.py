"""kmeans.n_clusters against the data's known classes: fewer clusters than known classes, or "auto" with one known
class, are refused before the run folder exists (at load for the digits, whose known classes the config holds; when
the Trainer is built for any data, before `open_new_run` writes the folder)."""

import dataclasses

import pytest

from infosieve_fast import cli
from infosieve_fast.config.checks import check_clusters_for_known
from infosieve_fast.config.settings import ConfigError, load_config
from infosieve_fast.training.engine import Trainer
from tests.test_engine import SMOKE

FEWER = (
    "kmeans.n_clusters=3 is fewer than the data's 5 known classes, each of which needs its own cluster: set "
    "kmeans.n_clusters >= 5 (above it to leave clusters for new categories), or auto"
)
AUTO_WITH_ONE = (
    "kmeans.n_clusters=auto needs at least 2 known classes to estimate K, and this data has 1: set kmeans.n_clusters "
    "to the number of categories you expect (--set kmeans.n_clusters=N)"
)


def _cfg(*extra):
    return load_config("configs/demo.yaml", [*SMOKE, "schedule.epochs=1", "train.device=cpu", *extra])


def test_the_rule_by_hand():
    """K = the known classes or more passes, and auto with 2 known; K below them and auto with 1 do not; null (the
    dataset's classes) always does."""
    for k, n_old in ((5, 5), (9, 5), ("auto", 2), (None, 1), (2, 1)):
        check_clusters_for_known(k, n_old)
    with pytest.raises(ConfigError, match=r"^kmeans.n_clusters=4 is fewer than the data's 5 known classes"):
        check_clusters_for_known(4, 5)
    with pytest.raises(ConfigError, match=r"^kmeans.n_clusters=auto needs at least 2 known classes"):
        check_clusters_for_known("auto", 1)


def test_fewer_clusters_than_known_classes_are_refused_before_the_run_folder(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--config", "configs/demo.yaml", "--out", str(run), "--set", "kmeans.n_clusters=3"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"error: {FEWER}\n" and not run.exists()
    with pytest.raises(ConfigError) as auto:
        _cfg("data.digits.known_classes=1", "kmeans.n_clusters=auto")
    assert str(auto.value) == AUTO_WITH_ONE


@pytest.mark.parametrize(("known", "k", "said"), [(5, 3, FEWER), (1, "auto", AUTO_WITH_ONE)])
def test_the_trainer_refuses_them_for_any_data(known, k, said):
    """A config that escaped the load-time rule (own images: the known classes are only known from the data) is
    refused when the Trainer meets its data, before the model is built or the run folder written."""
    cfg = _cfg(f"data.digits.known_classes={known}", "kmeans.n_clusters=10")
    with pytest.raises(ConfigError) as refused:
        Trainer(dataclasses.replace(cfg, kmeans=dataclasses.replace(cfg.kmeans, n_clusters=k)))
    assert str(refused.value) == said
