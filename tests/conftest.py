"""Test-wide setup.

Triton's interpreter must be switched on before `triton` is first imported, and only where no GPU is present, so the
same tests exercise the real kernels on a CUDA machine and the interpreter on the CPU.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REALDATA = Path(__file__).resolve().parents[1].parent / "shared" / "realdata"


@pytest.fixture(scope="session")
def realdata() -> Path:
    """The project's real test data, read in place (never copied into the repo).

    Where it is absent (a clone with nothing beside it) the tests that need it are skipped with the reason; with
    INFOSIEVE_REQUIRE_REALDATA=1 (set by CI) its absence fails them instead, so CI can never skip them."""
    root = Path(os.environ.get("INFOSIEVE_REALDATA", REALDATA))
    if not (root / "README.md").is_file():
        reason = (
            f"real test data not found at {root}: put the shared realdata folder there "
            "or point INFOSIEVE_REALDATA at it"
        )
        if os.environ.get("INFOSIEVE_REQUIRE_REALDATA") == "1":
            pytest.fail(f"{reason} (INFOSIEVE_REQUIRE_REALDATA=1 forbids skipping)", pytrace=False)
        pytest.skip(reason)
    return root


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def chromium_or_skip() -> str:
    """The headless Chromium to render pages with. Where none is installed (apt-get install chromium) the calling test
    is skipped; with INFOSIEVE_REQUIRE_CHROMIUM=1 (set by CI) it fails instead."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        reason = "no headless chromium here (apt-get install chromium)"
        if os.environ.get("INFOSIEVE_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"{reason} (INFOSIEVE_REQUIRE_CHROMIUM=1 forbids skipping)", pytrace=False)
        pytest.skip(reason)
    return chromium


@pytest.fixture(scope="session")
def screenshot():
    """`screenshot(page, png, width, height)`: `page` rendered by headless Chromium into `png` (`chromium_or_skip`)."""

    def render(page: Path, png: Path, width: int, height: int) -> Path:
        cmd = [chromium_or_skip(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--screenshot={png}", f"--window-size={width},{height}", page.as_uri()]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        return png

    return render


@pytest.fixture(scope="session")
def rendered_dom():
    """`rendered_dom(page)`: the DOM of `page` after headless Chromium loaded it and ran its scripts, as HTML
    (`chromium_or_skip`)."""

    def render(page: Path) -> str:
        cmd = [chromium_or_skip(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()]
        return subprocess.run(cmd, check=True, capture_output=True, timeout=120, text=True).stdout

    return render
