"""The package's stages (pyproject.toml's [tool.importlinter] contract, docs/layout.md): each imports only the stages
below it. The contract is checked here so that the README's test command holds it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; c()"]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, env={"PYTHONPATH": str(root)})


def test_every_stage_imports_only_the_stages_below_it():
    pytest.importorskip("importlinter")
    done = lint_imports(ROOT)
    assert done.returncode == 0 and "1 kept, 0 broken" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


def test_an_import_up_the_stages_breaks_the_contract(tmp_path):
    """The contract can fail: a copy of the package in which the network imports a command is refused."""
    pytest.importorskip("importlinter")
    subprocess.run(["cp", "-r", str(ROOT / "infosieve_fast"), str(ROOT / "pyproject.toml"), str(tmp_path)], check=True)
    model = tmp_path / "infosieve_fast" / "network" / "model.py"
    model.write_text(model.read_text() + "\nfrom ..commands import report  # noqa: E402, F401\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0
    assert "infosieve_fast.network is not allowed to import infosieve_fast.commands" in done.stdout
