"""`infosieve report --run RUN`: one self-contained HTML page (images embedded) and the PNGs behind it.

It shows what the run folder records:
- every loss term per epoch;
- the lr, age and base schedules;
- the k-means inertia;
- All/Old/New, before and after training and at every evaluated epoch;
- the confusion matrix of the final clustering of the unlabelled train samples;
- the implicit category tree as a picture, depth-limited, in the style of the paper's Figure 2. Node area is the
  number of samples, colour is purity, and the label names the majority class.

The final clustering and the tree come from `RUN/clustering.npz` and `RUN/tree.json` when present. Otherwise they
are computed from the checkpoint.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import numpy as np

from .checkpoint import read_log

TREE_DEPTH = 4


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    return plt


def _series(log: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["epoch"] + 1, r[key]) for r in log if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_losses(log: list[dict], path: Path) -> None:
    plt = _pyplot()
    keys = sorted({k for r in log for k in r if k.startswith("loss_")})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for key in keys:
        part = key.endswith(("_infonce", "_supcon_gt", "_supcon_pseudo"))  # of the contrastive terms
        ax = axes[1] if part else axes[0]
        ax.plot(*_series(log, key), marker=".", label=key.removeprefix("loss_"))
    for ax, title in zip(axes, ("loss terms (weighted into the total)", "parts of the contrastive terms"), strict=True):
        ax.set(title=title, xlabel="epoch", yscale="log")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_schedules(log: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(14, 3))
    for ax, key in zip(axes, ("lr", "age", "base", "kmeans_inertia"), strict=True):
        ax.plot(*_series(log, key), marker=".")
        ax.set(title=key if key != "kmeans_inertia" else "k-means inertia", xlabel="epoch")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_accuracy(log: list[dict], metrics: dict | None, path: Path) -> None:
    """Unlabelled train samples (solid: before, `train.eval_every` epochs, after) and the test split (dashed)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    last = max((r["epoch"] + 1 for r in log), default=0)
    for part, colour in (("all", "k"), ("old", "tab:blue"), ("new", "tab:orange")):
        pts = [(r["epoch"] + 1, r["eval"][part]) for r in log if isinstance(r.get("eval"), dict)]
        if metrics is not None:
            pts = [(0, metrics["before"][part]), *pts, (last, metrics["after"][part])]
        if pts:
            ax.plot(*zip(*sorted(set(pts)), strict=True), marker="o", color=colour, label=part.capitalize())
        test = [(r["epoch"] + 1, r["eval_test"][part]) for r in log if isinstance(r.get("eval_test"), dict)]
        if test:
            ax.plot(*zip(*test, strict=True), marker="x", ls="--", color=colour, label=f"{part.capitalize()} (test)")
    ax.set(title="All / Old / New", xlabel="epoch (0 = before training)", ylim=(0, 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_confusion(targets: np.ndarray, preds: np.ndarray, n_old: int, path: Path) -> None:
    """Rows: true classes (known first); columns: clusters in the Hungarian-matched order."""
    from scipy.optimize import linear_sum_assignment

    plt = _pyplot()
    n_cls, n_clu = int(targets.max()) + 1, int(preds.max()) + 1
    counts = np.zeros((n_cls, n_clu), np.int64)
    np.add.at(counts, (targets, preds), 1)
    rows, cols = linear_sum_assignment(-counts)
    order = list(cols[np.argsort(rows)]) + [c for c in range(n_clu) if c not in set(cols)]
    fig, ax = plt.subplots(figsize=(6, 5.5))
    im = ax.imshow(counts[:, order] / np.maximum(counts.sum(1, keepdims=True), 1), cmap="viridis", vmin=0, vmax=1)
    ax.axhline(n_old - 0.5, color="w", lw=1)
    ax.set(title="final clustering of the unlabelled samples (row-normalised)", xlabel="cluster (matched order)",
           ylabel="true class (known above the line)")  # fmt: skip
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _layout(tree: dict, depth: int) -> tuple[list[tuple[dict, float, int]], list[tuple[float, float, float, float]]]:
    """Nodes (node, x, level) down to `depth`, leaves spread evenly and parents centred over their children, and the
    edges (x0, y0, x1, y1)."""
    nodes, edges = [], []
    next_x = [0.0]

    def walk(node: dict, level: int) -> float:
        kids = [c for c in node["children"] if len(c["prefix"]) <= depth]
        if kids:
            xs = [walk(child, level + 1) for child in kids]
            x = float(np.mean(xs))
            edges.extend((x, -level, cx, -level - 1) for cx in xs)
        else:
            x, next_x[0] = next_x[0], next_x[0] + 1.0
        nodes.append((node, x, level))
        return x

    walk(tree, 0)
    return nodes, edges


def node_label(node: dict, class_names: list[str] | None) -> str:
    """A tree node's caption: its prefix, its majority class (by name when known) and its size. `node["classes"]`
    maps class index to count; its keys are strings once the tree has been through JSON."""
    top = int(max(node["classes"], key=node["classes"].get)) if node["classes"] else None
    name = class_names[top] if class_names is not None and top is not None else str(top)
    return f"{node['prefix'] or 'root'}\n{name[:14]}\nn={node['n']}"


def plot_tree(tree: dict, path: Path, depth: int = TREE_DEPTH) -> None:
    """The code-prefix tree: one node per prefix down to `depth`; area ~ samples, colour = purity, label = majority
    class (by the names `infosieve tree` stores in the tree, else by index)."""
    plt = _pyplot()
    names = tree.get("class_names")
    nodes, edges = _layout(tree, depth)
    width = max(x for _, x, _ in nodes) + 1
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * width), 1.6 * (depth + 1) + 1))
    cmap = plt.get_cmap("RdYlGn")
    total = max(tree["n"], 1)
    for x0, y0, x1, y1 in edges:
        ax.plot([x0, x1], [y0, y1], color="0.6", lw=1, zorder=1)
    for node, x, level in nodes:
        area = 60 + 2400 * node["n"] / total  # points²: a circle of diameter sqrt(area) points
        ax.scatter([x], [-level], s=area, color=cmap(node["purity"]), edgecolor="k", zorder=2)
        ax.annotate(node_label(node, names), (x, -level), ha="center", va="top", xytext=(0, -(area**0.5 / 2 + 3)),
                    textcoords="offset points", fontsize=7)  # fmt: skip
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, 1))
    fig.colorbar(sm, ax=ax, fraction=0.03, label="purity (majority class share)")
    ax.set(title=f"implicit category tree: code prefixes to depth {depth}", xlim=(-0.7, width - 0.3),
           ylim=(-depth - 0.9, 0.5))  # fmt: skip
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"><figcaption>' \
           f"{html.escape(alt)}</figcaption></figure>"  # fmt: skip


