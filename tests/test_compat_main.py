"""The documented swap (docs/compat.md "The swap", README) on a stand-in of the original training file as `__main__`.

The original trains with `python -m methods.contrastive_training.contrastive_training`, so that file is `__main__` and
its `train()` looks `SupConLoss`, `HLoss`, `NormPLoss`, `Norm0Loss` and `info_nce_loss` up in the running module. The
stand-in written here has the original's layout (`methods/contrastive_training/contrastive_training.py` with the loss
classes at module level, a `train()` that builds them, `models/vision_transformer.py` with `DINOLABELLING`); the
documented lines are pasted from the docs into its `if __name__ == "__main__":` block and the file is run the way
`-m` runs it (runpy, and once a real `python -m`) and by path. The losses `train()` built must be compat's and give the
published classes' values (benchmarks/published/model.py, the oracle of tests/test_compat.py); the lines the docs used
to show (patching an imported second copy, which silently left `train()` on the originals) must now be refused.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from benchmarks.published import model as published
from infosieve_kernels import compat

ROOT = Path(__file__).resolve().parents[1]
MODULE = "methods.contrastive_training.contrastive_training"
OLD_LINES = """\
from infosieve_kernels import compat
from methods.contrastive_training import contrastive_training as ct
compat.patch_reference(ct)
compat.patch_reference(vits)
"""  # what the docs showed before: patches a second copy of the running file

CT_TEMPLATE = '''\
"""Stand-in of the original contrastive_training.py: module-level loss classes that train() builds."""
import json
import sys
import types

import torch

from benchmarks.published.model import HLoss, Norm0Loss, NormPLoss, SupConLoss, device, info_nce_logits
from models import vision_transformer as vits


def train(labeller_head, features, labels, args):
    sup_con_crit = SupConLoss()
    L0loss = Norm0Loss()
    Boundary_Loss_m = HLoss(is_mask=True)
    Boundary_Loss_z = HLoss()
    Linfloss = NormPLoss(pnorm=1, code_weight=labeller_head.code_weight)
    unsupervised_smoothing = args.unsupervised_smoothing
    con_feats = features
    f1n, f2n = features.chunk(2)
    sup_feats = torch.cat([f1n.unsqueeze(1), f2n.unsqueeze(1)], dim=1)
    code_feat, mask, bin_raw, code, trunc_code = labeller_head(features)
    logits, targets = info_nce_logits(features=con_feats, args=args)
    pair = torch.nn.CrossEntropyLoss(label_smoothing=unsupervised_smoothing)(logits, targets)
    logits, targets = info_nce_logits(features=bin_raw, args=args, is_code=True)
    pair_codes = torch.nn.CrossEntropyLoss(label_smoothing=unsupervised_smoothing)(logits, targets)
{call_sites}
    built = dict(sup_con_crit=sup_con_crit, L0loss=L0loss, Boundary_Loss_m=Boundary_Loss_m,
                 Boundary_Loss_z=Boundary_Loss_z, Linfloss=Linfloss, labeller_head=labeller_head)
    values = dict(sup=sup_con_crit(sup_feats, labels=labels),
                  code_sup=sup_con_crit(sup_feats, labels=labels, is_code=True),
                  l0=L0loss(mask), m_cond=Boundary_Loss_m(mask), z_cond=Boundary_Loss_z(bin_raw),
                  length=Linfloss(mask), info_nce=contrastive_loss, info_nce_codes=contrastive_loss_codes,
                  pair=pair, pair_codes=pair_codes)
    return built, values


if __name__ == "__main__":
{patch}
    torch.manual_seed(0)
    args = types.SimpleNamespace(n_views=2, temperature=1.0, unsupervised_smoothing=0.5)
    features = torch.nn.functional.normalize(torch.randn(16, 32), dim=1).to(device)
    labels = torch.randint(0, 3, (8,)).to(device)
    code_weight = torch.pow(2, torch.arange(0, -40, -1, dtype=torch.float32)).to(device)
    labeller_head = vits.__dict__["DINOLABELLING"](in_dim=32, nlayers=2, bottleneck_dim=40, code_weight=code_weight,
                                                   nclasses=3).to(device)
    labeller_head.age = 0.3
    built, values = train(labeller_head, features, labels, args)
    print(json.dumps({{k: type(v).__module__ + "." + type(v).__name__ for k, v in built.items()}}))
'''


def documented_block(doc: str) -> str:
    """The fenced block of `doc` that patches the running module."""
    text = (ROOT / doc).read_text()
    blocks = [b for b in re.findall(r"```py(?:thon)?\n(.*?)```", text, flags=re.S) if "sys.modules[__name__]" in b]
    assert len(blocks) == 1, f"{doc}: expected one block that patches sys.modules[__name__], found {len(blocks)}"
    return blocks[0]


def documented_patch(doc: str) -> str:
    return "\n".join(line for line in documented_block(doc).splitlines() if line and not line.startswith("#"))


def documented_call_sites() -> str:
    """docs/compat.md's optional fused InfoNCE call sites, uncommented, as they would stand in `train()`."""
    lines = re.findall(r"^#\s+(\w+ = info_nce_loss\(.*\))$", documented_block("docs/compat.md"), flags=re.M)
    assert [line.split(" = ")[0] for line in lines] == ["contrastive_loss", "contrastive_loss_codes"], lines
    return "\n".join(lines)


