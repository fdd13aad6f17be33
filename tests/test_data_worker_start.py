"""How the stream starts its DataLoader workers: forked while CUDA is not initialised, from a forkserver after."""

from __future__ import annotations

import json
import multiprocessing
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from infosieve_fast.data.reading import stream, workers
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
from infosieve_fast.data.reading.workers import worker_start_method
from infosieve_fast.data.writing.shards import make_shards


@pytest.mark.parametrize(
    ("available", "without_cuda", "with_cuda"),
    [
        (["fork", "spawn", "forkserver"], "fork", "forkserver"),  # Linux
        (["spawn", "fork", "forkserver"], "fork", "forkserver"),  # macOS (spawn is its default)
        (["spawn", "forkserver"], "forkserver", "forkserver"),
        (["spawn"], None, None),  # Windows: the platform default
    ],
)
def test_a_process_with_cuda_initialised_never_forks_its_workers(monkeypatch, available, without_cuda, with_cuda):
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: available)
    assert worker_start_method(cuda_initialised=False) == without_cuda
    assert worker_start_method(cuda_initialised=True) == with_cuda


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("start")
    rng = np.random.default_rng(0)
    for c in range(3):
        (base / "raw" / f"class{c}").mkdir(parents=True)
        for i in range(8):
            pixels = (rng.random((40, 56 if i % 2 else 40, 3)) * 200 + 20 * c).astype(np.uint8)
            Image.fromarray(pixels).save(base / "raw" / f"class{c}" / f"{i}.png")
    make_shards("imagefolder", base / "raw", base / "shards", shard_size_mb=0.02, resize=32, workers=1, progress=False)
    return base / "shards"


def test_forkserver_workers_serve_the_same_batches(shards, monkeypatch):
    """With CUDA faked initialised the pass's workers come from the forkserver, and they read and decode what
    forked workers do, in the same order (training draws and the feature pass)."""

    def passes() -> list[torch.Tensor]:
        src = ShardSource(shards, ReadOptions(cache="off", decode="cpu", num_workers=2, sampling="shuffle"))
        out = [t for b in src.feature_batches(5) for t in (b.uq, b.images)]
        return out + [t for b in src.train_batches(4, epoch=1, seed=0) for t in (b.uq, b.images)]

    forked = passes()
    used, context = [], workers.worker_context
    monkeypatch.setattr(stream, "worker_context", lambda preload: used.append(context(preload)) or used[-1])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    served = passes()
    assert [c.get_start_method() for c in used] == ["forkserver", "forkserver"]
    assert len(served) == len(forked) and all(torch.equal(a, b) for a, b in zip(served, forked, strict=True))


def test_the_forkserver_preloads_what_the_main_script_imports(monkeypatch):
    main = types.ModuleType("__main__")
    main.json, main.Path = json, Path  # a module, and a class from one

    def local() -> None:  # a function the main script defines
        pass

    local.__module__ = "__main__"
    main.local = local
    main.ghost = type("Ghost", (), {"__module__": "no_such_module_here"})  # never imported: left out
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert workers.main_script_imports() == ["json", "pathlib"]
