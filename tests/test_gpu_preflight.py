"""`benchmarks/tools/gpu_preflight.py`: every check reports instead of raising, and each can fail."""

from __future__ import annotations

import json
import shutil

import torch

from benchmarks.tools import gpu_preflight as pf
from infosieve_fast.data.reading import decode
from infosieve_kernels import code_head_triton, reference


def test_the_preflight_runs_here_and_writes_its_json(tmp_path, device):
    out = tmp_path / "preflight.json"
    assert pf.main(["--device", device.type, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    cuda = device.type == "cuda"
    on_gpu = "ok" if cuda else "skipped: no CUDA"
    assert res["summary"] == {"gpu": on_gpu, "nvjpeg": on_gpu, "triton": "ok", "inductor": "ok", "cuda_graph": on_gpu}
    assert 0 <= res["checks"]["inductor"]["max_abs_diff"] <= pf.INDUCTOR_ATOL
    shm = shutil.disk_usage("/dev/shm")
    assert res["machine"]["dev_shm_gib"] == round(shm.total / 2**30, 2) and res["machine"]["cpu_count"] >= 1
    triton = res["checks"]["triton"]
    assert triton["interpreter"] == (not cuda) and set(triton["max_abs_diff"]) == set(reference.CodeHead._fields)
    assert all(0 <= d <= 1e-4 for d in triton["max_abs_diff"].values())
    assert res["versions"]["torch"] == torch.__version__ and res["tree_hash"]
    if cuda:
        assert res["checks"]["gpu"]["name"] == torch.cuda.get_device_name(device)
        assert res["checks"]["nvjpeg"]["mean_abs_diff"] < pf.NVJPEG_MEAN_TOLERANCE
        assert res["checks"]["cuda_graph"]["max_abs_diff"] == 0 and 0 < res["machine"]["gpu_free_gib"]


def test_exit_status_depends_only_on_require_gpu(tmp_path, device):
    cuda = device.type == "cuda"
    assert pf.main(["--device", device.type, "--require-gpu", "--json", str(tmp_path / "a.json")]) == (0 if cuda else 1)
    if not cuda:  # asked for a GPU that is not there: the gpu check says so, the rest runs on the CPU
        assert pf.main(["--device", "cuda", "--json", str(tmp_path / "b.json")]) == 0
        res = json.loads((tmp_path / "b.json").read_text())
        assert res["checks"]["gpu"] == {"status": "failed", "error": "--device cuda, but torch sees no CUDA device"}
        assert res["summary"]["triton"] == "ok"


def test_a_wrong_kernel_output_fails_the_triton_check(monkeypatch, device):
    def off_by_a_little(*args):
        out = reference.code_head(*args)
        return out._replace(code_raw=out.code_raw + 1e-3)

    monkeypatch.setattr(code_head_triton, "code_head", off_by_a_little)
    report = pf.run_check(lambda: pf.check_triton(device))
    assert report["status"] == "failed" and "['code_raw']" in report["error"]
    assert abs(report["max_abs_diff"]["code_raw"] - 1e-3) < 1e-6 and report["max_abs_diff"]["mask"] == 0


def test_the_nvjpeg_check_compares_with_the_cpu_decode_and_never_raises(monkeypatch):
    """Run with the CPU as its device (`nvjpeg_decode` then uses the CPU decoder: difference 0), then with the device
    decode faked broken and faked wrong."""
    cpu = torch.device("cpu")
    ok = pf.run_check(lambda: pf.check_nvjpeg(cpu))
    assert ok["status"] == "ok" and ok["max_abs_diff"] == 0 and ok["shape"] == ok["cpu_shape"] == [3, 64, 96]

    def broken(jpegs, device):
        raise RuntimeError("nvjpegCreate failed (faked)")

    monkeypatch.setattr(decode, "nvjpeg_decode", broken)
    assert pf.run_check(lambda: pf.check_nvjpeg(cpu))["error"] == "RuntimeError: nvjpegCreate failed (faked)"

    def brighter(jpegs, device):
        return [(decode.decode_cpu(j).int() + 3).clamp(0, 255).to(torch.uint8) for j in jpegs]

    monkeypatch.setattr(decode, "nvjpeg_decode", brighter)
    wrong = pf.run_check(lambda: pf.check_nvjpeg(cpu))
    assert wrong["status"] == "failed" and wrong["max_abs_diff"] == 3 and wrong["mean_abs_diff"] >= 2


def test_a_wrong_compiled_graph_fails_the_inductor_check(monkeypatch, device):
    """The check compares the compiled graph with eager: a compiler that returns something else is caught, and a
    compiler that raises is reported, never raised."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda x, w: fn(x, w) + 1e-3)
    wrong = pf.run_check(lambda: pf.check_inductor(device))
    assert wrong["status"] == "failed" and abs(wrong["max_abs_diff"] - 1e-3) < 1e-6

    def lowering_fails(fn, **kw):
        raise RuntimeError("InductorError: lowering failed (faked)")

    monkeypatch.setattr(torch, "compile", lowering_fails)
    failed = pf.run_check(lambda: pf.check_inductor(device))
    assert failed == {"status": "failed", "error": "RuntimeError: InductorError: lowering failed (faked)", **failed}
