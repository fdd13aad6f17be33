"""train.checkpoint_blocks (infosieve_fast/network/recompute.py): the same outputs and gradients as keeping everything,
bit for bit; `cheap` recomputes the cheap ops and no matrix product, `on` the whole trained blocks, and the memory order
follows; `auto` is `cheap` only for an eager block on the GPU outside a CUDA graph capture."""

import pytest
import torch
from torch.profiler._memory_profiler import MemoryProfileTimeline
from torch.utils._python_dispatch import TorchDispatchMode

from infosieve_fast.network import recompute
from infosieve_fast.network.model import build_backbone
from tests.test_model import tiny_cfg

PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.products = self.gelus = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.products += func in PRODUCTS
        self.gelus += func is torch.ops.aten.gelu.default
        return func(*args, **(kwargs or {}))


def backbone(mode: str):
    torch.manual_seed(0)
    return build_backbone(tiny_cfg(grad_from_block=2), checkpoint_trained=mode)


def forward_backward(model, amp: bool, counter: OpCounter | None = None):
    x = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(x)
    loss = (out.float() * torch.arange(out.shape[1])).sum()
    if counter is None:
        loss.backward()
    else:
        with counter:
            loss.backward()
    return out


@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("mode", ["cheap", "on"])
def test_recomputing_gives_the_same_outputs_and_gradients_bit_for_bit(mode, amp):
    kept, recomputed = backbone("off"), backbone(mode)
    outs = [forward_backward(m, amp) for m in (kept, recomputed)]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for (name, a), b in zip(kept.named_parameters(), recomputed.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)


def test_cheap_recomputes_the_cheap_ops_and_no_product_and_on_recomputes_the_blocks():
    """The backward of `off` runs no GELU forward, nor does `auto`'s on the CPU; `cheap` runs the trained blocks' GELUs
    again (one per block) but no more matrix products than `off`; `on` also runs the trained blocks' forward products
    again, up to the last one whose output the backward needs (torch's recompute stops there: fc2's output is not
    needed)."""
    counts = {}
    for mode in ("off", "auto", "cheap", "on"):
        counts[mode] = OpCounter()
        forward_backward(backbone(mode), amp=False, counter=counts[mode])
    trained_blocks = 2  # tiny_cfg has 4 blocks; grad_from_block=2
    products_recomputed_per_block = 3  # qkv, proj, fc1
    gelus = tuple(counts[mode].gelus for mode in ("off", "auto", "cheap", "on"))
    assert gelus == (0, 0, trained_blocks, trained_blocks)
    assert counts["cheap"].products == counts["auto"].products == counts["off"].products
    assert counts["on"].products == counts["off"].products + trained_blocks * products_recomputed_per_block


def peak_bytes(mode: str) -> int:
    model = backbone(mode)
    forward_backward(model, amp=True)
    with torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
        forward_backward(model, amp=True)
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    return max(sum(s) for s in sizes)


def test_peak_memory_falls_from_off_to_cheap_to_on():
    """The CPU allocator's peak over a bf16-autocast forward+backward, from the profiler's memory timeline."""
    off, cheap, on = (peak_bytes(mode) for mode in ("off", "cheap", "on"))
    assert off > cheap > on


class OnTheGpu:
    """Stands in for a CUDA tensor: `resolved` reads only `is_cuda`."""

    is_cuda = True


def test_auto_is_cheap_for_an_eager_block_on_the_gpu_only():
    block = torch.nn.Linear(3, 3)
    assert recompute.resolved("auto", block, torch.randn(2, 3)) == "off"
    assert recompute.resolved("auto", block, OnTheGpu()) == "cheap"
    block._compiled_call_impl = block._call_impl  # what nn.Module.compile sets (a stand-in: nothing is compiled)
    assert recompute.resolved("auto", block, OnTheGpu()) == "off"
    assert [recompute.resolved(mode, block, OnTheGpu()) for mode in ("cheap", "on", "off")] == ["cheap", "on", "off"]


def test_auto_keeps_everything_inside_a_cuda_graph_capture(monkeypatch):
    """Inside a capture (`train.cuda_graph`) `auto` is `off` for an eager block on the GPU, so the captured step saves
    and restores no RNG state; outside one it is `cheap` as before, and the explicit modes are left as they are. On a
    CPU tensor the capture state is never asked (asking raises on a machine without a CUDA driver)."""
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # as it is wherever a tensor is on the GPU
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    block = torch.nn.Linear(3, 3)
    assert recompute.resolved("auto", block, OnTheGpu()) == "off"
    assert [recompute.resolved(mode, block, OnTheGpu()) for mode in ("cheap", "on", "off")] == ["cheap", "on", "off"]
    capturing[0] = False
    assert recompute.resolved("auto", block, OnTheGpu()) == "cheap"

    def no_cuda():
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", no_cuda)
    assert recompute.resolved("auto", block, torch.randn(2, 3)) == "off"


@pytest.mark.gpu_parity
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph capture needs CUDA")
def test_auto_trains_a_split_vit_in_a_real_cuda_graph_with_the_eager_gradients():
    """A forward and backward of trained blocks under `auto`, captured in a CUDA graph after eager warm-up steps on a
    side stream (as `step_graph.CudaCapture` does): the capture succeeds and a replay's gradients equal the eager
    step's (the eager steps recompute the cheap ops, the captured one keeps them: the same values), within fp32's
    default tolerance, since a GPU attention backward may sum in a different order from one run to the next."""
    model = backbone("auto").cuda()
    x = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(1)).cuda()
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        out = model(x)
        (out.float() * torch.arange(out.shape[1], device=out.device)).sum().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    eager = [p.grad.clone() for p in params]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for p in params:
        p.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for p, want in zip(params, eager, strict=True):
        torch.testing.assert_close(p.grad, want)


def test_a_compiled_block_runs_as_it_is_under_auto(monkeypatch):
    """A compiled block's partitioner already recomputes the cheap ops: `auto` calls it directly, and `on` still
    checkpoints it."""
    calls = []
    monkeypatch.setattr(recompute, "checkpoint", lambda fn, x, **kw: calls.append(kw) or fn(x))
    block = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    block._compiled_call_impl = block._call_impl  # what nn.Module.compile sets (a stand-in: nothing is compiled)
    assert recompute.is_compiled(block)
    torch.testing.assert_close(recompute.run_trained_block(block, x, "auto"), block(x), rtol=0, atol=0)
    assert calls == []
    recompute.run_trained_block(block, x, "on")
    assert calls == [{"use_reentrant": False}]


@pytest.mark.parametrize("mode", ["cheap", "on"])
def test_recomputing_needs_a_split_vit_and_auto_leaves_other_backbones_alone(mode):
    with pytest.raises(ValueError, match="needs a timm ViT backbone"):
        build_backbone(tiny_cfg(grad_from_block=None), checkpoint_trained=mode)
    assert build_backbone(tiny_cfg(grad_from_block=None), checkpoint_trained="auto").checkpoint_trained == "auto"
    with pytest.raises(ValueError, match="train.checkpoint_blocks must be one of"):
        build_backbone(tiny_cfg(grad_from_block=2), checkpoint_trained=True)
