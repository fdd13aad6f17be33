"""SelEx's per-epoch hierarchy (`infosieve_fast.methods.selex_hierarchy`, docs/reference.md §12.3) and `method: selex`
in the engine: the level sizes, the levels' labelled samples and targets, the published order of the levels' labels,
one step against the method module on the same tensors, and a run preempted mid-epoch that resumes bit for bit."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch

from infosieve_fast.common.files import read_log
from infosieve_fast.methods.selex_hierarchy import build_hierarchy, level_sizes, read_in_loader_order
from infosieve_fast.training import loss_monitor
from infosieve_fast.training.checkpoint import load_checkpoint
from infosieve_fast.training.engine import Trainer
from infosieve_fast.training.preemption import Preempted
from infosieve_fast.training.run_folder import train
from infosieve_fast.training.step_graph import StepInputs
from tests.methods_helpers import assert_close
from tests.test_methods_wiring import tiny


def test_levels_halve_the_known_and_new_clusters_down_to_one_known_cluster():
    assert [o + n for o, n in level_sizes(100, 100)] == [200, 100, 50, 24, 12, 6, 2]  # the reference's CUB levels
    assert level_sizes(5, 5) == [(5, 5), (2, 2), (1, 1)]
    assert level_sizes(3, 1) == [(3, 1), (1, 1)]  # the new clusters stay at least 1
    assert level_sizes(1, 4) == [(1, 4)]  # one known class: level 0 only


def test_each_level_labels_the_samples_of_known_clusters_with_their_group_of_known_centres():
    # level 0: 4 known clusters whose centres lie in two obvious pairs (0, 1) and (2, 3), and 2 new ones
    centres = torch.tensor([[0.0, 10.0], [0.0, 10.5], [10.0, 0.0], [10.5, 0.0], [5.0, 5.0], [-5.0, -5.0]])
    labels = torch.tensor([0, 1, 2, 3, 4, 5, 0, 3, -1, 4])  # sample 8 unreadable
    labelled = torch.tensor([True, True, False, True, False, False, False, False, False, False])
    calls = []

    def cluster(level_labelled, targets, k):
        calls.append((level_labelled.clone(), targets.clone(), k))
        return torch.arange(len(targets)) % k, torch.zeros(k, 2)

    tables, level_centres = build_hierarchy(labels, centres, labelled, 4, cluster, order="uq")
    assert [k for *_, k in calls] == [3, 2]  # (4, 2) -> (2, 1) -> (1, 1)
    level_labelled, targets, _ = calls[0]
    assert level_labelled.tolist() == [True, True, True, True, False, False, True, True, False, False]
    pair = targets[[0, 1, 2, 3]]
    assert pair[0] == pair[1] != pair[2] == pair[3] and set(pair.tolist()) == {0, 1}  # the two groups of centres
    assert targets[6] == targets[0] and targets[7] == targets[3] and (targets[[4, 5, 8, 9]] == -1).all()
    assert torch.equal(calls[1][0], level_labelled) and (calls[1][1][level_labelled] == 0).all()  # one known group
    assert torch.equal(tables, torch.stack([labels, torch.arange(10) % 3, torch.arange(10) % 2]))
    assert len(level_centres) == 3 and level_centres[0] is centres


def test_published_order_gives_the_sample_at_each_loader_position_that_positions_label():
    # loader order: the data's labelled samples first (1, 3), then 0, 2, 4; the level's SS-k-means order: its labelled
    # samples first (0, 1, 4), then 2, 3. Loader position p reads the p-th output.
    labels = torch.tensor([10, 11, 12, 13, 14])
    labelled = torch.tensor([False, True, False, True, False])
    level_labelled = torch.tensor([True, True, False, False, True])
    read = read_in_loader_order(labels, labelled, level_labelled, torch.ones(5, dtype=torch.bool))
    assert read.tolist() == [14, 10, 12, 11, 13]
    assert torch.equal(read_in_loader_order(labels, labelled, labelled, torch.ones(5, dtype=torch.bool)), labels)


def test_selex_step_is_the_method_modules_loss_on_the_models_outputs_and_the_epochs_hierarchy():
    trainer = Trainer(tiny("selex"))
    table, *_ = trainer._pseudo_labels("epoch 1/2", 0)
    sizes = level_sizes(5, 5)
    assert table.shape == (len(sizes), trainer.source.n_train)
    for level, (old, new) in enumerate(sizes):
        assert table[level].min() >= 0 and table[level].max() < old + new
        assert trainer.method.centres[level, : old + new].abs().sum(1).gt(0).all()
    method = copy.deepcopy(trainer.method)  # the hierarchy the step reads
    batch = next(iter(trainer.source.train_batches(trainer.cfg.data.batch_size, 0, trainer.cfg.train.seed)))
    views = trainer.augment.train_views(batch.images, 2, torch.Generator().manual_seed(0), batch.sizes)
    inputs = StepInputs(views, batch.targets, batch.labelled, table[:, batch.uq])
    out = copy.deepcopy(trainer.model)(views)
    parts = trainer._step(inputs)
    from infosieve_fast.methods import StepTensors

    _, want = method(StepTensors(out.backbone, out.projection, batch.targets, batch.labelled, table[:, batch.uq]))
    assert set(parts) == set(want)
    for name in want:
        assert_close(parts[name], want[name], 1e-5, name)


def test_a_run_preempted_mid_epoch_keeps_the_moving_radii_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    cfg = tiny("selex", "schedule.epochs=2", "train.max_steps_per_epoch=2", "selex.cluster_momentum=0.5")
    full = train(cfg, tmp_path / "full")
    record, steps = loss_monitor.LossMonitor.record, []

    def signalling(self, parts):  # SIGTERM after epoch 1's first step: the run stops before its second
        record(self, parts)
        steps.append(self.epoch)
        if steps.count(1) == 1 and self.epoch == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(loss_monitor.LossMonitor, "record", signalling)
    with pytest.raises(Preempted):
        train(cfg, tmp_path / "stopped")
    monkeypatch.setattr(loss_monitor.LossMonitor, "record", record)
    mid = load_checkpoint(tmp_path / "stopped")["mid_epoch"]
    assert mid["step"] == 1 and set(mid["method"]) == {"centres", "radii"} and mid["pseudo"].dim() == 2
    assert train(cfg, tmp_path / "stopped", resume=True) == full

    def strip(run):
        return [{k: v for k, v in r.items() if not k.startswith(("seconds", "peak_"))} for r in read_log(run)]

    assert strip(tmp_path / "stopped" / "log.jsonl") == strip(tmp_path / "full" / "log.jsonl")
