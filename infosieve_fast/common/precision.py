"""TF32 in CUDA fp32 matmuls, switched through one API only.

torch 2.9 added `torch.backends.cuda.matmul.fp32_precision` ("ieee" | "tf32") beside the legacy `allow_tf32` flag and
`torch.set_float32_matmul_precision`. torch keeps them as two states that it compares on every read of a legacy one:
a write through the new API leaves the legacy state as it was, and a legacy read after the two disagree raises
"... you have used mix of the legacy and new APIs to set the TF32 status for cublas matmul ...". For example, on torch
2.14 `allow_tf32 = True` followed by `fp32_precision = "ieee"` (what `kmeans._cuda_matmul_precision` does) makes
every later read of `allow_tf32` raise. So every switch goes through `set_cuda_matmul_tf32`: the new API where it
exists, the legacy flag only on a torch without it; and every read through `cuda_matmul_tf32_allowed`.

Known torch issue (pytorch/pytorch#166387): on some torch >= 2.9 builds `torch.compile`'s inductor still reads the
legacy getter, so a new-API "tf32" makes compilation of an fp32 matmul fail there; "ieee" (the default) is safe.
"""

from __future__ import annotations

import torch


def has_fp32_precision_api() -> bool:
    """Whether this torch has `torch.backends.cuda.matmul.fp32_precision` (torch >= 2.9)."""
    return hasattr(torch.backends.cuda.matmul, "fp32_precision")


def set_cuda_matmul_tf32(allow: bool) -> None:
    """Let CUDA fp32 matmuls use TF32 tensor cores (`allow`) or keep them in full fp32."""
    if has_fp32_precision_api():
        torch.backends.cuda.matmul.fp32_precision = "tf32" if allow else "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = allow


def cuda_matmul_tf32_allowed() -> bool:
    """Whether CUDA fp32 matmuls may use TF32, read through the same API `set_cuda_matmul_tf32` writes."""
    if has_fp32_precision_api():
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    return bool(torch.backends.cuda.matmul.allow_tf32)


def cudnn_conv_tf32_allowed() -> bool:
    """Whether cuDNN fp32 convolutions may use TF32: `torch.backends.cudnn.conv.fp32_precision` where this torch has
    it (a read of the legacy `allow_tf32` raises once the two APIs were mixed), else the legacy flag."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        return conv.fp32_precision == "tf32"
    return bool(torch.backends.cudnn.allow_tf32)


def float32_matmul_precision() -> str:
    """`torch.get_float32_matmul_precision()` ("highest" | "high" | "medium"). torch refuses to answer once the legacy
    and new APIs were mixed; then the new API's matmul settings, as "cuda=<fp32_precision> mkldnn=<fp32_precision>"."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        cuda, mkldnn = torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision
        return f"cuda={cuda} mkldnn={mkldnn}"


def precision_flags() -> dict:
    """The process's fp32 precision switches, as a run's fingerprint records them: TF32 in CUDA matmuls and in cuDNN
    convolutions, and the float32 matmul precision (which torch keeps beside the TF32 switches; on the CPU "medium"
    lets oneDNN matmuls run in bf16)."""
    return {
        "tf32_matmul": cuda_matmul_tf32_allowed(),
        "tf32_cudnn": cudnn_conv_tf32_allowed(),
        "float32_matmul_precision": float32_matmul_precision(),
    }
