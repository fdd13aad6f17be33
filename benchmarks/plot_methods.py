"""The GCD methods side by side (docs/methods.md): All/Old/New (v2) after training, mean with sample-sd error bars,
one panel per `infosieve compare --json` file, one group of bars per entry (method); a black tick over a bar marks the
same part before training, where the file records it.

    python -m benchmarks.plot_methods --out docs/methods.png

Reads the committed comparisons (`PANELS`, or the files given); nothing is trained.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.tools.provenance import ROOT

RESULTS = ROOT / "benchmarks" / "results"
PANELS = {
    "methods_demo_cpu.json": "digits, resnet10t from scratch, 3 epochs",
    "methods_demo_12_epochs_cpu.json": "digits, resnet10t from scratch, 12 epochs (the demo's)",
    "methods_cub100_heldout_60-79_cpu.json": "cub100 held-out species 60-79, EfficientNet-Lite0",
}
PARTS = ("all", "old", "new")


def method_names(labels: list[str]) -> list[str]:
    """The entries' labels without what they share: 'methods-demo-gcd: (no grid)' among others -> 'gcd'."""
    names = [label.removesuffix(": (no grid)") for label in labels]
    prefix = os.path.commonprefix(names) if len(names) > 1 else ""
    prefix = prefix[: prefix.rfind("-") + 1]  # whole words only
    return [name[len(prefix) :] for name in names]


def bars(result: dict) -> list[dict]:
    """Per entry of a compare file: its method name, and per part the v2 mean and sd after training, and the mean
    before training (None where the file has no `before`)."""
    names = method_names([e["label"] for e in result["entries"]])
    out = []
    for name, entry in zip(names, result["entries"], strict=True):
        after, before = entry["accuracy"]["v2"], entry.get("before") or {}
        out.append(
            {
                "method": name,
                "mean": [after[p]["mean"] for p in PARTS],
                "sd": [after[p]["sd"] or 0.0 for p in PARTS],
                "before": [(before.get(p) or {}).get("mean") for p in PARTS],
            }
        )
    return out


def plot(panels: dict[Path, str], out: Path) -> None:
    from infosieve_fast.commands.report import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.6), squeeze=False)
    width = 0.26
    for ax, (path, title) in zip(axes[0], panels.items(), strict=True):
        groups = bars(json.loads(path.read_text()))
        for i, part in enumerate(PARTS):
            xs = [g + (i - 1) * width for g in range(len(groups))]
            ax.bar(xs, [b["mean"][i] for b in groups], width, yerr=[b["sd"][i] for b in groups], capsize=3,
                   label=part.capitalize(), color=f"C{i}")  # fmt: skip
            ticks = [(x, b["before"][i]) for x, b in zip(xs, groups, strict=True) if b["before"][i] is not None]
            if ticks:
                ax.hlines([y for _, y in ticks], [x - width / 2 for x, _ in ticks], [x + width / 2 for x, _ in ticks],
                          colors="black", linewidth=2, label="before training" if i == 0 else None)  # fmt: skip
        ax.set_xticks(range(len(groups)), [b["method"] for b in groups])
        ax.set_ylim(0, 1.18)  # the legend sits in the band above 1, clear of the bars
        ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
        ax.set_ylabel("accuracy (v2), mean ± sd")
        ax.set_title(f"{title}\n({path.name})", fontsize=9)
        ax.legend(fontsize=7, loc="upper center", ncol=4)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="*", type=Path, help="compare --json files (default: the committed ones)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    panels = {p: p.stem for p in args.results} or {RESULTS / name: title for name, title in PANELS.items()}
    missing = [str(p) for p in panels if not p.is_file()]
    if missing:
        parser.error(f"no compare file at {', '.join(missing)}: pass files written by `infosieve compare --json`")
    plot(panels, args.out)
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
