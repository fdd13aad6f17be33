"""A make-shards folder's records: the settings fingerprint, the state file of a run in progress, `manifest.json`, and
the checks of a folder's shards against them (size and sha256) before it is resumed, repaired or read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.files import atomic_write, file_sha256
from .shard_format import DISCOVERY, PNG_COMPRESS_LEVEL
from .splits import EXPECTED_COUNTS, check_counts

if TYPE_CHECKING:
    from .writing.layout_common import RawDataset

FORMAT = "infosieve-shards/1"
MANIFEST = "manifest.json"
STATE = ".make-shards-state.json"
ORDER_SEED = 0  # the fixed shuffle of the train write order
PROP, SPLIT_SEED = 0.5, 0  # docs/reference.md §7: half of the known-class images labelled, RandomState(0)


class ShardsError(RuntimeError):
    """The output folder cannot be used (another dataset, other settings)."""


def atomic_json(path: Path, obj: dict) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


# ---- settings and previous output ------------------------------------------------------------------------------


def settings_fingerprint(
    raw: RawDataset, resize: int, codec: tuple[str, int], shard_size_mb: float, holdout: float, holdout_seed: int
) -> dict:
    """The settings a folder's shards are made with; a folder made with other settings is refused."""
    fmt, quality = codec
    fingerprint = {
        "format": FORMAT,
        "dataset": raw.dataset,
        "resize": resize,
        "image_format": fmt,
        "jpeg_quality": quality if fmt == "jpg" else None,
        "png_compress_level": PNG_COMPRESS_LEVEL if fmt == "png" else None,
        "shard_size_mb": shard_size_mb,
        "known": raw.known,
        "novel": raw.novel,
        "n_train": len(raw.train),
        "n_test": len(raw.test),
        "prop": PROP,
        "split_seed": SPLIT_SEED,
        "order_seed": ORDER_SEED,
    }
    if raw.dataset == DISCOVERY:  # only there: the other datasets' folders written before keep their fingerprint
        fingerprint.update(holdout=holdout, holdout_seed=holdout_seed)
    return fingerprint


def check_out(out: Path, dataset: str, fingerprint: dict) -> dict | None:
    """The previous manifest or state in `out` when it belongs to this run; refuse anything else."""
    for fname in (MANIFEST, STATE):
        path = out / fname
        if path.exists():
            prev = json.loads(path.read_text())
            if prev.get("dataset") != dataset:
                raise ShardsError(
                    f"{out} holds shards of dataset {prev.get('dataset')!r}, not {dataset!r}: choose another --out"
                )
            # outputs written before --image-format existed are JPEG with no format in the fingerprint
            prev_fp = {"image_format": "jpg", "png_compress_level": None, **prev.get("fingerprint", {})}
            if prev_fp != fingerprint:
                diff = sorted(k for k in fingerprint if prev_fp.get(k) != fingerprint[k])
                raise ShardsError(
                    f"{out} holds {dataset} shards made with other settings ({', '.join(diff)}): choose another --out "
                    "or delete the folder"
                )
            return prev
    foreign = sorted(p.name for p in out.glob("*.tar") if not p.name.startswith(dataset + "-"))
    if foreign:
        raise ShardsError(f"{out} holds shards of another dataset ({foreign[0]}, ...): choose another --out")
    return None


def shard_ok(out: Path, rec: dict) -> bool:
    path = out / rec["name"]
    return path.is_file() and path.stat().st_size == rec["bytes"] and file_sha256(path) == rec["sha256"]


def verified(out: Path, manifest: dict) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """(shards, shards to rewrite) per split of a finished folder: the manifest's shards, and those of them that are
    missing or damaged (size or sha256)."""
    done = {split: manifest["splits"][split]["shards"] for split in ("train", "test")}
    return done, {split: [r for r in recs if not shard_ok(out, r)] for split, recs in done.items()}


def resumable(out: Path, state: dict) -> dict[str, list[dict]]:
    """The finished shards per split of an interrupted run, up to the first that went missing or damaged since (that
    one and the later ones are rewritten, in order)."""
    done = {}
    for split in ("train", "test"):
        good = []
        for rec in state["done"][split]:
            if not shard_ok(out, rec):
                break
            good.append(rec)
        done[split] = good
    return done


def shard_file_problems(records: list[dict], paths: list[str], verify: bool) -> list[str]:
    """What is wrong with a folder's shard files against their manifest records (missing, other size, and with
    `verify` another sha256), as the reader reports it."""
    problems = []
    for rec, url in zip(records, paths, strict=True):
        p = Path(url)
        if not p.is_file():
            problems.append(f"shard {p} is missing: its {rec['written']} samples are skipped")
        elif p.stat().st_size != rec["bytes"]:
            problems.append(
                f"shard {p} has {p.stat().st_size:,} bytes, the manifest says {rec['bytes']:,}: truncated or "
                "damaged; its unreadable samples are skipped (re-run make-shards on this folder to repair it)"
            )
        elif verify and file_sha256(p) != rec["sha256"]:
            problems.append(f"shard {p} does not match its sha256 in the manifest: damaged")
    return problems


# ---- the manifest ----------------------------------------------------------------------------------------------


class ManifestError(ValueError):
    """A `manifest.json` the reader cannot use: the message names the file, what is wrong, and the way out."""


def _field(manifest: dict, path: str, kinds: tuple, where: Path):
    """The value at `path` ("splits.train.n") of the manifest, which must be one of `kinds` (bool is no int)."""
    value = manifest
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ManifestError(f"{where}: no {path!r}: {_REMAKE}")
        value = value[part]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ManifestError(f"{where}: {path!r} is {value!r}, not {' or '.join(k.__name__ for k in kinds)}: {_REMAKE}")
    return value


