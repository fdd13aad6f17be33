"""`infosieve report --run RUN`: one self-contained HTML page (images embedded) and the PNGs behind it.

It shows what the run folder records:
- every loss term per epoch;
- the lr, age and base schedules;
- the k-means inertia;
- All/Old/New, before and after training and at every evaluated epoch;
- the confusion matrix of the final clustering of the unlabelled train samples;
- the implicit category tree as a picture, depth-limited, in the style of the paper's Figure 2. Node area is the
  number of samples, colour is purity, and the label names the majority class. Only InfoSieve learns the codes the
  tree is made of: for another `method:` the page says so in one line.
On a run of your own images (`make-shards --dataset discovery`: an unlabelled pool with no labels) the parts of
All/Old/New that no label can score read "not computed", with the reason, and a section shows what is knowable
instead: the held-out accuracy and the clusters with their names, sizes and margins (`discovery.py`), and a gallery
of every cluster, novel ones first, with each novel cluster's nearest known classes in the features and, for
InfoSieve, its place in the category tree (`gallery.py`; its thumbnails are JPEG files under RUN/report/thumbs/, so
that page is not self-contained). Every method has the gallery.

The final clustering and the tree come from `RUN/clustering.npz` and `RUN/tree.json` when present (the tree only
while it is of the run's checkpoint: a run trained on after `infosieve tree` gets a note saying how to refresh it, not
the old tree drawn as current). Otherwise they are computed from the checkpoint (the tree of a run with an unlabelled
pool: by the gallery's pass). The notes that ask the user to act are printed on the console as well.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import numpy as np

from ..analysis.cluster_names import checkpoint_names
from ..analysis.run_reader import checkpoint_name, describe_run
from ..analysis.run_results import saved_tree
from ..common.files import read_log
from ..common.labels import NO_LABEL
from ..config.settings import load_config
from ..evaluation.discovery import pool_section, unscored_notes, unscored_parts
from ..methods import METHODS
from ..training.checkpoint import load_checkpoint
from ..training.run_files import read_clustering

TREE_DEPTH = 4
TICKS_THAT_FIT = 40  # rows or columns of the confusion matrix that each get a labelled tick


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    return plt


def series(log: list[dict], key: str, part: str | None = None) -> tuple[list[int], list[float]]:
    """Epochs (1-based) and values of log.jsonl's `key`, or of its entry `part` when the key holds a dict (`eval`,
    `eval_codes`); epochs without it are left out."""
    values = [(r["epoch"] + 1, r.get(key) if part is None else (r.get(key) or {}).get(part)) for r in log]
    pts = [(epoch, v) for epoch, v in values if v is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def accuracy_points(log: list[dict], metrics: dict | None, part: str) -> list[tuple[int, float]]:
    """(epoch, accuracy) of `part` ("all", "old" or "new") on the unlabelled train samples: before training (epoch
    0, from metrics.json), every `train.eval_every` epochs (log.jsonl's `eval`) and after training (metrics.json)."""
    last = max((r["epoch"] + 1 for r in log), default=0)
    pts = [(r["epoch"] + 1, r["eval"][part]) for r in log if isinstance(r.get("eval"), dict)]
    if metrics is not None:
        pts = [(0, metrics["before"][part]), *pts, (last, metrics["after"][part])]
    return sorted(set(pts))


def plot_losses(log: list[dict], path: Path) -> None:
    plt = pyplot()
    keys = sorted({k for r in log for k in r if k.startswith("loss_")})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for key in keys:
        part = key.endswith(("_infonce", "_supcon_gt", "_supcon_pseudo"))  # of the contrastive terms
        ax = axes[1] if part else axes[0]
        ax.plot(*series(log, key), marker=".", label=key.removeprefix("loss_"))
    for ax, title in zip(axes, ("loss terms (weighted into the total)", "parts of the contrastive terms"), strict=True):
        ax.set(title=title, xlabel="epoch", yscale="log")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_schedules(log: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(14, 3))
    for ax, key in zip(axes, ("lr", "age", "base", "kmeans_inertia"), strict=True):
        ax.plot(*series(log, key), marker=".")
        ax.set(title=key if key != "kmeans_inertia" else "k-means inertia", xlabel="epoch")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_accuracy(log: list[dict], metrics: dict | None, path: Path, unscored=()) -> None:
    """Unlabelled train samples (solid: before, `train.eval_every` epochs, after) and the test split (dashed);
    `unscored`: the parts no label could score (left out, not drawn as zeros)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for part, colour in (("all", "k"), ("old", "tab:blue"), ("new", "tab:orange")):
        if part in unscored:
            continue
        pts = accuracy_points(log, metrics, part)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", color=colour, label=part.capitalize())
        test = [(r["epoch"] + 1, r["eval_test"][part]) for r in log if isinstance(r.get("eval_test"), dict)]
        if test:
            ax.plot(*zip(*test, strict=True), marker="x", ls="--", color=colour, label=f"{part.capitalize()} (test)")
    ax.set(title="All / Old / New", xlabel="epoch (0 = before training)", ylim=(0, 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_confusion(
    targets: np.ndarray, preds: np.ndarray, n_old: int, path: Path, class_names: list[str] | None = None
) -> None:
    """`confusion_figure` as a PNG at `path`."""
    fig = confusion_figure(targets, preds, n_old, class_names)
    fig.savefig(path, dpi=90)
    pyplot().close(fig)


def confusion_figure(targets: np.ndarray, preds: np.ndarray, n_old: int, class_names: list[str] | None = None):
    """Rows: true classes (known first, by name where `class_names` are given and fit); columns: clusters in the
    Hungarian-matched order, by cluster number where they fit. The line between known and novel classes is drawn
    only when there are both."""
    from matplotlib.ticker import MaxNLocator
    from scipy.optimize import linear_sum_assignment

    plt = pyplot()
    n_cls, n_clu = int(targets.max()) + 1, int(preds.max()) + 1
    counts = np.zeros((n_cls, n_clu), np.int64)
    np.add.at(counts, (targets, preds), 1)
    rows, cols = linear_sum_assignment(-counts)
    order = list(cols[np.argsort(rows)]) + [c for c in range(n_clu) if c not in set(cols)]
    fig, ax = plt.subplots(figsize=(6, 5.5))
    share = counts[:, order] / np.maximum(counts.sum(1, keepdims=True), 1)
    im = ax.imshow(share, cmap="viridis", vmin=0, vmax=1, aspect="auto")  # auto: cells fill the room the names leave
    ylabel = "true class"
    if 0 < n_old < n_cls:
        ax.axhline(n_old - 0.5, color="w", lw=1)
        ylabel += " (known above the line)"
    if n_cls <= TICKS_THAT_FIT:
        names = class_names[:n_cls] if class_names is not None and len(class_names) >= n_cls else range(n_cls)
        ax.set_yticks(range(n_cls), [str(name)[:16].replace("$", r"\$") for name in names], fontsize=7)
    else:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if n_clu <= TICKS_THAT_FIT:
        ax.set_xticks(range(n_clu), [str(c) for c in order], fontsize=7, rotation=90 if n_clu > 12 else 0)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle("final clustering of the unlabelled samples (row-normalised)")  # centred on the figure, not the axes
    ax.set(
        xlabel="cluster (matched order)" if n_clu <= TICKS_THAT_FIT else "position in the matched order of clusters",
        ylabel=ylabel,
    )
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig


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
    name = "no labels" if top is None else class_names[top] if class_names is not None else str(top)
    return f"{node['prefix'] or 'root'}\n{name[:14]}\nn={node['n']}"


def plot_tree(tree: dict, path: Path, depth: int = TREE_DEPTH) -> None:
    """The code-prefix tree: one node per prefix down to `depth`; area ~ samples, colour = purity, label = majority
    class (by the names `infosieve tree` stores in the tree, else by index)."""
    plt = pyplot()
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
        colour = "0.85" if node["purity"] is None else cmap(node["purity"])  # None: no member has a label
        ax.scatter([x], [-level], s=area, color=colour, edgecolor="k", zorder=2)
        ax.annotate(
            node_label(node, names),
            (x, -level),
            ha="center",
            va="top",
            xytext=(0, -(area**0.5 / 2 + 3)),
            textcoords="offset points",
            fontsize=7,
        )
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, 1))
    fig.colorbar(sm, ax=ax, fraction=0.03, label="purity (majority class share)")
    ax.set(
        title=f"implicit category tree: code prefixes to depth {depth}",
        xlim=(-0.7, width - 0.3),
        ylim=(-depth - 0.9, 0.5),
    )
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def figure_html(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (
        f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"><figcaption>'
        f"{html.escape(alt)}</figcaption></figure>"
    )


def html_page(title: str, body: str) -> str:
    """A self-contained page around `body` (HTML), in the style `infosieve report` and `infosieve compare` share."""
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;max-width:1300px;margin:auto}img{max-width:100%}td,th{padding:2px 10px}"
        "table{border-collapse:collapse}tr:nth-child(even){background:#f4f4f4}"
        f"</style></head><body>{body}</body></html>"
    )


def write_report(
    run_dir: str | Path,
    clustering: dict | None = None,
    tree: dict | None = None,
    depth: int = TREE_DEPTH,
    checkpoint: str = "last",
) -> Path:
    """Write `RUN/report.html` and `RUN/report/*.png`; returns the HTML's path.

    `clustering`: {"targets", "preds", "n_old"} of the unlabelled train samples; `tree`: `tree.build_tree`'s output.
    Missing ones are read from the run folder (`clustering.npz`, `tree.json` while it is of the run's checkpoint:
    `run_results.saved_tree`) or left out of the page with a note. `checkpoint="best"`: the clustering, the tree and
    an All/Old/New row are computed from RUN/checkpoint-best.pt (`best_checkpoint_view`); the page names the
    checkpoint it shows either way. The notes that ask the user to act (run `infosieve tree`, let the run finish, fix
    the gallery's images) are printed too, one line each."""
    run = Path(run_dir)
    log_path = run / "log.jsonl"
    if not log_path.is_file():
        raise FileNotFoundError(f"{log_path} not found: pass a run folder written by `infosieve train`")
    log = read_log(log_path)
    metrics = json.loads((run / "metrics.json").read_text()) if (run / "metrics.json").is_file() else None
    if clustering is None:
        clustering = read_clustering(run)
    read, read_metrics, tree_note = describe_run(run, "last"), None, None
    if checkpoint == "best":
        read, read_metrics, clustering, tree = best_checkpoint_view(run, depth)
    elif tree is None:
        tree, tree_note = saved_tree(run)
    out = run / "report"
    out.mkdir(exist_ok=True)
    gallery, gallery_tree, gallery_note = discovery_gallery(run, clustering, checkpoint, depth)
    tree = tree if tree is not None else gallery_tree
    unscored = unscored_parts(clustering["targets"], int(clustering["n_old"])) if clustering is not None else {}
    names = run_class_names(run, checkpoint)
    figures = report_figures(log, metrics, clustering, tree, unscored, depth, names)
    method = run_method(run)
    codes = METHODS[method].labeller
    to_act = [n for n in (gallery_note, *act_notes(run, clustering, tree, tree_note, codes)) if n]
    body = []
    for name, caption, draw in figures:
        draw(out / name)
        body.append(figure_html(out / name, caption))
    table = metrics_table(metrics, unscored) if metrics is not None else ""
    if clustering is not None and (np.asarray(clustering["targets"]) == NO_LABEL).any():
        table += run_pool_section(run, clustering, checkpoint) + gallery
    said = [*unscored_notes(unscored), *to_act, *([] if codes else [no_tree_note(method)])]
    notes_html = "".join(f"<p><em>{html.escape(n)}</em></p>" for n in said)
    head = f"<h1>{html.escape(str(run))}</h1>{checkpoint_html(read, read_metrics)}"
    page = html_page("infosieve report", f"{head}{table}{notes_html}{''.join(body)}")
    path = run / "report.html"
    path.write_text(page)
    for note in to_act:
        print(f"note: {note}")
    return path


def run_class_names(run: Path, checkpoint: str) -> list[str] | None:
    """The class names in target order, as the run's checkpoint stores them (read memory-mapped); None without one."""
    name = checkpoint_name(checkpoint)
    if not (run / name).is_file():
        return None
    names = load_checkpoint(run, name=name, mmap=True).get("class_names")
    return None if names is None else list(names)


def run_method(run: Path) -> str:
    """The run's `method:` (its saved config's; InfoSieve for a run folder without one)."""
    saved = run / "config.yaml"
    return load_config(saved, saved=True).method if saved.is_file() else "infosieve"


def no_tree_note(method: str) -> str:
    """Why a run of a method without category codes has no tree on its page."""
    return (
        f"no category tree: method {method} learns no codes, and the tree is made of InfoSieve's code prefixes "
        "(train with method=infosieve for it)"
    )


def act_notes(
    run: Path, clustering: dict | None, tree: dict | None, tree_note: str | None, codes: bool = True
) -> list[str]:
    """The page's notes on what it cannot show as current, each saying what to do about it (`codes`: whether the
    run's method learns codes; a run without them has no tree to ask for)."""
    notes = [] if clustering is not None else ["no final clustering recorded (the run has not finished)"]
    if tree is None and tree_note is not None:  # a stale tree.json, not drawn
        notes.append(f"the category tree is not drawn: {tree_note}")
    elif tree_note is not None:  # drawn: a tree.json of unknown age, or the gallery's tree in place of a stale one
        notes.append(tree_note)
    elif tree is None and codes:
        notes.append(f"no tree.json: run `infosieve tree --run {run}` first")
    return notes


def discovery_gallery(
    run: Path, clustering: dict | None, checkpoint: str, depth: int
) -> tuple[str, dict | None, str | None]:
    """The cluster gallery of a run with an unlabelled pool (gallery.py), the tree of the same pass's codes and a
    note: ("", None, None) for other runs, and ("", None, why) where the run's images or shards cannot be read."""
    if clustering is None or not (np.asarray(clustering["targets"]) == NO_LABEL).any():
        return "", None, None
    from ..analysis.gallery import run_gallery

    try:
        return *run_gallery(run, clustering, checkpoint, depth), None
    except (FileNotFoundError, ValueError) as err:
        return "", None, f"no cluster gallery: {err}"


def report_figures(
    log: list[dict],
    metrics: dict | None,
    clustering: dict | None,
    tree: dict | None,
    unscored: dict,
    depth: int,
    class_names: list[str] | None,
) -> list[tuple]:
    """The page's figures, (file name, caption, draw(path)); `act_notes` says why one is missing."""
    figures = [
        ("losses.png", "every loss term per epoch", lambda p: plot_losses(log, p)),
        ("schedules.png", "lr, age and base schedules; k-means inertia", lambda p: plot_schedules(log, p)),
    ]
    if len(unscored) < 3:
        figures.append(("accuracy.png", "All / Old / New", lambda p: plot_accuracy(log, metrics, p, unscored)))
    if clustering is not None and "all" not in unscored:
        labelled = np.asarray(clustering["targets"]) != NO_LABEL  # the confusion matrix's rows are true classes
        figures.append(
            (
                "confusion.png",
                "confusion matrix of the final clustering (unlabelled samples)",
                lambda p: plot_confusion(
                    np.asarray(clustering["targets"])[labelled],
                    np.asarray(clustering["preds"])[labelled],
                    int(clustering["n_old"]),
                    p,
                    class_names,
                ),
            )
        )
    if tree is not None:
        figures.append(("tree.png", f"implicit category tree to depth {depth}", lambda p: plot_tree(tree, p, depth)))
    return figures


def metrics_table(metrics: dict, unscored: dict) -> str:
    """All/Old/New before and after training as an HTML table; "not computed" for the parts in `unscored`."""

    def cell(stage: str, part: str) -> str:
        return "<td>not computed</td>" if part in unscored else f"<td>{metrics[stage][part]:.4f}</td>"

    rows = "".join(
        f"<tr><td>{stage}</td>" + "".join(cell(stage, part) for part in ("all", "old", "new")) + "</tr>"
        for stage in ("before", "after")
    )
    return f"<table><tr><th></th><th>All</th><th>Old</th><th>New</th></tr>{rows}</table>"


def best_checkpoint_view(run: Path, depth: int) -> tuple[str, dict, dict, dict | None]:
    """What the report shows of RUN/checkpoint-best.pt: (what was read, its All/Old/New on the unlabelled train
    samples, that clustering as `write_report` takes it, its tree to `depth`: None for a method without codes)."""
    from ..analysis.run_reader import read_run, trainer_tree

    trainer, read = read_run(run, "best")
    ev = trainer.evaluate_full()
    tree = trainer_tree(trainer, depth) if trainer.model.labeller is not None else None  # InfoSieve's codes alone
    return read, ev.metrics, ev.unlabelled_table(trainer.source.n_old), tree


def checkpoint_html(read: str, metrics: dict | None) -> str:
    """The checkpoint the page shows ("last, epoch E" or "best (criterion, epoch E)"), with the best's All/Old/New."""
    text = f"<p>checkpoint: <b>{html.escape(read)}</b></p>"
    if metrics is None:
        return text
    cells = "".join(
        "<td>not computed</td>" if metrics[k] is None else f"<td>{metrics[k]:.4f}</td>" for k in ("all", "old", "new")
    )
    return (
        f"{text}<p><em>The confusion matrix and the tree are of this checkpoint's weights; the curves and the "
        f"before/after table cover the whole run (after: the last checkpoint).</em></p><table><tr><th></th>"
        f"<th>All</th><th>Old</th><th>New</th></tr><tr><td>{html.escape(read)}</td>{cells}</tr></table>"
    )


def run_pool_section(run: Path, clustering: dict, checkpoint: str) -> str:
    """`pool_section` of the run folder `run`, with the class names and the number of clusters of its checkpoint and
    the names that hold for `checkpoint`'s clusters."""
    state = load_checkpoint(run, mmap=True)  # its records and the centres' count: no tensor is read
    names = checkpoint_names(run, checkpoint)
    return pool_section(run, clustering, list(state["class_names"]), len(state["centers"]), names)
