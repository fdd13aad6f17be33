"""The run's own cluster of each image it clustered, so that `infosieve predict` gives one answer per image.

A run on your own images ends with balanced SS-k-means of its train samples (RUN/clustering.npz); balancing moves
some images out of the cluster of their nearest centre, so the nearest centre alone disagrees with the run for about
one pool image in ten. An image is recognised by its content: make-shards stores each image as deterministic bytes
(the shards' resize, image format and JPEG quality), so the same file encoded the same way hashes to the stored
sample's hash, whose key is the sample's uq, whose cluster clustering.npz holds. Images the run never saw (or saw
as other bytes) keep the nearest centre.

Only runs on a make-shards folder of your own images (`--dataset discovery`) are looked up: the lookup reads every
stored train image once, which is cheap for a pool of one's own images and not for ImageNet.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common.shown_text import terminal_safe
from ..data.reading.intake import is_manifest_folder
from ..data.reading.tar import image_members, open_mmap
from ..data.shard_format import DISCOVERY
from ..data.shard_manifest import MANIFEST
from ..data.writing.encode import encode_pil
from ..training.run_files import CLUSTERING


@dataclass(frozen=True)
class StoredForm:
    """How make-shards stored the run's images: the shorter side, the image format and the JPEG quality."""

    resize: int
    image_format: str
    quality: int


class RunAssignments:
    """{content hash of a stored image: the run's final cluster of it} and the form the images were stored in."""

    def __init__(self, form: StoredForm, cluster_by_hash: dict[bytes, int]):
        self.form, self.cluster_by_hash = form, cluster_by_hash

    def stored_key(self, image) -> bytes:
        """The hash of a PIL image (RGB) encoded as the run's shards store it."""
        f = self.form
        return content_hash(encode_pil(image, f.resize, f.quality, f.image_format))

    def __len__(self) -> int:
        return len(self.cluster_by_hash)


def content_hash(data: bytes) -> bytes:
    return hashlib.sha1(data).digest()


def run_assignments(run_dir: str | Path, shards: object, image_keys: tuple[str, ...]) -> RunAssignments | None:
    """The run's final clusters by stored content, for a run on a make-shards folder of your own images with its
    clustering.npz; None for any other run (a warning says why when the run's shards are gone)."""
    clustering = Path(run_dir) / CLUSTERING
    if not (isinstance(shards, str | Path) and clustering.is_file()):
        return None
    if not is_manifest_folder(shards):
        if not Path(shards).exists():
            print(
                f"infosieve predict: WARNING: the run's shards {terminal_safe(str(shards))} are gone, so the images it "
                "clustered cannot be recognised: each image goes to its nearest centre",
                file=sys.stderr,
            )
        return None
    manifest = json.loads((Path(shards) / MANIFEST).read_text())
    if manifest["dataset"] != DISCOVERY:
        return None
    fp = manifest["fingerprint"]
    form = StoredForm(int(fp["resize"]), fp["image_format"], int(fp.get("jpeg_quality") or 0))
    with np.load(clustering) as z:
        cluster_by_uq = dict(zip(z["uq"].tolist(), z["preds"].tolist(), strict=True))
    by_hash: dict[bytes, int] = {}
    for record in manifest["splits"]["train"]["shards"]:
        for uq, digest in stored_hashes(Path(shards) / record["name"], image_keys):
            if uq in cluster_by_uq:
                by_hash.setdefault(digest, cluster_by_uq[uq])  # identical images: the first stored one's cluster
    return RunAssignments(form, by_hash)


def stored_hashes(tar: Path, image_keys: tuple[str, ...]) -> list[tuple[int, bytes]]:
    """(uq, content hash) of each stored image of a make-shards tar (its sample keys are the uq, %08d)."""
    found, _ = image_members(str(tar), image_keys)
    mm = open_mmap(str(tar))
    try:
        return [(int(key), content_hash(mm[offset : offset + length])) for key, offset, length in found]
    finally:
        mm.close()
