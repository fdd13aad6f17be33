"""Which code ran: the git commit, whether the tree was dirty, and a hash of the code files themselves.

The tree hash covers the code (`CODE_PATHS`; results and caches excluded) and is computed from the files, so it is the
same on a machine whose copy of the tree has no `.git`. `commit_tree_hash(C)` is the hash of commit C's code, to check
a recorded `tree_hash` against the commit it names. Run folders (`fingerprint.py`) and benchmark results
(`benchmarks/tools/provenance.py`) both record these.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_PATHS = ("pyproject.toml", "infosieve_kernels.py", "infosieve_fast", "kernels", "benchmarks", "configs", "tests")
NOT_CODE = {"__pycache__", "results", ".pytest_cache", ".benchmarks"}


def git_state() -> tuple[str, bool | None]:
    """(commit, dirty): INFOSIEVE_COMMIT / INFOSIEVE_DIRTY when set (gpu_check.sh sets them from the caller, who knows
    the commit: the device copy of the tree may carry a stale .git that names an older commit), else git.
    ("unknown", None) when nobody knows."""
    if os.environ.get("INFOSIEVE_COMMIT"):
        return os.environ["INFOSIEVE_COMMIT"], {"0": False, "1": True}.get(os.environ.get("INFOSIEVE_DIRTY", ""))

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        except OSError:
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    return (commit, bool(git("status", "--porcelain"))) if commit else ("unknown", None)


def tree_hash(root: str | Path = ROOT) -> str:
    """sha256 over the relative path and bytes of every file under `CODE_PATHS` (sorted; `NOT_CODE` folders and .pyc
    files left out)."""
    root = Path(root)
    digest = hashlib.sha256()
    for top in CODE_PATHS:
        start = root / top
        files = [start] if start.is_file() else sorted(start.rglob("*")) if start.is_dir() else []
        for path in files:
            rel = path.relative_to(root)
            if not path.is_file() or path.suffix == ".pyc" or NOT_CODE.intersection(rel.parts):
                continue
            digest.update(rel.as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def commit_tree_hash(commit: str) -> str:
    """`tree_hash` of a commit's code, from `git archive` (the working tree is not touched)."""
    with tempfile.TemporaryDirectory() as tmp:
        listed = subprocess.run(
            ["git", "ls-tree", "--name-only", commit], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
        paths = [path for path in CODE_PATHS if path in listed]  # an older commit may lack some
        archive = subprocess.run(["git", "archive", commit, *paths], cwd=ROOT, capture_output=True, check=True)
        tar_path = Path(tmp) / "code.tar"
        tar_path.write_bytes(archive.stdout)
        with tarfile.open(tar_path) as tar:
            tar.extractall(Path(tmp) / "tree", filter="data")
        return tree_hash(Path(tmp) / "tree")
