#!/usr/bin/env python3
"""Time and peak memory of the fused Triton kernels against the eager and the `torch.compile`d PyTorch reference, in
forward, backward and full (forward + backward) modes (issue 3, "Benchmarks"). Writes JSON; asserts no thresholds.

Cases (the runner, its variants, modes and JSON fields: `benchmarks/kernel_runner.py`):
- code head (`kernels.code_head`): pre-activations [N, L], L = 40, N in {256, 1,024, 4,096, 16,384, 65,536, 1M};
  the backward takes a gradient on every output (code_raw, mask, code, trunc_code and the three loss terms);
- contrastive: InfoNCE (T = 1, smoothing 0.5) + SupCon (tau = 0.07, labels with -1 = unlabelled rows) on features
  [N, D], N in {256, ..., 65,536}, D in {40, 256, 65,536}, where they fit.
The training shapes run first (code head N = 256; contrastive N = 256 at D = 40 and 65,536), then the memory- and
compute-bound ones (code head N = 1M; contrastive N = 65,536, D = 256), then the rest, until the time budget is spent.

    python -m benchmarks.bench_kernels --device cuda --json benchmarks/results/nvidia-h200-kernels.json
    python -m benchmarks.bench_kernels --device cpu --quick --json /tmp/kernels-cpu.json
"""

from __future__ import annotations

import sys

import torch

from benchmarks import kernel_roofline
from benchmarks.kernel_runner import Case, Inputs, Op, main
from infosieve_kernels import code_head_triton, contrastive_triton, reference

L = 40
CODE_N = [256, 1024, 4096, 16384, 65536, 1 << 20]
CON_N = [256, 1024, 4096, 16384, 65536]
CON_D = [40, 256, 65536]
EAGER_NN_FLOATS = 32  # N x N fp32 temporaries alive at the eager contrastive peak (forward + backward), an upper guess
SUSTAINED_FLOPS = {"fused": 150e12, "eager": 40e12}  # pessimistic, for skipping slow cases


def code_head_inputs(device: torch.device, N: int, L: int) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(N)
    code_feat, mask_feat = (torch.randn(N, L, generator=gen, device=device).requires_grad_(True) for _ in range(2))
    weights = [reference.positional_weights(L, base, device=device) for base in (1.5, 2.0)]
    grads = [torch.randn(N, L, generator=gen, device=device) for _ in range(4)] + [torch.ones((), device=device)] * 3
    return Inputs((code_feat, mask_feat, 1.0, *weights), [code_feat, mask_feat], grads)  # age 1


def code_head_cost(variant: str, N: int, L: int) -> tuple[float, float]:
    nbytes = 4 * N * L * 20  # inputs, 4 outputs, their gradients and saved tensors, generously
    return nbytes / 1e12 + 1e-4, nbytes


def contrastive_inputs(device: torch.device, N: int, D: int) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(N * 7 + D)
    labels = torch.randint(0, max(N // 16, 2), (N // 2,), generator=gen, device=device)
    labels[torch.rand(N // 2, generator=gen, device=device) < 0.4] = -1  # unlabelled: out of this SupCon term
    features = torch.nn.functional.normalize(torch.randn(N, D, generator=gen, device=device), dim=1)
    return Inputs((features.requires_grad_(True), labels.repeat(2)), [features], None)


def contrastive_cost(variant: str, N: int, D: int) -> tuple[float, float]:
    fused = variant.startswith("fused")
    seconds = 6 * 2.0 * N * N * D / SUSTAINED_FLOPS["fused" if fused else "eager"]  # 2 losses x 3 Gram-sized GEMMs
    return seconds + 1e-4, 16 * N * D + (64 * 4 * N if fused else EAGER_NN_FLOATS * 4 * N * N)


def contrastive_loss(info_nce, supcon):
    def loss(features, labels):
        return info_nce(features, 1.0, 0.5, False) + supcon(features, labels, 0.07, 0.07, False)

    return loss


CODE_HEAD = Op(
    group="code_head",
    fused=code_head_triton.code_head,
    reference=reference.code_head,
    inputs=code_head_inputs,
    work=lambda mode, N, L: kernel_roofline.code_head_work(N, L, mode=mode),
    cost=code_head_cost,
)
CONTRASTIVE = Op(
    group="contrastive",
    fused=contrastive_loss(contrastive_triton.info_nce_loss, contrastive_triton.supcon_loss),
    reference=contrastive_loss(reference.info_nce_loss, reference.supcon_loss),
    inputs=contrastive_inputs,
    work=lambda mode, N, D: kernel_roofline.contrastive_work(N, D, mode=mode),
    cost=contrastive_cost,
)


def code_head_case(n: int, training: bool = False) -> Case:
    return Case(CODE_HEAD, {"N": n, "L": L}, training)


def contrastive_case(n: int, d: int, training: bool = False) -> Case:
    return Case(CONTRASTIVE, {"N": n, "D": d}, training)


def cases(quick: bool) -> list[Case]:
    """The cases in the order they run: the training shapes of both ops first (2 views x 128 samples: the code
    branch, L = 40, and the projection, D = 65,536), then the memory- and compute-bound ones, then the rest."""
    if quick:
        return [code_head_case(256, True), code_head_case(4096), contrastive_case(64, 40), contrastive_case(256, 256)]
    first = [code_head_case(256, True), contrastive_case(256, 40, True), contrastive_case(256, 65536, True)]
    first += [code_head_case(1 << 20), contrastive_case(65536, 256)]
    rest = [code_head_case(n) for n in CODE_N] + [contrastive_case(n, d) for n in CON_N for d in CON_D]
    seen = [(c.op.group, c.shape) for c in first]
    return first + [c for c in rest if (c.op.group, c.shape) not in seen]


if __name__ == "__main__":
    sys.exit(main(cases, description=__doc__))
