"""`train.compile`'s default path through the real Inductor backend on the CPU: the probe lowers every graph a run
uses (the step's forward and backward, the feature passes on images and on the token cache's tokens) to C++ code, and
the compiled modules then agree with eager ones over training steps and feature passes.

tests/test_compiling.py traces with Dynamo's eager backend, which builds the graphs but never lowers them; a lowering
that fails (an op Inductor cannot generate code for) only shows here, or on the GPU. Inductor's CPU backend needs a
C++ compiler.

Tolerance: Inductor fuses the cheap ops into their neighbours and reorders fp32 sums (LayerNorm, softmax, the
matrix products' epilogues), so compiled and eager results agree to fp32 rounding accumulated over the blocks, not
bit for bit; a wrong lowering (a wrong op, a dropped term) differs at the size of the values themselves. Each tensor
may differ by 2e-5 of its largest magnitude: the largest differences measured on this machine were 1.5e-6 (outputs),
1.7e-6 (gradients) and 4.1e-7 (features). The loss is not compared: its code-length choices are discrete, so rounding
can flip one (measured: up to 6.2e-5 of the loss); the outputs it is computed from are.

On CUDA (gpu_check.sh's parity step) the same test runs the step under bf16 autocast, lowered to Triton: compiled
code keeps fused intermediates in fp32 where eager rounds every op's output to bf16 (unit roundoff 2^-8, about
3.9e-3), so each tensor may differ by 3e-2 of its largest magnitude, a few roundoffs accumulated over the blocks and
still far below a wrong lowering's error. That bound has not yet been checked on a GPU."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from infosieve_fast.config.settings import load_config
from infosieve_fast.network.compiling import COMPILED, compile_with_fallback, compiled_modules
from infosieve_fast.training.engine import Trainer
from infosieve_fast.training.loss_monitor import LossMonitor

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="Inductor's CPU backend needs a C++ compiler"
)

CUDA = torch.device("cuda")  # compile_with_fallback compiles only for CUDA; on the CPU the modules stay there
STEPS = 3
TOLERANCE = {"cpu": 2e-5, "cuda": 3e-2}  # of each tensor's largest magnitude: fp32 on the CPU, bf16 autocast on CUDA
# 72 samples: each feature pass ends with a batch of 8, padded to 32 when compiled
TINY_SPLIT_VIT = [
    "train.train_subset=72", "data.batch_size=16", "data.feature_batch_size=32",
    "kmeans.n_init=1", "model.proj_out_dim=64", "model.proj_hidden_dim=32", "model.proj_bottleneck_dim=16",
    "model.backbone=vit_tiny_patch16_224", 'model.backbone_kwargs={"img_size": 32, "in_chans": 1, "depth": 4}',
    "model.grad_from_block=2",
]  # fmt: skip


def assert_near(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    bound = TOLERANCE[want.device.type] * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=bound, msg=lambda m: f"{what}: {m}")


def forward_backward(trainer: Trainer, views: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """The step's forward, and its backward from fixed random output gradients (the loss's own backward passes
    through discrete choices, the code lengths, which rounding can flip); the gradients are left on the parameters."""
    trainer.optimizer.zero_grad(set_to_none=True)
    with trainer.autocast():
        out = trainer.net(views)
    draw = torch.Generator().manual_seed(seed)
    outputs = [out.backbone, out.projection]
    torch.autograd.backward(outputs, [torch.randn(o.shape, generator=draw).to(o) for o in outputs])
    return {"backbone": out.backbone.detach(), "projection": out.projection.detach()}


@pytest.mark.slow  # lowering every graph to C++: 1 to 3 minutes on 2 busy cores (warm or cold compile cache)
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu_parity,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton lowering needs CUDA"),
            ],
        ),
    ],
)
def test_inductor_lowers_every_probed_graph_and_matches_eager(device):
    torch._dynamo.reset()
    cfg = load_config("configs/demo.yaml", [f"train.device={device}", *TINY_SPLIT_VIT])
    eager, compiled = Trainer(cfg), Trainer(cfg)
    modules = compiled_modules(compiled.model)
    compiled.evaluator.compiled = compile_with_fallback(modules, "on", CUDA, compiled._trace_graphs)  # `on`: raises
    assert compiled.compiled.path == COMPILED
    assert compiled.compiled.graphs == {"Block": COMPILED, "ProjectionHead": COMPILED}
    graphs = counters["stats"]["unique_graphs"]  # every graph below was lowered by the probe: none compiles later

    pseudo = (torch.arange(compiled.source.n_train) % compiled.source.n_classes).to(compiled.device)
    gen = torch.Generator(compiled.device).manual_seed(0)
    step_gen = torch.Generator(compiled.device).manual_seed(1)
    monitor = LossMonitor(0)
    for step, batch in enumerate(itertools.islice(compiled.source.train_batches(16, epoch=0, seed=0), STEPS)):
        views = compiled.augment.train_views(batch.images, 2, gen, batch.sizes)
        eager.model.load_state_dict(compiled.model.state_dict())  # the same weights at every step
        want, got = (forward_backward(t, views, step) for t in (eager, compiled))
        for key in want:
            assert_near(got[key], want[key], key)
        for (name, e), c in zip(eager.model.named_parameters(), compiled.model.parameters(), strict=True):
            if e.grad is not None and (name.startswith("projection") or ".blocks." in name):
                assert_near(c.grad, e.grad, f"gradient of {name}")
        compiled.train_step(batch, pseudo, step_gen, monitor)  # a real step (its loss, the update) moves on
    assert monitor.check() > 0 and monitor.steps == STEPS

    eager.model.load_state_dict(compiled.model.state_dict())
    for _ in range(2):  # the first test-view pass records the frozen prefix's tokens, the second replays them
        want_fs, got_fs = eager.evaluator.features("test"), compiled.evaluator.features("test")
        assert torch.equal(got_fs.uq, want_fs.uq)
        assert_near(got_fs.feats, want_fs.feats, "features")
    assert compiled.token_cache.replay("train") is not None
    assert counters["stats"]["unique_graphs"] == graphs
