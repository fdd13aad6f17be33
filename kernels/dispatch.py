"""The backend dispatch: each op runs the fused Triton kernel or its PyTorch twin in `reference.py`.

`backend="auto"` runs the Triton kernels on CUDA tensors and the PyTorch reference elsewhere; `"triton"` and
`"torch"` force one. The environment variable `INFOSIEVE_KERNELS=triton|torch` overrides every call, the compat
layer included (with `TRITON_INTERPRET=1` that runs the Triton kernels on CPU tensors).

`rowsum_normalize` in the contrastive losses divides each distance column j by row j's distance sum (the original
code's `is_code=True`, which InfoSieve applies to the codes by default).
"""

from __future__ import annotations

import importlib
import os

from torch import Tensor

from . import reference
from .reference import CodeHead, positional_weights

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "INFOSIEVE_KERNELS"

__all__ = [
    "BACKENDS",
    "CodeHead",
    "ENV_VAR",
    "code_head",
    "info_nce_and_supcon",
    "info_nce_loss",
    "positional_weights",
    "resolve_backend",
    "supcon_loss",
]


def resolve_backend(backend: str, tensor: Tensor) -> str:
    """The backend a call on `tensor` runs: the environment override, else `backend`, with auto resolved."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
        if forced not in ("triton", "torch"):
            raise ValueError(f"{ENV_VAR}={forced!r} is not a backend: set it to 'triton' or 'torch', or unset it")
        return forced
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "triton" if tensor.is_cuda else "torch"
    return backend


def _impl(module: str, name: str, backend: str, tensor: Tensor):
    """`name` from the reference, or from the Triton module `<module>_triton` of this package (imported on first
    use, so that the torch backend never imports triton)."""
    if resolve_backend(backend, tensor) == "torch":
        return getattr(reference, name)
    return getattr(importlib.import_module(f"{__package__}.{module}_triton"), name)


def code_head(
    code_feat: Tensor, mask_feat: Tensor, age: float, code_weight: Tensor, length_weight: Tensor, *, backend="auto"
) -> CodeHead:
    """See `reference.code_head`."""
    return _impl("code_head", "code_head", backend, code_feat)(code_feat, mask_feat, age, code_weight, length_weight)


def info_nce_loss(
    features: Tensor,
    temperature: float = 1.0,
    label_smoothing: float = 0.0,
    rowsum_normalize: bool = False,
    smoothing_target: Tensor | None = None,
    *,
    backend="auto",
) -> Tensor:
    """See `reference.info_nce_loss`."""
    fn = _impl("contrastive", "info_nce_loss", backend, features)
    return fn(features, temperature, label_smoothing, rowsum_normalize, smoothing_target)


def supcon_loss(
    features: Tensor,
    labels: Tensor,
    temperature: float = 0.07,
    base_temperature: float = 0.07,
    rowsum_normalize: bool = False,
    *,
    backend="auto",
) -> Tensor:
    """See `reference.supcon_loss`."""
    fn = _impl("contrastive", "supcon_loss", backend, features)
    return fn(features, labels, temperature, base_temperature, rowsum_normalize)


def info_nce_and_supcon(
    features: Tensor,
    supcon_labels: list[Tensor],
    temperature: float = 1.0,
    label_smoothing: float = 0.0,
    supcon_temperature: float = 0.07,
    base_temperature: float = 0.07,
    rowsum_normalize: bool = False,
    smoothing_target: Tensor | None = None,
    *,
    backend="auto",
) -> tuple[Tensor, list[Tensor]]:
    """See `reference.info_nce_and_supcon`; the fused version computes one Gram matrix for all the terms."""
    fn = _impl("contrastive", "info_nce_and_supcon", backend, features)
    args = (temperature, label_smoothing, supcon_temperature, base_temperature, rowsum_normalize, smoothing_target)
    return fn(features, supcon_labels, *args)