@pytest.fixture
def original_layout(tmp_path, monkeypatch):
    """Write the stand-in tree under tmp_path (importable); return a writer of CT.py given its __main__ lines."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    (tmp_path / "models" / "vision_transformer.py").write_text(
        '"""Stand-in of the original vision_transformer.py."""\n'
        "from benchmarks.published.model import DINOHead, DINOLABELLING  # noqa: F401\n"
    )
    package = tmp_path / "methods" / "contrastive_training"
    package.mkdir(parents=True)
    (tmp_path / "methods" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    monkeypatch.setattr(sys, "argv", list(sys.argv))

    def write(patch: str) -> Path:
        path = package / "contrastive_training.py"
        body = CT_TEMPLATE.format(patch=textwrap.indent(patch, "    "),
                                  call_sites=textwrap.indent(documented_call_sites(), "    "))  # fmt: skip
        path.write_text(body)
        return path

    yield write
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("methods", "models"):
            del sys.modules[name]


def run_as_main(how: str, path: Path) -> dict:
    if how == "module":  # what `python -m` does: the file runs as __main__, with its module spec
        return runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
    return runpy.run_path(str(path), run_name="__main__")  # `python path/to/contrastive_training.py`


def assert_close(actual, expected, what: str) -> None:
    err = (actual.double() - expected.double()).abs().max().item()
    bound = 2e-4 * expected.double().abs().max().item() + 1e-6
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def published_values(main_globals: dict) -> dict:
    """The same losses computed with the published classes on the inputs and labeller weights the run used."""
    head = main_globals["labeller_head"]
    features, labels, args = main_globals["features"], main_globals["labels"], main_globals["args"]
    reference_head = published.DINOLABELLING(32, nlayers=2, bottleneck_dim=40, code_weight=head.code_weight, nclasses=3)
    reference_head.load_state_dict(head.state_dict())
    reference_head.to(features.device)
    reference_head.age = head.age
    _, mask, bin_raw, _, _ = reference_head(features)
    sup_feats = torch.stack(features.chunk(2), dim=1)
    pair = torch.nn.CrossEntropyLoss(label_smoothing=0.5)(*published.info_nce_logits(features, args))
    pair_codes = torch.nn.CrossEntropyLoss(label_smoothing=0.5)(*published.info_nce_logits(bin_raw, args, True))
    return dict(
        sup=published.SupConLoss()(sup_feats, labels=labels),
        code_sup=published.SupConLoss()(sup_feats, labels=labels, is_code=True),
        l0=published.Norm0Loss()(mask),
        m_cond=published.HLoss(is_mask=True)(mask),
        z_cond=published.HLoss()(bin_raw),
        length=published.NormPLoss(pnorm=1, code_weight=head.code_weight)(mask),
        info_nce=pair,
        info_nce_codes=pair_codes,
        pair=pair,
        pair_codes=pair_codes,
    )


@pytest.mark.parametrize("doc", ["docs/compat.md", "README.md"])
@pytest.mark.parametrize("how", ["module", "path"])
def test_documented_lines_swap_what_train_builds(original_layout, how, doc):
    path = original_layout(documented_patch(doc))
    main_globals = run_as_main(how, path)
    built, values = main_globals["built"], main_globals["values"]
    expected_class = {"sup_con_crit": compat.SupConLoss, "L0loss": compat.Norm0Loss, "Boundary_Loss_m": compat.HLoss,
                      "Boundary_Loss_z": compat.HLoss, "Linfloss": compat.NormPLoss,
                      "labeller_head": compat.DINOLABELLING}  # fmt: skip
    for name, cls in expected_class.items():
        assert type(built[name]) is cls, f"{name}: train() built {type(built[name])}, not compat's {cls.__name__}"
    assert main_globals["info_nce_loss"] is compat.info_nce_loss
    vits = sys.modules["models.vision_transformer"]
    assert vits.DINOLABELLING is compat.DINOLABELLING
    assert not hasattr(vits, "info_nce_loss"), "patch_reference added info_nce_loss to a module without info_nce_logits"
    for name, expected in published_values(main_globals).items():
        assert_close(values[name].detach(), expected.detach(), f"{doc} via {how}: {name}")


@pytest.mark.parametrize("how", ["module", "path"])
def test_patching_an_imported_second_copy_is_refused(original_layout, how):
    path = original_layout(OLD_LINES)
    with pytest.raises(ValueError, match=r"second copy of the running __main__ .*patch_reference\(sys\.modules\["):
        run_as_main(how, path)


@pytest.mark.parametrize("patch", ["documented", "old"])
def test_python_dash_m(original_layout, tmp_path, patch):
    """The original's own launch, a real `python -m` in a fresh interpreter (the case the runpy tests mimic)."""
    original_layout(documented_patch("docs/compat.md") if patch == "documented" else OLD_LINES)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "INFOSIEVE_KERNELS": "torch"}
    proc = subprocess.run([sys.executable, "-m", MODULE], cwd=tmp_path, env=env, capture_output=True, text=True)
    if patch == "old":
        assert proc.returncode != 0
        assert "ValueError: patch_reference: methods.contrastive_training.contrastive_training is a second copy" in (
            proc.stderr
        )
        return
    assert proc.returncode == 0, proc.stderr
    classes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(classes.values()) == {
        f"infosieve_kernels.compat.{c}" for c in ("SupConLoss", "Norm0Loss", "HLoss", "NormPLoss", "DINOLABELLING")
    }, classes


def test_only_names_the_module_has_are_patched():
    """A module without `info_nce_logits` gets no `info_nce_loss`; one with it gets it, and unpatching removes it."""
    labeller_only = types.ModuleType("vits_like")
    labeller_only.DINOLABELLING = published.DINOLABELLING
    assert compat.patch_reference(labeller_only) == {"DINOLABELLING": published.DINOLABELLING}
    assert sorted(vars(labeller_only)) == sorted(["__name__", "__doc__", "__package__", "__loader__", "__spec__",
                                                  "DINOLABELLING"])  # fmt: skip
    losses = types.ModuleType("ct_like")
    losses.info_nce_logits, losses.HLoss = published.info_nce_logits, published.HLoss
    replaced = compat.patch_reference(losses)
    assert replaced == {"HLoss": published.HLoss, "info_nce_loss": None}
    assert losses.info_nce_loss is compat.info_nce_loss and losses.HLoss is compat.HLoss
    compat.unpatch_reference(losses, replaced)
    assert not hasattr(losses, "info_nce_loss") and losses.HLoss is published.HLoss
