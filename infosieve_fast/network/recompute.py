"""`train.checkpoint_blocks`: what the trained ViT blocks keep for the backward pass.

- `cheap`: keep the outputs of the matrix products and of attention, and recompute the cheap ops between them
  (norms, activations, residual adds, casts) in the backward pass, with torch's selective activation checkpointing.
- `auto` (the default): `cheap` for a block on the GPU, except one that `train.compile` compiled (its graph's
  partitioner already recomputes such ops instead of keeping them) and one that runs inside a CUDA graph capture
  (`train.cuda_graph`, `step_graph.py`); `off` there and on the CPU, where memory is plentiful and the selective
  checkpointing's per-op dispatch made the CPU step a little slower (a few percent, interleaved runs). Under a
  capture, checkpointing (`cheap` and `on` alike) saves the CUDA RNG state in the forward pass and restores it in the
  backward pass, which no GPU run has yet shown a capture to accept; `off` keeps no RNG state, so a captured step is
  safe. Only the captured step changes: the eager warm-up steps before it, and uncaptured runs, still use `cheap`.
- `on`: keep only each trained block's input and recompute the whole block in the backward pass (one more forward of
  the trained blocks: the least memory).
- `off`: keep every activation (the reference).

The recomputed ops run again on the same inputs, so outputs and gradients equal the `off` ones bit for bit.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("auto", "cheap", "on", "off")
ALWAYS_RECOMPUTING = ("cheap", "on")  # the modes that recompute wherever they run: they need trained ViT blocks

_aten = torch.ops.aten
_ATTENTION = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
# the expensive ops, whose outputs `cheap` keeps; everything else in a trained block is recomputed
KEPT_OPS = frozenset(
    [_aten.mm.default, _aten.addmm.default, _aten.bmm.default]
    + [getattr(_aten, name).default for name in _ATTENTION if hasattr(_aten, name)]
)


def _keep_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_cheap_recompute = functools.partial(create_selective_checkpoint_contexts, _keep_products)


def is_compiled(module: nn.Module) -> bool:
    """Whether `nn.Module.compile` compiled `module` (calls go to its compiled forward)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def resolved(mode: str, block: nn.Module, x: Tensor) -> str:
    """What `auto` means for `block` on `x`'s device, in or out of a CUDA graph capture; any other mode as it is."""
    if mode != "auto":
        return mode
    capturing = x.is_cuda and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    return "cheap" if x.is_cuda and not is_compiled(block) and not capturing else "off"


def run_trained_block(block: nn.Module, x: Tensor, mode: str) -> Tensor:
    """`block(x)`, keeping for the backward pass what `mode` says (module docstring)."""
    mode = resolved(mode, block, x)
    if mode == "off" or not torch.is_grad_enabled():
        return block(x)
    if mode == "cheap":
        return checkpoint(block, x, use_reentrant=False, context_fn=_cheap_recompute)
    return checkpoint(block, x, use_reentrant=False)
