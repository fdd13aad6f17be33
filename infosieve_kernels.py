"""`infosieve_kernels` for a checkout used without installing it (`PYTHONPATH=.`, `python -m benchmarks...`).

pyproject.toml installs the `kernels/` folder under this name; here the package path points at that folder, so
`infosieve_kernels.<module>` loads `kernels/<module>.py`, and the package body is `kernels/__init__.py`'s.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().with_name("kernels"))]

from infosieve_kernels.dispatch import *  # noqa: E402, F403
from infosieve_kernels.dispatch import __all__  # noqa: E402, F401
