"""The report's discovery gallery (runs on your own images): per cluster, novel ones first, thumbnails of the pool
images nearest its centre and of a few at its margin (nearest to another cluster), each titled with its file; beside
each novel cluster its size, the known classes nearest it and, where the codes carry the classes, its place in the
category tree (`cluster_places.py`, `code_separation.py`). Every method has the gallery and the nearest known classes
(its clusters: SS-k-means, or the argmax of SimGCD's prototypes, whose centres are the prototypes); the place in the
tree is InfoSieve's alone, the one method that learns codes.

Thumbnails are small JPEG files written once under RUN/report/thumbs/ (one per image, reused by later reports) and
referenced by relative paths with lazy loading, so a run of a thousand clusters stays a page a browser opens quickly.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common.labels import NO_LABEL
from ..common.limits import open_image
from ..evaluation.code_separation import code_separation, separation_text
from ..evaluation.discovery import cluster_name
from ..methods import METHODS
from .cluster_places import place_clusters, place_text
from .pool_view import PoolView, pool_view
from .run_images import RunImages, run_images

NEAREST, AT_MARGIN = 8, 4  # thumbnails per cluster: nearest the centre, then at the margin
THUMB_SIZE, THUMB_QUALITY = 96, 80  # longer side in pixels; JPEG quality
THUMBS = "thumbs"  # under RUN/report/
STYLE = (
    "<style>.cluster{margin:14px 0;border-top:1px solid #ddd}.cluster h3{margin:6px 0 2px}"
    ".place{margin:2px 0 4px;color:#333}.thumbs img{height:72px;margin:1px;vertical-align:middle}"
    ".thumbs .lbl{display:inline-block;width:90px;font-size:11px;color:#666;vertical-align:middle}</style>"
)


@dataclass(frozen=True)
class Gallery:
    """What the section shows: the clustering and its centres, the pass's distances and codes, the image files, the
    names and the run's `method:`."""

    clustering: dict
    view: PoolView
    images: RunImages
    class_names: list[str]
    centers: np.ndarray
    given: dict[int, str]
    method: str


def chosen_images(members: list[int], view: PoolView) -> tuple[list[int], list[int]]:
    """(the `NEAREST` members nearest the centre, then the `AT_MARGIN` others with the smallest margins), by uq."""
    nearest = sorted(members, key=lambda u: (view.distance[u], u))[:NEAREST]
    rest = [u for u in members if u not in set(nearest)]
    return nearest, sorted(rest, key=lambda u: (view.margin[u], u))[:AT_MARGIN]


def thumbnail(source: Path, target: Path) -> None:
    """`source` shrunk to `THUMB_SIZE` pixels on its longer side, as a JPEG at `target`; written once."""
    if target.is_file():
        return
    with open_image(source) as im:
        im = im.convert("RGB")
        im.thumbnail((THUMB_SIZE, THUMB_SIZE))
    target.parent.mkdir(parents=True, exist_ok=True)
    im.save(target, "JPEG", quality=THUMB_QUALITY)


def thumbs_html(run: Path, uqs: list[int], g: Gallery, label: str) -> str:
    """The thumbnails of samples `uqs` after a label, each titled with its file, distance and margin."""
    if not uqs:
        return ""
    tags = [f'<span class="lbl">{html.escape(label)}</span>']
    for u in uqs:
        target = run / "report" / THUMBS / f"{u:08d}.jpg"
        thumbnail(g.images.path(u), target)
        title = f"{g.images.names[u]} (distance {g.view.distance[u]:.3f}, margin {g.view.margin[u]:.3f})"
        src = target.relative_to(run).as_posix()
        tags.append(f'<img loading="lazy" src="{html.escape(src)}" title="{html.escape(title)}" alt="">')
    return "".join(tags)


def cluster_html(run: Path, k: int, members: list[int], g: Gallery, place: dict | None) -> str:
    """One cluster: its name (and novel-<k> when named), its pool size and place, its thumbnails."""
    n_old = int(g.clustering["n_old"])
    name = cluster_name(k, g.class_names, n_old, g.given)
    head = html.escape(name) + (f" <small>(novel-{k})</small>" if k in g.given else "")
    kind = "novel" if k >= n_old else "known class"
    text = place_text(place).partition(": ")[2] if place else f"{len(members)} pool images"
    nearest, margin = chosen_images(members, g.view)
    return (
        f'<section class="cluster" id="cluster-{k}"><h3>{head}</h3><p class="place">{kind}: {html.escape(text)}</p>'
        f'<div class="thumbs">{thumbs_html(run, nearest, g, "nearest the centre")}'
        f"{thumbs_html(run, margin, g, 'at the margin')}</div></section>"
    )


