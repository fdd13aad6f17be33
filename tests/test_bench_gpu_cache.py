"""`benchmarks/bench_gpu_cache.py` at tiny size on the CPU (the cache then in RAM): its decode counts are the decodes
that really happened, and its JSON is written after every epoch."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks import bench_gpu_cache
from benchmarks.pooled_shards import pooled_natural_image
from infosieve_fast.data.reading import stream
from infosieve_fast.data.reading.cache import cache_device
from infosieve_fast.data.reading.decode import decode_cpu

N, SIZE = 40, 40


def test_epoch_one_decodes_every_sample_once_and_later_epochs_none(tmp_path, monkeypatch):
    decoded = []  # every image the reader decodes (--workers 0: in this process)
    monkeypatch.setattr(stream, "decode_cpu", lambda data: decoded.append(1) or decode_cpu(data))
    written = []  # (the JSON written, the decodes done by then)
    monkeypatch.setattr(bench_gpu_cache, "emit_json", lambda result, path, echo=True: written.append(
        (copy.deepcopy(result), len(decoded))))  # fmt: skip
    res = bench_gpu_cache.main([
        "--device", "cpu", "--n", str(N), "--size", str(SIZE), "--classes", "4", "--epochs", "3", "--batch", "16",
        "--workers", "0", "--views", "2", "--shards-dir", str(tmp_path / "shards"), "--json", str(tmp_path / "c.json"),
    ])  # fmt: skip
    none = {"cpu": 0, "gpu": 0, "gpu_fallback": 0}
    assert [e["images"] for e in res["epochs"]] == [N, N, N]
    assert [e["decodes"] for e in res["epochs"]] == [{**none, "cpu": N}, none, none]
    assert [(len(r["epochs"]), n) for r, n in written] == [(1, N), (2, N), (3, N), (3, N)]  # after each epoch, at end
    assert res["summary"]["later_epochs_decode_nothing"] and res["summary"]["unreadable"] == 0
    stored = [pooled_natural_image(i, SIZE, 0).shape for i in range(N)]  # stored as generated: shorter side SIZE
    assert res["cache"].startswith("cpu") and res["cache_bytes"] == sum(h * w * c for h, w, c in stored)
    assert res["settings"]["crop"] == SIZE


def test_the_pooled_images_differ_and_half_are_portrait():
    imgs = [pooled_natural_image(i, 64, 0) for i in range(60)]
    assert all(min(a.shape[:2]) == 64 and max(a.shape[:2]) <= 96 and a.shape[2] == 3 for a in imgs)
    assert 15 <= sum(a.shape[0] > a.shape[1] for a in imgs) <= 45
    assert len({a.tobytes() for a in imgs}) == 60


def test_a_gpu_cache_that_does_not_fit_is_refused_before_any_decoding(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4096 * 2**20, 80 * 2**30))  # 4 GiB free
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"cache='gpu': the decoded split takes 8,192 MiB but cuda has 4,096 MiB free"):
        cache_device("gpu", cuda, 8192, 0.5, 4096)
    assert cache_device("gpu", cuda, 4000, 0.5, 4096) == cuda
    assert cache_device("auto", cuda, 4000, 0.5, 4096) == torch.device("cpu")  # over half the free memory: in RAM
    assert cache_device("auto", cuda, 2000, 0.5, 4096) == cuda
