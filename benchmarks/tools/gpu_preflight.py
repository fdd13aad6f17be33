"""A few seconds before any GPU benchmark: is the GPU there, does nvJPEG decode, do a Triton kernel, an Inductor
compile and a CUDA graph run and agree?

    python -m benchmarks.tools.gpu_preflight --device cuda --json RESULTS/preflight.json   # on the GPU machine
    python -m benchmarks.tools.gpu_preflight --device cpu                                  # CI: Triton's interpreter

Checks, each reported as "ok", "failed" (with the error text) or "skipped: <why>"; a check never raises:
- gpu: the device's name, memory, compute capability and multiprocessor count (skipped on the CPU; failed when
  --device cuda finds no GPU: the other checks then run on the CPU);
- nvjpeg: one small JPEG made in memory (PIL, 96 x 64, quality 90) decoded by nvJPEG (`decode.nvjpeg_decode`, the
  call the data stream makes) and by the CPU decoder (`decode.decode_cpu`): max and mean absolute difference; ok
  when the shapes agree and the mean difference is below 2 levels (the two IDCTs round differently; skipped without
  CUDA);
- triton: the smallest fused op, `kernels.code_head_triton.code_head` (forward, 256 x 40, fp32), against its PyTorch
  twin `kernels.reference.code_head`: the largest absolute difference per output; ok within rtol 1e-4, atol 1e-5.
  Where torch sees no GPU it runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set here);
- inductor: a small graph (a matmul, GELU, a row mean) compiled whole by Inductor, the backend of `train.compile`,
  against eager: ok within atol 1e-4 (on the CPU Inductor writes C++, on CUDA Triton);
- cuda_graph: the same graph captured in a CUDA graph and replayed on new inputs: ok when equal to eager (skipped
  without CUDA).
The versions of python, torch (and its CUDA), torchvision, triton and timm are listed, and under `machine` the size
and free space of /dev/shm (DataLoader workers pass their batches through it), the GPU's free memory and its driver.
JSON on stdout and in --json.
Exit status 0, whatever a check says; 1 only with --require-gpu on a machine where torch sees no GPU.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

if not torch.cuda.is_available():  # Triton reads it once, when first imported (torchvision imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.harness import Stopwatch, sync  # noqa: E402
from benchmarks.tools.provenance import device_name, emit_json, versions  # noqa: E402
from infosieve_fast.data.reading import decode  # noqa: E402

NVJPEG_MEAN_TOLERANCE = 2.0  # levels of 255, as tests/test_data_stream_exact.py's GPU test
TRITON_RTOL, TRITON_ATOL = 1e-4, 1e-5  # fp32 on CUDA, as tests/test_kernels_code_head.py
TRITON_N, TRITON_L = 256, 40
INDUCTOR_N = 128
INDUCTOR_ATOL = 1e-4  # fp32 on both sides; a GEMM's accumulation order may differ (TF32 stays off: torch's default)
NO_CUDA = "skipped: no CUDA"


def run_check(check: Callable[[], dict]) -> dict:
    """`check()`'s report with its status and seconds; a raised error becomes status "failed" with its text."""
    clock = Stopwatch()
    try:
        report = check()
    except Exception as exn:  # every failure is reported, none stops the other checks
        report = {"status": "failed", "error": f"{type(exn).__name__}: {exn}"}
    return {**report, "seconds": round(clock.seconds(), 3)}


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


def small_graph(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A matmul, a reduction and pointwise ops: what Inductor lowers into a GEMM call and fused Triton (or C++)
    kernels."""
    y = torch.nn.functional.gelu(x @ w)
    return y - y.mean(dim=1, keepdim=True)


def small_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=gen).to(device) for shape in ((INDUCTOR_N, 64), (64, 32)))


def check_inductor(device: torch.device) -> dict:
    """`small_graph` compiled by Inductor (the backend `train.compile` uses), whole (fullgraph), against eager."""
    x, w = small_inputs(device)
    compiled = torch.compile(small_graph, backend="inductor", fullgraph=True)(x, w)
    diff = float((compiled - small_graph(x, w)).abs().max())
    report = {"graph": f"gelu(x @ w) - row mean, x {INDUCTOR_N}x64, fp32", "max_abs_diff": diff}
    if diff > INDUCTOR_ATOL:
        return {"status": "failed", "error": f"max abs diff {diff:.3g} > {INDUCTOR_ATOL}", **report}
    return {"status": "ok", **report}


def check_cuda_graph(device: torch.device) -> dict:
    """`small_graph` captured in a CUDA graph, replayed on new inputs copied into its static ones, against eager."""
    x, w = small_inputs(device)
    static_x = x.clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        small_graph(static_x, w)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = small_graph(static_x, w)
    static_x.copy_(x * 2)
    graph.replay()
    diff = float((static_y - small_graph(x * 2, w)).abs().max())
    report = {"graph": "small_graph captured, replayed on x * 2", "max_abs_diff": diff}
    if diff != 0:
        return {"status": "failed", "error": f"the replay differs from eager by {diff:.3g}", **report}
    return {"status": "ok", **report}


def machine(device: torch.device) -> dict:
    """What the loader and the caches depend on: /dev/shm (DataLoader workers pass batches through it), the GPU's
    free memory and its driver."""
    out: dict = {"cpu_count": os.cpu_count()}
    try:
        shm = shutil.disk_usage("/dev/shm")
        out |= {"dev_shm_gib": round(shm.total / 2**30, 2), "dev_shm_free_gib": round(shm.free / 2**30, 2)}
    except OSError as exn:
        out["dev_shm"] = f"unavailable: {exn}"
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out |= {"gpu_free_gib": round(free / 2**30, 2), "gpu_total_gib": round(total / 2**30, 2)}
        out["driver"] = _nvidia_smi("driver_version")
    return out


def _nvidia_smi(field: str) -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


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
        "inductor": run_check(lambda: check_inductor(device)),
        "cuda_graph": run_check(lambda: check_cuda_graph(device)) if device.type == "cuda" else {"status": NO_CUDA},
    }
    result = {
        "benchmark": "gpu_preflight",
        "device": device_name(device),
        "device_asked": str(wanted),
        "cuda_available": cuda,
        "versions": {**versions("torchvision", "triton", "timm"), "torch_cuda": torch.version.cuda},
        "machine": machine(device),
        "summary": {name: c["status"] for name, c in checks.items()},
        "checks": checks,
    }
    emit_json(result, args.json)
    return 1 if args.require_gpu and not cuda else 0


if __name__ == "__main__":
    sys.exit(main())
