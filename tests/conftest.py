"""Test-wide setup.

Triton's interpreter must be switched on before `triton` is first imported, and only where no GPU is present, so the
same tests exercise the real kernels on a CUDA machine and the interpreter on the CPU.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REALDATA = Path(__file__).resolve().parents[1].parent / "shared" / "realdata"


@pytest.fixture(scope="session")
def realdata() -> Path:
    """The project's real test data, read in place (never copied into the repo)."""
    root = Path(os.environ.get("INFOSIEVE_REALDATA", REALDATA))
    if not (root / "README.md").is_file():
        pytest.fail(
            f"real test data not found at {root}: put the shared realdata folder there "
            "or point INFOSIEVE_REALDATA at it",
            pytrace=False,
        )
    return root


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
