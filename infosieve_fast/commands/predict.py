"""`infosieve predict --run RUN --images PATH --out FILE`: sort new images with a trained run.

Each image goes through the reference's test transform: resize to shorter side `int(crop / 0.875)` (256 for 224),
centre crop, normalise. Its L2-normalised backbone feature then goes to the nearest of the run's final SS-k-means
centres, except an image the run itself clustered (one of its own-images pool, recognised by content,
`run_assignment.py`): that one keeps the run's final cluster, so the run and predict give one answer per image.
The run folder's checkpoint holds those centres and the class names. Clusters 0..n_old-1 are the known
classes: SS-k-means anchors labelled class c to cluster c. Any other cluster k is named `novel-<k>`,
or what `infosieve name` named it (RUN/names.json).

`PATH` can be one of:
- an image folder, searched recursively, or one image file;
- a text file listing image paths, one per line, relative to the file's folder;
- shards, whose samples are named `shard.tar/key`: a `make-shards` folder, a folder of WebDataset tars, a .tar, a brace
  pattern or a glob. One walk over the tar headers finds every image (the first of the run's
  `data.intake.image_keys` present); each is then read by offset, so the time per image does not grow with the
  shard's size.

Output: JSON lines or CSV, chosen by the extension of `FILE`. Each image gets its path, cluster, name, margin,
code, prefix and tree_path:
- margin: the Euclidean distance to the second-nearest centre minus that to the nearest;
- code: the L sign bits;
- prefix: the code cut at the first bit the mask switches off;
- tree_path: the prefix's nodes in the implicit category tree, from depth 1 down to the prefix.
A run of a method without codes (`method:` other than infosieve) writes an empty code, prefix and tree_path; one
whose method predicts by its head (SimGCD) has the head's prototypes as its centres, so the nearest is its prediction.

Images that cannot be read are reported and skipped; so are the files of an image folder that are not images (by
their suffix, the list make-shards reads: `data/shard_format.py`), counted in the summary.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import json
import sys
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from ..analysis.cluster_names import checkpoint_names
from ..analysis.run_assignment import RunAssignments, content_hash, run_assignments
from ..analysis.run_reader import describe, load_run_checkpoint
from ..common import files as common_files
from ..common.limits import open_image
from ..common.shown_text import csv_safe, terminal_safe
from ..config.settings import from_saved
from ..data.reading.augment import AugmentConfig, DeviceAugment
from ..data.reading.decode import pad_into
from ..data.reading.intake import SHARD_SUFFIXES, is_manifest_folder, parse_image_keys, shard_paths
from ..data.reading.stream import decode_image
from ..data.reading.tar import IMAGE_KEYS, image_members, read_span
from ..data.shard_format import IMAGE_SUFFIXES
from ..evaluation.discovery import cluster_name
from ..evaluation.tree import code_strings
from ..network.model import InfoSieve
from ..training.run_source import run_config
from ..training.trainer_setup import build_method, build_model, resolve_device

OUTPUT_SUFFIXES = (".jsonl", ".csv")
FIELDS = ("path", "cluster", "name", "margin", "code", "prefix", "tree_path")


def model_from_run(run_dir: str | Path, device: torch.device, checkpoint: str = "last") -> tuple[InfoSieve, dict]:
    """The run's model with its last (or best) checkpoint's weights (the backbone is built without
    `model.pretrained`: the weights come from the checkpoint), in eval mode, and the checkpoint."""
    state, _ = load_run_checkpoint(run_dir, checkpoint)
    cfg = run_config(state["config"], run_dir, reads_data=checkpoint == "best")  # the best's centres read the data
    # the backbone in full precision, whole (an inference model: no bf16 prefix, no recomputation), with the method's
    # heads and its labeller or not
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, frozen_bf16=False, checkpoint_blocks="off"))
    method, n_old = build_method(cfg, state["n_old"]), state["n_old"]
    model = build_model(cfg, n_old, None, False, method, state.get("n_clusters"))
    model.load_state_dict(state["model"])
    return model.to(device).eval(), state


def centers_from_run(run_dir: str | Path, state: dict, checkpoint: str) -> Tensor:
    """The centres new images are assigned to: the last checkpoint's final clustering; for the best checkpoint, its
    weights' clustering of the run's train samples, computed again (the run's data must still be where it was)."""
    from ..analysis.run_reader import assignment_centers, trainer_from_run

    if checkpoint == "best":
        return assignment_centers(trainer_from_run(run_dir, "best"), run_dir, "best")
    if state.get("centers") is None:
        raise ValueError(f"{run_dir}'s checkpoint holds no k-means centres: it predates them; train it again")
    return state["centers"]


@dataclass(frozen=True)
class ShardImage:
    """An image stored in a shard, read by offset (one seek and one read, whatever the shard's size)."""

    tar: str
    offset: int
    length: int


def _is_shards(path: Path) -> bool:
    """`--images` names tar shards: a make-shards folder, a folder holding only shards, a .tar, a pattern."""
    text = str(path)
    if is_manifest_folder(path) or text.endswith(SHARD_SUFFIXES) or "{" in text or glob.has_magic(text):
        return True
    if not path.is_dir():
        return False
    files = [p for p in path.rglob("*") if p.is_file()]
    return any(p.name.endswith(SHARD_SUFFIXES) for p in files) and not any(_is_image(p) for p in files)


def _is_image(p: Path) -> bool:
    return p.suffix.lower() in IMAGE_SUFFIXES


def shard_items(spec, image_keys: tuple[str, ...]) -> list[tuple[str, object]]:
    """(shard name/key, `ShardImage`) of every sample of the shards `spec` names, from one walk over their headers;
    samples without an image and unreadable shards are reported (counted) and skipped."""
    items: list[tuple[str, object]] = []
    for tar in shard_paths(spec):
        damage: list[str] = []
        try:
            found, without = image_members(tar, image_keys, damage)
        except (OSError, tarfile.ReadError) as exn:
            print(f"infosieve predict: WARNING: skipped {terminal_safe(f'{tar}: {exn}')}", file=sys.stderr)
            continue
        for problem in damage:  # the samples before it are sorted, as training reads them
            print(f"infosieve predict: WARNING: {tar}: {problem}", file=sys.stderr)
        if without:
            keys = ", ".join(image_keys)
            print(
                f"infosieve predict: WARNING: {without} sample(s) of {terminal_safe(tar)} have no image under any of "
                f"the keys {keys}: skipped (set data.intake.image_keys in the run's config)",
                file=sys.stderr,
            )
        items += [(f"{Path(tar).name}/{key}", ShardImage(tar, a, n)) for key, a, n in found]
    return items


def image_items(
    path: str | Path, image_keys: tuple[str, ...] = IMAGE_KEYS, not_images: list[Path] | None = None
) -> list[tuple[str, object]]:
    """(name, source) of every image under `path`: a folder, a list file or shards (see the module doc). The files of
    a folder that are not images (by their suffix) are appended to `not_images` when it is given."""
    path = Path(path)
    if _is_shards(path):
        return shard_items(path, image_keys)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if not_images is not None:
            not_images += [p for p in files if not _is_image(p)]
        return [(str(p), p) for p in files if _is_image(p)]
    if path.is_file() and _is_image(path):  # one image
        return [(str(path), path)]
    if path.is_file():
        try:
            lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except UnicodeDecodeError:
            raise ValueError(
                f"--images {path} is neither an image (a file ending in {', '.join(IMAGE_SUFFIXES)}) nor a list of "
                "image paths (UTF-8 text, one per line)"
            ) from None
        return [(line, path.parent / line) for line in lines]
    raise FileNotFoundError(f"--images {path} is neither an image folder, a list file nor shards")


def _load(
    source: object, shorter: int, channels: int, assignments: RunAssignments | None
) -> tuple[Tensor, bytes | None]:
    """uint8 [C, H, W] resized to the given shorter side (bicubic, antialiased, as make-shards and the reference), and
    the image's stored-content hash when the run's own clusters are looked up (`assignments`), else None."""
    from PIL import Image

    from ..data.writing.encode import resize_image

    if isinstance(source, ShardImage):
        data = read_span(source.tar, source.offset, source.length)
        img = decode_image(data)
        im = Image.fromarray(img.permute(1, 2, 0).numpy())
        key = None if assignments is None else content_hash(data)
    else:
        with open_image(source) as im:
            im = im.convert("RGB")
        key = None if assignments is None else assignments.stored_key(im)
    im = resize_image(im, shorter)
    if channels == 1:
        im = im.convert("L")
    arr = np.asarray(im)
    arr = arr[:, :, None] if arr.ndim == 2 else arr
    return torch.from_numpy(arr.copy()).permute(2, 0, 1), key


def _batches(
    items: list, batch_size: int, shorter: int, channels: int, assignments: RunAssignments | None
) -> Iterator[tuple[int, list[str], list, list]]:
    """(images tried, names, images, their content hashes) per batch of `items`; an unreadable image is reported and
    left out."""

    def load(item):
        try:
            return _load(item[1], shorter, channels, assignments)
        except Exception as exn:
            print(
                f"infosieve predict: WARNING: skipped {terminal_safe(f'{item[0]}: {type(exn).__name__}: {exn}')}",
                file=sys.stderr,
            )
            return None

    with ThreadPoolExecutor(4) as pool:
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            loaded = list(pool.map(load, chunk))
            kept = [(name, got) for (name, _), got in zip(chunk, loaded, strict=True) if got is not None]
            yield len(chunk), [name for name, _ in kept], [g[0] for _, g in kept], [g[1] for _, g in kept]


@torch.no_grad()
def predict(
    run_dir: str | Path,
    images: str | Path,
    out: str | Path,
    batch_size: int = 64,
    device: str = "auto",
    progress: bool = True,
    checkpoint: str = "last",
) -> dict:
    """Write one record per readable image of `images` to `out` (.jsonl or .csv) with the run's last (or best)
    checkpoint; returns a summary, which names the checkpoint and counts the images the run itself had clustered.
    An input with no image, or none readable, is refused."""
    out = Path(out)
    if out.suffix.lower() not in OUTPUT_SUFFIXES:
        raise ValueError(f"--out {out} must end in .jsonl or .csv (the output format)")
    dev = resolve_device(device)
    model, state = model_from_run(run_dir, dev, checkpoint)
    d = from_saved(state["config"]).data
    image_keys = parse_image_keys(d.intake.image_keys)
    not_images: list[Path] = []
    items = image_items(images, image_keys, not_images)
    if not items:
        raise ValueError(
            f"--images {images} holds no images (files ending in {', '.join(IMAGE_SUFFIXES)}, a list of them, or "
            "shards): point it at the images to sort"
        )
    # the last checkpoint's clustering is the run's final one (clustering.npz); the best's is computed again
    assignments = run_assignments(run_dir, d.shards, image_keys) if checkpoint == "last" else None
    centers = centers_from_run(run_dir, state, checkpoint).to(dev).float()
    sorter = ImageSorter(model, centers, state, assignments, checkpoint_names(run_dir, checkpoint))
    bar = tqdm(total=len(items), desc="predict", unit="img", disable=not progress)
    for tried, paths, imgs, keys in _batches(items, batch_size, sorter.shorter, sorter.channels, assignments):
        bar.update(tried)
        if imgs:
            sorter.add(paths, imgs, keys)
    bar.close()
    if not sorter.records:
        raise ValueError(
            f"none of the {len(items)} images of --images {images} could be read (each is named above): check that "
            "the paths exist and the files are images"
        )
    _write(out, sorter.records)
    return {
        "images": len(items),
        "written": len(sorter.records),
        "skipped": len(items) - len(sorter.records),
        "not_images": len(not_images),
        "not_image_suffixes": sorted({p.suffix.lower() or "no suffix" for p in not_images}),
        "run_clustered": sorter.recognised,
        "out": str(out),
        "clusters_used": int((sorter.counts > 0).sum()),
        "checkpoint": describe(state, checkpoint),
    }


class ImageSorter:
    """The records of `predict`: per image its cluster (the run's own for an image the run clustered, else the
    nearest centre), name (`given`: the names RUN/names.json gives novel clusters), margin, code, prefix and tree
    path."""

    def __init__(
        self, model: InfoSieve, centers: Tensor, state: dict, assignments: RunAssignments | None, given: dict[int, str]
    ):
        cfg = from_saved(state["config"])
        d = cfg.data
        self.model, self.centers, self.assignments = model, centers, assignments
        self.names, self.n_old = state.get("class_names") or [], state["n_old"]
        self.given = given
        self.augment = DeviceAugment(AugmentConfig(d.crop_size, False, tuple(d.mean), tuple(d.std)))
        self.shorter = int(d.crop_size / 0.875)  # the reference: Resize(int(224 / 0.875)) = 256, then CenterCrop(224)
        self.channels = int(cfg.model.backbone_kwargs.get("in_chans", 3))
        self.records: list[dict] = []
        self.counts = np.zeros(len(centers), np.int64)
        self.recognised = 0

    def add(self, paths: list[str], imgs: list[Tensor], keys: list[bytes | None]) -> None:
        canvas, sizes = pad_into(imgs)
        uniform = bool((sizes == sizes[:1]).all())
        dev = self.centers.device
        x = self.augment.test_view(canvas.to(dev), None if uniform else sizes)
        for path, key, nearest, margin, code, prefix in zip(
            paths, keys, *sort_batch(self.model, x, self.centers), strict=True
        ):
            own = None if self.assignments is None or key is None else self.assignments.cluster_by_hash.get(key)
            self.recognised += own is not None
            cluster = nearest if own is None else own
            self.counts[cluster] += 1
            tree_path = [prefix[: i + 1] for i in range(len(prefix))]
            name = cluster_name(cluster, self.names, self.n_old, self.given)
            values = (path, cluster, name, round(margin, 6), code, prefix, tree_path)
            self.records.append(dict(zip(FIELDS, values, strict=True)))


@torch.no_grad()
def sort_batch(model: InfoSieve, x: Tensor, centers: Tensor) -> tuple[list, list, list, list]:
    """Per image of the test views `x`: the nearest centre, the margin to the second nearest, the whole code and the
    prefix the mask keeps."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
        out = model(x)
    feats = torch.nn.functional.normalize(out.backbone.float(), dim=-1)
    two = torch.cdist(feats, centers).topk(min(2, len(centers)), dim=1, largest=False)
    margins = (two.values[:, -1] - two.values[:, 0]).cpu().tolist()
    if out.head is None:  # a method without codes
        return two.indices[:, 0].cpu().tolist(), margins, [""] * len(margins), [""] * len(margins)
    raw, mask = out.head.code_raw.float(), out.head.mask.float()
    return two.indices[:, 0].cpu().tolist(), margins, code_strings(raw, torch.ones_like(mask)), code_strings(raw, mask)


def _write(out: Path, records: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".jsonl":
        common_files.atomic_write(out, lambda f: f.write("".join(json.dumps(r) + "\n" for r in records).encode()))
        return
    rows = [{**r, "tree_path": "/".join(r["tree_path"])} for r in records]

    def write(f) -> None:
        import io

        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: csv_safe(v) for k, v in row.items()} for row in rows)
        f.write(text.getvalue().encode())

    common_files.atomic_write(out, write)
