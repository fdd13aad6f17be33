"""Host-side helpers shared by the two Triton modules: their input checks, where the kernels may run, their compute
dtype, their buffers and scalar arguments."""

from __future__ import annotations

import os
import struct
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what the kernels read


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter: TRITON_INTERPRET=1, the value tests/conftest.py sets without a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_device(tensor: Tensor, op: str) -> None:
    """The compiled kernels need CUDA tensors; under the interpreter they also take CPU tensors."""
    if not tensor.is_cuda and not interpreting():
        raise RuntimeError(
            f"{op}: the Triton kernels need CUDA tensors (got a tensor on {tensor.device}): use backend='torch' on "
            "the CPU, or set TRITON_INTERPRET=1 before triton is imported to run them in Triton's interpreter"
        )


def check_float_matrix(tensor, op: str, name: str, shape: str) -> None:
    """`tensor` is a 2-D torch tensor of one of `FLOAT_DTYPES`, else a one-line error naming `op`, the argument `name`
    and its expected `shape` (e.g. "[N, D]")."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D {shape}, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be float16, bfloat16, float32 or float64, got dtype {tensor.dtype}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' arithmetic and scalar-output dtype: fp64 for fp64 inputs, fp32 for fp16/bf16/fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def new_buffer(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer a kernel writes comes from here: tests swap in a NaN-filled allocator, so that an element a kernel
    forgot to write shows up."""
    return torch.empty(shape, dtype=dtype, device=device)


def device_ctx(tensor: Tensor) -> AbstractContextManager:
    """Makes `tensor`'s GPU the current device for a launch (Triton launches on the current device)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else nullcontext()


def fp32_pair(value: float) -> tuple[float, float]:
    """A double as an fp32 hi/lo pair, the kernels' scalar arguments (Triton passes a Python float as fp32): hi + lo,
    summed in the kernel's compute dtype, is `value` to ~2^-48 relative in fp64 and fp32(value) in fp32."""
    hi = _to_f32(value)
    return hi, _to_f32(value - hi)


def _to_f32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]