def write_report(run_dir: str | Path, clustering: dict | None = None, tree: dict | None = None,
                 depth: int = TREE_DEPTH) -> Path:  # fmt: skip
    """Write `RUN/report.html` and `RUN/report/*.png`; returns the HTML's path.

    `clustering`: {"targets", "preds", "n_old"} of the unlabelled train samples; `tree`: `tree.build_tree`'s output.
    Missing ones are read from the run folder (`clustering.npz`, `tree.json`) or left out of the page with a note."""
    run = Path(run_dir)
    log_path = run / "log.jsonl"
    if not log_path.is_file():
        raise FileNotFoundError(f"{log_path} not found: pass a run folder written by `infosieve train`")
    log = read_log(log_path)
    metrics = json.loads((run / "metrics.json").read_text()) if (run / "metrics.json").is_file() else None
    if clustering is None and (run / "clustering.npz").is_file():
        with np.load(run / "clustering.npz") as z:
            clustering = {k: z[k] for k in z.files}
    if tree is None and (run / "tree.json").is_file():
        tree = json.loads((run / "tree.json").read_text())
    out = run / "report"
    out.mkdir(exist_ok=True)
    figures = [("losses.png", "every loss term per epoch", lambda p: plot_losses(log, p)),
               ("schedules.png", "lr, age and base schedules; k-means inertia", lambda p: plot_schedules(log, p)),
               ("accuracy.png", "All / Old / New", lambda p: plot_accuracy(log, metrics, p))]  # fmt: skip
    notes = []
    if clustering is not None:
        figures.append(("confusion.png", "confusion matrix of the final clustering (unlabelled samples)",
                        lambda p: plot_confusion(np.asarray(clustering["targets"]), np.asarray(clustering["preds"]),
                                                 int(clustering["n_old"]), p)))  # fmt: skip
    else:
        notes.append("no final clustering recorded (the run has not finished)")
    if tree is not None:
        figures.append(("tree.png", f"implicit category tree to depth {depth}",
                        lambda p: plot_tree(tree, p, depth)))  # fmt: skip
    else:
        notes.append("no tree.json: run `infosieve tree --run RUN` first")
    body = []
    for name, caption, draw in figures:
        draw(out / name)
        body.append(_img(out / name, caption))
    table = ""
    if metrics is not None:
        rows = "".join(f"<tr><td>{s}</td>" + "".join(f"<td>{metrics[s][k]:.4f}</td>" for k in ("all", "old", "new"))
                       + "</tr>" for s in ("before", "after"))  # fmt: skip
        table = f"<table><tr><th></th><th>All</th><th>Old</th><th>New</th></tr>{rows}</table>"
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>infosieve report</title><style>"
        "body{font-family:sans-serif;max-width:1300px;margin:auto}img{max-width:100%}td,th{padding:2px 10px}"
        f"</style></head><body><h1>{html.escape(str(run))}</h1>{table}"
        + "".join(f"<p><em>{html.escape(n)}</em></p>" for n in notes)
        + "".join(body)
        + "</body></html>"
    )
    path = run / "report.html"
    path.write_text(page)
    return path