def gallery_html(run: Path, g: Gallery, depth: int) -> str:
    """The section: every cluster with pool images, novel ones first (largest first), then the known classes."""
    c = g.clustering
    pool = (np.asarray(c["targets"]) == NO_LABEL) & np.isin(np.asarray(c["uq"]), list(g.view.distance))
    uq, preds = np.asarray(c["uq"])[pool], np.asarray(c["preds"])[pool]
    members = {k: uq[preds == k].tolist() for k in np.unique(preds).tolist()}
    separation = code_separation(g.view.codes, g.view.targets) if g.view.codes else None
    carries = separation is not None and separation["carries"]
    places = place_clusters(g.view.codes, g.view.targets, c, g.class_names, g.centers, g.given, depth, carries)
    by_cluster = {p["cluster"]: p for p in places}
    n_old = int(c["n_old"])
    order = [p["cluster"] for p in places] + sorted(k for k in members if k < n_old)
    sections = "".join(cluster_html(run, k, members[k], g, by_cluster.get(k)) for k in order)
    intro = (
        f"{made_by(g.method)} Every cluster with pool images, novel ones first: up to {NEAREST} images nearest its "
        f"centre, then up to {AT_MARGIN} at its margin (nearest to another cluster); hover an image for its file. "
        "Beside a novel cluster, the known classes whose cluster centres lie nearest its own in the features (with "
        "the distances) and, where the codes carry the classes, its place in the tree: the code prefix most of its "
        "images share, and the known classes whose prefix shares the most digits with it. Name a cluster with "
        "`infosieve name --run RUN novel-K=NAME`."
    )
    codes = separation_text(separation) if separation is not None else no_codes_text(g.method)
    return f"{STYLE}<h2>Discovery: the clusters</h2><p>{html.escape(intro)}</p><p>{html.escape(codes)}</p>{sections}"


def made_by(method: str) -> str:
    """How the run's clusters were made, and so what their centres are."""
    if METHODS[method].predicts == "head":
        return (
            f"The clusters come from method {method}'s prototype head (each image in the cluster of its largest "
            "logit); a cluster's centre is its prototype."
        )
    return "The clusters come from SS-k-means on the L2-normalised backbone features, with its centres."


def no_codes_text(method: str) -> str:
    """The line in place of `separation_text` for a method without codes."""
    return (
        f"Method {method} learns no codes, so no cluster has a place in the category tree (only method=infosieve "
        "learns the codes whose prefixes make the tree): the nearest known classes in the features are the hints."
    )


def run_gallery(run: Path, clustering: dict, checkpoint: str, depth: int) -> tuple[str, dict | None]:
    """The gallery section of the run's last (or best) checkpoint, and the category tree of the same pass's codes to
    `depth` (what the report draws when no tree.json was written; None for a method without codes)."""
    from ..evaluation.tree import build_tree
    from .cluster_names import checkpoint_names
    from .run_reader import assignment_centers, read_run

    trainer, _ = read_run(run, checkpoint)
    images = run_images(run, trainer.cfg.data.shards)
    pool = np.asarray(clustering["targets"]) == NO_LABEL
    uq, preds = np.asarray(clustering["uq"])[pool].tolist(), np.asarray(clustering["preds"])[pool].tolist()
    clusters = dict(zip(uq, preds, strict=True))
    centers = assignment_centers(trainer, run, checkpoint)
    view = pool_view(trainer, centers, clusters)
    names = list(trainer.source.class_names)
    given = checkpoint_names(run, checkpoint)
    g = Gallery(clustering, view, images, names, centers.cpu().numpy(), given, trainer.cfg.method)
    if not view.codes:  # a method without codes: no tree
        return gallery_html(run, g, depth), None
    uqs = sorted(view.codes)
    tree = build_tree([view.codes[u] for u in uqs], [view.targets[u] for u in uqs], depth) | {"class_names": names}
    return gallery_html(run, g, depth), tree