_REMAKE = "the manifest is damaged or not make-shards' (run make-shards again into a new --out)"


def read_manifest(folder: Path, split: str) -> dict:
    """`folder`'s manifest.json, its fields the reader of `split` uses checked; `ManifestError` naming the file."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(f"{path} is not valid JSON ({err}): {_REMAKE}") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{path} holds a {type(manifest).__name__}, not an object: {_REMAKE}")
    _field(manifest, "dataset", (str,), path)
    if _field(manifest, "resize", (int,), path) < 1 or _field(manifest, "n_old", (int,), path) < 0:
        raise ManifestError(f"{path}: resize {manifest['resize']} or n_old {manifest['n_old']} is out of range")
    _field(manifest, "n_classes", (int, type(None)), path)
    if not all(isinstance(n, str) for n in _field(manifest, "classes.names", (list,), path)):
        raise ManifestError(f"{path}: 'classes.names' holds a name that is not a string: {_REMAKE}")
    if _field(manifest, f"splits.{split}.n", (int,), path) < 0:
        raise ManifestError(f"{path}: 'splits.{split}.n' is negative: {_REMAKE}")
    for i, _ in enumerate(_field(manifest, f"splits.{split}.shards", (list,), path)):
        shard = {"shard": manifest["splits"][split]["shards"][i]}
        for key, kinds in (("name", (str,)), ("bytes", (int,)), ("sha256", (str,)), ("written", (int,))):
            _field(shard, f"shard.{key}", kinds, path)
        if Path(shard["shard"]["name"]).name != shard["shard"]["name"]:
            raise ManifestError(f"{path}: shard name {shard['shard']['name']!r} is not a file name in the folder")
    for i, _ in enumerate(_field(manifest, "skipped", (list,), path)):
        record = {"skipped": manifest["skipped"][i]}
        _field(record, "skipped.uq", (int,), path)
        _field(record, "skipped.split", (str,), path)
    return manifest


def build_manifest(
    raw: RawDataset, fingerprint: dict, counts: dict, done: dict, resize: int, codec: tuple[str, int]
) -> dict:
    """`manifest.json` of a finished folder: its settings, classes, counts, shards and skipped images."""
    order = raw.known + raw.novel
    if codec[0] == "jpg":
        image = f"RGB JPEG (quality {codec[1]})"
    else:
        image = f"RGB PNG (lossless; filter Up, zlib level {PNG_COMPRESS_LEVEL})"
    skipped = [s for split in ("train", "test") for rec in done[split] for s in rec["skipped"]]
    counts = dict(counts)
    for split in ("train", "test"):
        counts[f"written_{split}"] = sum(r["written"] for r in done[split])
        counts[f"skipped_{split}"] = sum(len(r["skipped"]) for r in done[split])
    problems = check_counts(raw.dataset, counts)
    return {
        "format": FORMAT,
        "dataset": raw.dataset,
        "root": str(raw.root),
        "fingerprint": fingerprint,
        "image": f"{image}, shorter side {resize} (bicubic, antialiased), aspect kept",
        "image_format": codec[0],
        "resize": resize,
        "classes": {
            "names": [raw.class_names[c] for c in order],  # by target (remapped id)
            "native_ids": order,  # target -> native class id
            "known": raw.known,
            "novel": raw.novel,
        },
        "n_old": len(raw.known),
        "n_classes": None if raw.dataset == DISCOVERY else len(order),  # discovery: the novel classes are unknown
        "counts": counts,
        "reference_check": problems if problems else ("ok" if check_counts_applies(raw.dataset, counts) else "n/a"),
        "splits": {
            split: {"n": fingerprint[f"n_{split}"], "written": counts[f"written_{split}"], "shards": done[split]}
            for split in ("train", "test")
        },
        "skipped": skipped,
        "notes": raw.notes,
    }


def check_counts_applies(dataset: str, counts: dict) -> bool:
    """Whether `dataset`'s reference counts apply to `counts` (the reference's own train set)."""
    exp = EXPECTED_COUNTS.get(dataset)
    if exp is None:
        return False
    if "train" in exp:
        return counts.get("train") == exp["train"]
    return counts.get("train", 0) >= exp.get("train_min", 0)


def written_counts(manifest: dict) -> dict[str, int]:
    """What the shards hold: the split's counts less the images skipped as unreadable (labelled, unlabelled, test; for
    your own images labelled, held_out, unlabelled)."""
    c = manifest["counts"]
    if manifest["dataset"] == DISCOVERY:
        return {k: c[k] - n for k, n in discovery_skipped(manifest).items()}
    gone = [(s["split"], bool(s["labelled"])) for s in manifest["skipped"]]
    return {
        "labelled": c["labelled"] - gone.count(("train", True)),
        "unlabelled": c["unlabelled"] - gone.count(("train", False)),
        "test": c["test"] - sum(split == "test" for split, _ in gone),
    }


def discovery_skipped(manifest: dict) -> dict[str, int]:
    """{"labelled", "held_out", "unlabelled"}: how many of each a discovery folder's skipped images were."""

    def part(s: dict) -> str:
        if Path(s["source"]).parts[0] == "unlabelled":
            return "unlabelled"
        return "labelled" if s["labelled"] else "held_out"

    parts = [part(s) for s in manifest["skipped"]]
    return {k: parts.count(k) for k in ("labelled", "held_out", "unlabelled")}


def run_manifest(run: Path, shards: str | None) -> dict:
    """The manifest.json of the shards the run trained on (its config's `data.shards`)."""
    path = Path(shards or "") / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {run} trained on shards without a make-shards manifest, so its images' files are "
            "unknown (the gallery and export need a run on `make-shards --dataset discovery` shards)"
        )
    return read_manifest(path.parent, "train")
