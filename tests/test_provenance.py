"""benchmarks/tools/provenance.py: the tree hash that proves which code a result came from, and the versions a result
names."""

import json
import platform
import subprocess
from pathlib import Path

import numpy
import pytest
import torch

from benchmarks.tools import provenance


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_tree_hash_follows_the_code_and_nothing_else(tmp_path):
    files = {"pyproject.toml": "[project]\n", "kernels/a.py": "x = 1\n", "benchmarks/b.py": "y = 2\n"}
    base = provenance.tree_hash(_tree(tmp_path / "one", files))
    assert base == provenance.tree_hash(_tree(tmp_path / "two", files))  # same files, another folder

    extras = {
        "benchmarks/results/r.json": "{}",
        "kernels/__pycache__/a.cpython-311.pyc": "",
        "docs/x.md": "text",
        "kernels/c.pyc": "",
    }
    assert provenance.tree_hash(_tree(tmp_path / "one", extras)) == base

    assert provenance.tree_hash(_tree(tmp_path / "three", {**files, "kernels/a.py": "x = 2\n"})) != base
    assert provenance.tree_hash(_tree(tmp_path / "four", {**files, "configs/new.yaml": "a: 1\n"})) != base
    renamed = {"pyproject.toml": "[project]\n", "kernels/z.py": "x = 1\n", "benchmarks/b.py": "y = 2\n"}
    assert provenance.tree_hash(_tree(tmp_path / "five", renamed)) != base


def test_a_clean_clone_hashes_like_its_commit(tmp_path):
    """What a result's tree_hash is checked against: the hash of the commit it names, computed from git alone."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(provenance.ROOT), str(clone)], check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True, check=True)
    assert provenance.tree_hash(clone) == provenance.commit_tree_hash(head.stdout.strip())


def test_every_emitted_result_names_commit_dirty_and_tree(tmp_path):
    out = tmp_path / "r.json"
    provenance.emit_json({"seconds": 1.5}, out, echo=False)
    written = json.loads(out.read_text())
    commit, dirty = provenance.git_state()
    assert written == {"commit": commit, "dirty": dirty, "tree_hash": provenance.tree_hash(), "seconds": 1.5}


def test_a_write_cut_short_leaves_the_previous_result_whole(tmp_path, monkeypatch):
    """gpu_check.sh kills a step at its limit, maybe while it writes: the file then holds the last complete JSON, and
    no temporary file is left beside it."""
    out = tmp_path / "r.json"
    provenance.emit_json({"cases": [1]}, out, echo=False)

    def killed(fd):
        raise KeyboardInterrupt("the step's timeout (simulated)")

    monkeypatch.setattr("os.fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        provenance.emit_json({"cases": [1, 2]}, out, echo=False)
    assert json.loads(out.read_text())["cases"] == [1]
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_versions_name_python_torch_and_each_module_asked_for():
    got = provenance.versions("numpy", "no_such_module_here")
    assert got["python"] == platform.python_version() and got["torch"] == torch.__version__
    assert got["numpy"] == numpy.__version__
    assert got["no_such_module_here"].startswith("unavailable: ModuleNotFoundError: ")
