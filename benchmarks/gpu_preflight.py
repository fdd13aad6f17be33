"""A few seconds before any GPU benchmark: is the GPU there, does nvJPEG decode, does a Triton kernel run and agree?

    python -m benchmarks.gpu_preflight --device cuda --json RESULTS/preflight.json   # on the GPU machine
    python -m benchmarks.gpu_preflight --device cpu                                  # CI: Triton's interpreter

Checks, each reported as "ok", "failed" (with the error text) or "skipped: <why>"; a check never raises:
- gpu: the device's name, memory, compute capability and multiprocessor count (skipped on the CPU; failed when
  --device cuda finds no GPU: the other checks then run on the CPU);
- nvjpeg: one small JPEG made in memory (PIL, 96 x 64, quality 90) decoded by nvJPEG (`decode.nvjpeg_decode`, the
  call the data stream makes) and by the CPU decoder (`decode.decode_cpu`): max and mean absolute difference; ok
  when the shapes agree and the mean difference is below 2 levels (the two IDCTs round differently; skipped without
  CUDA);
- triton: the smallest fused op, `kernels.code_head_triton.code_head` (forward, 256 x 40, fp32), against its PyTorch
  twin `kernels.reference.code_head`: the largest absolute difference per output; ok within rtol 1e-4, atol 1e-5.
  Where torch sees no GPU it runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set here).
The versions of python, torch (and its CUDA), torchvision, triton and timm are listed. JSON on stdout and in --json.
Exit status 0, whatever a check says; 1 only with --require-gpu on a machine where torch sees no GPU.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import platform
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

if not torch.cuda.is_available():  # Triton reads it once, when first imported (torchvision imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.harness import sync  # noqa: E402
from benchmarks.provenance import device_name, emit_json  # noqa: E402
from infosieve_fast.data import decode  # noqa: E402

NVJPEG_MEAN_TOLERANCE = 2.0  # levels of 255, as tests/test_data_stream_exact.py's GPU test
TRITON_RTOL, TRITON_ATOL = 1e-4, 1e-5  # fp32 on CUDA, as tests/test_kernels_code_head.py
TRITON_N, TRITON_L = 256, 40
NO_CUDA = "skipped: no CUDA"


def versions() -> dict[str, str | None]:
    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    for module in ("torchvision", "triton", "timm"):
        try:
            out[module] = importlib.import_module(module).__version__
        except Exception as exn:  # a missing package is a finding, not a crash
            out[module] = f"unavailable: {type(exn).__name__}: {exn}"
    return out


def run_check(check: Callable[[], dict]) -> dict:
    """`check()`'s report with its status and seconds; a raised error becomes status "failed" with its text."""
    t0 = time.perf_counter()
    try:
        report = check()
    except Exception as exn:  # every failure is reported, none stops the other checks
        report = {"status": "failed", "error": f"{type(exn).__name__}: {exn}"}
    return {**report, "seconds": round(time.perf_counter() - t0, 3)}


def check_gpu(device: torch.device) -> dict:
    p = torch.cuda.get_device_properties(device)
    return {
        "status": "ok",
        "name": p.name,
        "memory_gib": round(p.total_memory / 2**30, 1),
        "capability": f"{p.major}.{p.minor}",
        "multiprocessors": p.multi_processor_count,
    }


def small_jpeg() -> bytes:
    """A 96 x 64 RGB JPEG (quality 90) with gradients, a disc and noise: every 8 x 8 block has detail."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:64, 0:96]
    disc = ((y - 30) ** 2 + (x - 50) ** 2 < 400) * 90
    pixels = np.stack([x * 2 + disc, y * 3, 255 - x * 2], -1) + rng.normal(0, 6, (64, 96, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def check_nvjpeg(device: torch.device) -> dict:
    """One JPEG through `decode.nvjpeg_decode` on `device` against the CPU decoder."""
    data = torch.frombuffer(bytearray(small_jpeg()), dtype=torch.uint8)
    on_device = decode.nvjpeg_decode([data], device)[0]
    sync(device)
    cpu = decode.decode_cpu(data)
    report = {
        "image": "96x64 JPEG quality 90 (PIL)",
        "shape": list(on_device.shape),
        "cpu_shape": list(cpu.shape),
        "device": str(on_device.device),
    }
    if on_device.shape != cpu.shape:
        return {
            "status": "failed",
            "error": f"nvJPEG decoded {tuple(on_device.shape)}, the CPU {tuple(cpu.shape)}",
            **report,
        }
    diff = (on_device.cpu().float() - cpu.float()).abs()
    report |= {"max_abs_diff": int(diff.max()), "mean_abs_diff": round(float(diff.mean()), 3)}
    if report["mean_abs_diff"] >= NVJPEG_MEAN_TOLERANCE:
        return {
            "status": "failed",
            "error": f"mean abs diff {report['mean_abs_diff']} >= {NVJPEG_MEAN_TOLERANCE}",
            **report,
        }
    return {"status": "ok", **report}


def check_triton(device: torch.device) -> dict:
    """`code_head` forward, fused (Triton) against the PyTorch reference, on `device`."""
    from infosieve_kernels import code_head_triton, reference

    gen = torch.Generator().manual_seed(0)
    inputs = code_head_triton.make_inputs(TRITON_N, TRITON_L, device=device, requires_grad=False, generator=gen)
    fused = code_head_triton.code_head(*inputs)
    expected = reference.code_head(*inputs)
    diffs, bad = {}, []
    for name, a, e in zip(reference.CodeHead._fields, fused, expected, strict=True):
        diffs[name] = float((a.float() - e.float()).abs().max())
        if a.shape != e.shape or not torch.allclose(a.float(), e.float(), rtol=TRITON_RTOL, atol=TRITON_ATOL):
            bad.append(name)
    report = {
        "op": f"code_head forward, {TRITON_N}x{TRITON_L} fp32",
        "interpreter": _triton_interpreting(),
        "max_abs_diff": diffs,
    }
    if bad:
        return {"status": "failed", "error": f"outside rtol {TRITON_RTOL}, atol {TRITON_ATOL}: {bad}", **report}
    return {"status": "ok", **report}


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="cuda | cpu | auto (cuda when torch sees one)")
    p.add_argument("--require-gpu", action="store_true", help="exit 1 when torch sees no GPU")
    p.add_argument("--json", default=None, help="also write the JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    wanted = torch.device("cuda" if args.device == "auto" and cuda else "cpu" if args.device == "auto" else args.device)
    device = wanted if wanted.type != "cuda" or cuda else torch.device("cpu")
    asked_in_vain = {"status": "failed", "error": "--device cuda, but torch sees no CUDA device"}
    no_gpu = asked_in_vain if wanted.type == "cuda" else {"status": NO_CUDA}
    checks = {
        "gpu": run_check(lambda: check_gpu(device)) if device.type == "cuda" else no_gpu,
        "nvjpeg": run_check(lambda: check_nvjpeg(device)) if device.type == "cuda" else {"status": NO_CUDA},
        "triton": run_check(lambda: check_triton(device)),
    }
    result = {
        "benchmark": "gpu_preflight",
        "device": device_name(device),
        "device_asked": str(wanted),
        "cuda_available": cuda,
        "versions": versions(),
        "summary": {name: c["status"] for name, c in checks.items()},
        "checks": checks,
    }
    emit_json(result, args.json)
    return 1 if args.require_gpu and not cuda else 0


if __name__ == "__main__":
    sys.exit(main())
