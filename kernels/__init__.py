"""InfoSieve's hot math: PyTorch reference and fused Triton kernels behind one dispatch.

Installed as `infosieve_kernels` (see pyproject.toml). Layout: `dispatch.py` (the backend choice and the public ops),
`reference.py` (the PyTorch twins and the shared eps constants), `code_head_triton.py` and `contrastive_triton.py`
(the fused kernels), `launch.py` (their shared host-side helpers), `layers.py` (the head MLPs), `compat.py` (drop-in
names for the original InfoSieve code).
"""

from .dispatch import *  # noqa: F403
from .dispatch import __all__  # noqa: F401
