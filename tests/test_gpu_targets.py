"""benchmarks/tools/gpu_targets.py: each target's value read from the right result and key, judged against its bound by
hand; smoke-size results judged never; the archive unpacked under the card's name and never over a file."""

import io
import json
import tarfile

import pytest

from benchmarks.tools import gpu_targets

RESULTS = {
    "kmeans-imagenet1k.json": {
        "runs": [
            {"distance_precision": "bf16", "seconds": 3.0, "peak_bytes_beyond_features": 1e9},
            {"distance_precision": "fp32", "seconds": 12.5, "peak_bytes_beyond_features": 6.5e9},
        ]
    },
    "train-step.json": {
        "summary": {
            "step_speedup_vs_published_bf16": {"value": 2.25},
            "step_speedup_vs_published_fp32": {"value": 9.5},
            "step_mfu_datasheet": 0.41,
            "epoch_seconds": 7.0,  # a step-only run has no epoch: the CUB targets never read this file
        },
        "step": {"variants": {"fast_default": {"compile": "compiled"}, "fast_graph": {"cuda_graph": "eager"}}},
    },
    "train-epoch.json": {
        "summary": {"epoch_seconds": 1.8},
        "epoch": {"fast_default": {"phase_seconds": {"features": 0.5, "kmeans": 0.15}}},
    },
    "kernels.json": {
        "code_head": [
            {"N": 256, "variants": {"fused": {"ms": 0.08}}, "ratios": {"compiled_over_fused_time": 3.0}},
            {"N": 1 << 20, "variants": {"fused": {"ms": 1.0, "hbm_util": 0.65}}, "ratios": {}},
        ],
        "contrastive": [
            {"N": 256, "D": 40, "variants": {"fused": {"ms": 0.3}}, "ratios": {"compiled_over_fused_time": 0.9}}
        ],
    },
}
EXPECTED = {  # target -> (value, holds), by hand from RESULTS
    "SS-k-means round, ImageNet-1k size, fp32 search: s": (12.5, "no"),  # the fp32 run, not the bf16 one
    "... memory beyond the features: GB": (6.5, "yes"),
    "ImageNet-1k epoch at ViT-B/16, projected: min": (None, "owed"),  # no epoch file
    "default step, × published bf16": (2.25, "yes"),
    "default step, × published fp32": (9.5, "no"),
    "default step MFU, measured GEMM rate": (None, "owed"),
    "default step compiled (1), or eager after a failed compile (0)": (1.0, "yes"),
    "... the graph captured (1), or eager after a failed capture (0)": (0.0, "no"),
    "default step MFU, datasheet peak": (0.41, "reported"),
    "CUB-size epoch: s": (1.8, "yes"),  # the bound itself holds
    "feature pass at CUB size: s": (0.5, "no"),
    "SS-k-means round at CUB size: s": (0.15, "yes"),
    "fused code head fwd+bwd, N = 256: ms": (0.08, "yes"),
    "fused InfoNCE + SupCon fwd+bwd, N = 256, D = 40: ms": (0.3, "no"),
    "fused code head, N = 1M: share of HBM bandwidth": (0.65, "no"),
    "fused against torch.compile, slowest case: × compiled": (0.9, "no"),  # the smallest ratio over both groups
}


def write(folder, results) -> dict:
    for name, data in results.items():
        (folder / name).write_text(json.dumps(data))
    return {name: folder / name for name in results}


def test_every_target_read_from_its_result_and_judged_by_its_bound(tmp_path):
    rows = {r["what"]: r for r in gpu_targets.evaluate(write(tmp_path, RESULTS))}
    assert len(rows) == len(gpu_targets.TARGETS)  # one row per target, each named once
    for what, (value, holds) in EXPECTED.items():
        assert rows[what]["value"] == pytest.approx(value) if value is not None else rows[what]["value"] is None, what
        assert rows[what]["holds"] == holds, what


def test_a_smoke_size_result_is_never_judged(tmp_path):
    smoke = {name: {**data, "smoke": True} for name, data in RESULTS.items()}
    rows = {r["what"]: r for r in gpu_targets.evaluate(write(tmp_path, smoke))}
    for what, (value, _) in EXPECTED.items():
        assert rows[what]["holds"] == ("owed" if value is None else "smoke"), what


def test_a_torn_result_costs_only_its_own_rows(tmp_path):
    """A step killed while it wrote its JSON (gpu_check.sh's timeout): that file's rows say it is unreadable, every
    other file's rows are judged as usual."""
    files = write(tmp_path, RESULTS)
    files["kernels.json"].write_text(json.dumps(RESULTS["kernels.json"])[:40])
    rows = {r["what"]: r for r in gpu_targets.evaluate(files)}
    for what, (_, holds) in EXPECTED.items():
        if rows[what]["from"].startswith("kernels.json"):
            assert rows[what]["holds"].startswith("unreadable: JSONDecodeError") and rows[what]["value"] is None, what
        else:
            assert rows[what]["holds"] == holds, what


def archive_of(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_an_archive_is_unpacked_under_the_card_name_and_never_over_a_file(tmp_path, capsys):
    archive = tmp_path / "nvidia-h100-gpu-check.tar.gz"
    train = json.dumps(RESULTS["train-step.json"]).encode()
    archive_of(archive, {"nvidia-h100/train-step.json": train, "nvidia-h100/x.log": b"ok"})
    into = tmp_path / "results"
    assert gpu_targets.main([str(archive), "--into", str(into)]) == 0
    assert sorted(p.name for p in into.iterdir()) == ["nvidia-h100-train-step.json", "nvidia-h100-x.log"]
    assert "| 20 | default step, × published bf16 | 2.25 | >= 2 | yes |" in capsys.readouterr().out
    (into / "nvidia-h100-x.log").write_text("kept")
    with pytest.raises(SystemExit, match="would overwrite .*nvidia-h100-train-step.json"):
        gpu_targets.main([str(archive), "--into", str(into)])
    assert (into / "nvidia-h100-x.log").read_text() == "kept"


def test_an_archive_of_another_layout_is_refused(tmp_path):
    archive = tmp_path / "other.tar.gz"
    archive_of(archive, {"a/train.json": b"{}", "b/train.json": b"{}"})
    with pytest.raises(SystemExit, match="not a gpu_check.sh archive"):
        gpu_targets.main([str(archive), "--into", str(tmp_path / "results")])
