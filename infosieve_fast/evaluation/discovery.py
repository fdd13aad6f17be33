"""Runs on your own images (`make-shards --dataset discovery`): what can be said about images that carry no label.

The unlabelled pool has no ground truth, so All/Old/New cannot score it. What is knowable:
- the accuracy on the held-out labelled images (`make-shards --holdout SHARE`: labelled images of the known classes
  trained on as unlabelled ones), i.e. the share that lands in its own class's cluster (SS-k-means anchors labelled
  class c to cluster c);
- every cluster's name (a known class, or `novel-<k>`) and size;
- the margins `infosieve predict` writes (how much nearer an image is to its centre than to the next one), read from
  `RUN/predictions.jsonl` when the predictions were written there.
`infosieve report` shows these in place of the metrics no label can give, and says which metrics those are.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np

from ..common.labels import NO_LABEL

PREDICTIONS = "predictions.jsonl"  # `infosieve predict --run RUN --images ... --out RUN/predictions.jsonl`


def cluster_name(cluster: int, class_names: list[str], n_old: int, given: dict[int, str] | None = None) -> str:
    """Cluster `cluster`'s name: the known class it is anchored to (clusters 0..n_old-1), else the name `given` it
    (RUN/names.json, `cluster_names.py`), else `novel-<cluster>`."""
    if cluster < n_old and cluster < len(class_names):
        return class_names[cluster]
    return (given or {}).get(cluster, f"novel-{cluster}")


def novel_pool_images(clustering: dict) -> int:
    """How many pool images (no label) the final clustering put in a novel cluster (one beyond the known classes)."""
    pool = np.asarray(clustering["targets"]) == NO_LABEL
    return int((pool & (np.asarray(clustering["preds"]) >= int(clustering["n_old"]))).sum())


def nothing_new(n_old: int) -> str:
    """What a run says when no pool image went to a novel cluster."""
    return (
        f"No new category was found: every pool image went to one of the {n_old} known classes' clusters. If you "
        "expect new ones, train again with kmeans.n_clusters set to the number of categories you expect."
    )


def unscored_parts(targets: np.ndarray, n_old: int) -> dict[str, str]:
    """{part: why it is not computed} for each of All/Old/New that no label among the scored samples' `targets`
    supports (`NO_LABEL`: the image has none); {} when every part has labels to score (every benchmark run)."""
    targets = np.asarray(targets)
    why = {}
    if not (targets != NO_LABEL).any():
        why["all"] = "no unlabelled image has a label: hold labelled images out to measure it (make-shards --holdout)"
    if not ((targets != NO_LABEL) & (targets < n_old)).any():
        why["old"] = why.get("all", "no unlabelled image of a known class has a label")
    if not (targets >= n_old).any():
        why["new"] = "no image of a novel class has a label (the unlabelled pool has none), so New cannot be measured"
    return why


def unscored_notes(unscored: dict[str, str]) -> list[str]:
    """One line per reason of `unscored_parts`, naming the parts it leaves out ("All, Old: not computed: ...")."""
    by_reason: dict[str, list[str]] = {}
    for part, why in unscored.items():
        by_reason.setdefault(why, []).append(part.capitalize())
    return [f"{', '.join(parts)}: not computed: {why}" for why, parts in by_reason.items()]


def held_out_accuracy(targets: np.ndarray, preds: np.ndarray) -> tuple[int, int]:
    """(held-out labelled images, those in their own class's cluster) among the clustered unlabelled samples: the
    images whose target is a class (the pool's is `NO_LABEL`)."""
    held = np.asarray(targets) != NO_LABEL
    return int(held.sum()), int((np.asarray(preds)[held] == np.asarray(targets)[held]).sum())


def read_predictions(path: Path) -> list[dict]:
    """The records `infosieve predict` wrote to a .jsonl file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def margins_by_cluster(records: list[dict]) -> dict[int, dict]:
    """{cluster: {"images", "mean_margin", "lowest_margin", "lowest_path"}} of `infosieve predict`'s records."""
    out: dict[int, dict] = {}
    for cluster in sorted({r["cluster"] for r in records}):
        mine = [r for r in records if r["cluster"] == cluster]
        low = min(mine, key=lambda r: r["margin"])
        out[cluster] = {
            "images": len(mine),
            "mean_margin": float(np.mean([r["margin"] for r in mine])),
            "lowest_margin": low["margin"],
            "lowest_path": low["path"],
        }
    return out


def pool_section(
    run: Path, clustering: dict, class_names: list[str], n_clusters: int, given: dict[int, str] | None = None
) -> str:
    """The report's HTML on a run with an unlabelled pool: held-out accuracy, then per cluster its name, its pool and
    held-out images in the final clustering and, from `RUN/predictions.jsonl`, its predicted images and margins."""
    targets, preds, n_old = np.asarray(clustering["targets"]), np.asarray(clustering["preds"]), int(clustering["n_old"])
    pool = targets == NO_LABEL
    held, right = held_out_accuracy(targets, preds)
    lines = [
        f"The unlabelled pool: {int(pool.sum()):,} images with no label. All/Old/New need labels, so they score "
        "only the held-out labelled images below, never the pool."
    ]
    if not novel_pool_images(clustering):
        lines.append(nothing_new(n_old))
    if held:
        lines.append(
            f"Held-out labelled images: {held:,}; in their own class's cluster: {right:,} "
            f"(accuracy {right / held:.3f})."
        )
    else:
        lines.append("No labelled image was held out, so no accuracy can be measured (make-shards --holdout SHARE).")
    predictions = run / PREDICTIONS
    margins = margins_by_cluster(read_predictions(predictions)) if predictions.is_file() else {}
    if not margins:
        lines.append(
            f"No {PREDICTIONS} in the run folder: margins appear after `infosieve predict --run {run} "
            f"--images DATA/unlabelled --out {predictions}`."
        )
    lines.append(
        "Columns: pool images and held-out images count the run's own final clustering of its train samples "
        f"(clustering.npz); predicted counts the records of {PREDICTIONS}, every image given to predict. An image "
        "the run clustered keeps the run's cluster there, so the counts differ only by images one side has and the "
        "other lacks (new images, unreadable ones, pool images predict was not given)."
    )
    rows = []
    for c in range(n_clusters):
        m = margins.get(c)
        cells = [
            str(c),
            cluster_name(c, class_names, n_old, given),
            f"{int((pool & (preds == c)).sum()):,}",
            f"{int((~pool & (preds == c)).sum()):,}",
        ]
        cells += (
            [f"{m['images']:,}", f"{m['mean_margin']:.4f}", f"{m['lowest_margin']:.4f} ({m['lowest_path']})"]
            if m
            else ["—"] * 3
        )
        rows.append("<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in cells) + "</tr>")
    head = (
        "<tr><th>cluster</th><th>name</th><th>pool images</th><th>held-out images</th>"
        f"<th>predicted ({PREDICTIONS})</th><th>mean margin</th><th>lowest margin (image)</th></tr>"
    )
    text = "".join(f"<p>{html.escape(line)}</p>" for line in lines)
    return f"<h2>Discovery: the unlabelled pool</h2>{text}<table>{head}{''.join(rows)}</table>"
