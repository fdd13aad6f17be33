"""Shards from anywhere: `data.shards` as a folder, a brace pattern, a glob or a list; foreign WebDataset samples read
by configurable keys; the GCD split of foreign shards; and the index saved beside the shards and reused.

Foreign shards (any WebDataset tar, e.g. written by `webdataset.TarWriter` with `.jpg` + `.cls`) are read with the
keys of `data.intake` (`config.IntakeConfig`): the image is the first of `image_keys` present (multi-dot keys such as
`input.jpg` work), the label an integer class id or a class name under `label_key`, or in the field `label_field` of
that (json) member. `class_list` names the classes, one per line (line i = class id i). The known/novel split is
computed over the samples in storage order exactly as `make-shards` computes it over a dataset's native order
(`splits.gcd_split`: known classes default to the first half of the ids, `labelled_prop` of their images labelled,
chosen by `split_seed`), so the same images in the same order get the same split either way. make-shards' own tars
(their samples hold `.uq`/`.lab`) are refused on this route: their split lives in the folder's manifest.json.

The index (`tar.index_rows`: one header walk over every shard) is saved as `.infosieve-index-<hash>.npz` beside the
shards, or in `data.intake.index_cache` when their folder is read-only, with every shard's size and modification
time and a sha256 of its own contents: an open whose shards match reuses it instead of walking the headers again; a
saved index that is damaged, edited or of another version is rebuilt.
"""

from __future__ import annotations

import glob
import hashlib
import json
import mmap
import os
import re
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ...common.files import atomic_write
from ...common.limits import MAX_CLASSES
from ...config.settings import IntakeConfig
from ..shard_manifest import MANIFEST, ManifestError
from ..splits import gcd_split
from .remote import SHARD_SUFFIXES, fetch_all, is_remote
from .tar import SampleKeys, ShardIndex, index_rows, make_shards_index, member_bytes, open_mmap, sample_spans

INDEX_VERSION = 1
DEFAULT_IMAGE_KEYS = "jpg;jpeg;png;webp"
DEFAULT_INDEX_CACHE = "~/.cache/infosieve/index"
DEFAULT_DOWNLOAD_CACHE = "~/.cache/infosieve/shards"
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(\d+)\.\.(\d+)")


# ---- data.shards -> shard paths ------------------------------------------------------------------------------------


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace expansion: `{000..009}` (zero-padded to the bounds' width when they are) and `{a,b}`."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    r = _RANGE.fullmatch(m.group(1))
    if r:
        lo, hi = r.groups()
        width = max(len(lo), len(hi)) if lo.startswith("0") or hi.startswith("0") else 0
        step = 1 if int(hi) >= int(lo) else -1
        items = [f"{i:0{width}d}" for i in range(int(lo), int(hi) + step, step)]
    else:
        items = m.group(1).split(",")
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [out for item in items for out in expand_braces(head + item + tail)]


def is_manifest_folder(spec) -> bool:
    """`spec` names a folder written by `infosieve make-shards`."""
    return isinstance(spec, (str, Path)) and (Path(spec) / MANIFEST).is_file()


def shard_paths(
    spec: str | Path | list, download_cache: str = DEFAULT_DOWNLOAD_CACHE, pins: dict[str, str] | None = None
) -> list[str]:
    """The shard files `data.shards` names: a folder (its tars, sorted), a brace pattern, a glob, a file, `pipe:` or
    `http(s)://` shards (brace patterns too; fetched once into `download_cache`, checked against their SHA-256 in
    `pins`, data/reading/remote.py), or a list of any of these (concatenated in order)."""
    if isinstance(spec, (list, tuple)):
        paths = [p for item in spec for p in shard_paths(item, download_cache, pins)]
        if not paths:
            raise FileNotFoundError("data.shards is an empty list: name at least one shard")
        return paths
    text = str(spec)
    if is_remote(text):
        return fetch_all(expand_braces(text), download_cache, pins)
    path = Path(text).expanduser()
    if path.is_dir():
        found = sorted(str(p) for p in path.iterdir() if p.name.endswith(SHARD_SUFFIXES) and p.is_file())
        if not found:
            raise FileNotFoundError(f"data.shards {text}: the folder holds no .tar shards")
        return found
    if "{" in text:
        expanded = [str(Path(p).expanduser()) for p in expand_braces(text)]
        absent = [p for p in expanded if not Path(p).is_file()]
        if absent:
            raise FileNotFoundError(
                f"data.shards {text}: {len(absent)} of the {len(expanded)} shards it names are missing (first: "
                f"{absent[0]}): fix the pattern's range"
            )
        return expanded
    if glob.has_magic(text):
        found = sorted(glob.glob(str(path)))
        if not found:
            raise FileNotFoundError(f"data.shards {text}: the pattern matches no file")
        return found
    if path.is_file():
        if path.name == MANIFEST:
            raise ManifestError(
                f"data.shards {text} is the manifest of a make-shards folder, not a shard: point data.shards at its "
                f"folder, {path.parent}"
            )
        return [str(path)]
    raise FileNotFoundError(f"data.shards {text}: no such folder or file")


def _first_sample_members(path: str) -> set[str]:
    """The member extensions of the first sample of the tar at `path` (none when it cannot be read: its indexing
    reports why)."""
    try:
        mm = open_mmap(path)
    except (OSError, ValueError, tarfile.ReadError):
        return set()
    try:
        return next((set(parts) for _, parts in sample_spans(mm)), set())
    except tarfile.ReadError:
        return set()
    finally:
        mm.close()


def refuse_make_shards_tars(spec, urls: list[str]) -> None:
    """make-shards' tars read as foreign shards would lose their split (test samples trained on, the known classes
    guessed): refuse them when their first sample holds make-shards' cls/uq/lab members, naming the way back."""
    if not set(SampleKeys().fields) <= _first_sample_members(urls[0]):
        return
    folder = Path(urls[0]).parent
    if (folder / MANIFEST).is_file():
        raise ManifestError(
            f"data.shards {spec}: these are shards of the make-shards folder {folder}: point data.shards at the "
            "folder itself (its manifest.json holds their split)"
        )
    what = f"data.shards {spec} is" if Path(str(spec)).is_dir() else f"data.shards {spec}: {folder} is"
    raise ManifestError(
        f"{what} a make-shards folder that lost its manifest.json (its shards hold make-shards' .uq/.lab members, "
        "whose split only the manifest records): restore manifest.json from where the folder came from, or run "
        "make-shards again"
    )


# ---- foreign samples ---------------------------------------------------------------------------------------------


def parse_image_keys(text: str) -> tuple[str, ...]:
    """'jpg;jpeg;png' -> ('jpg', 'jpeg', 'png'), lower case as member extensions are compared."""
    keys = tuple(k.strip().lower().lstrip(".") for k in text.split(";") if k.strip())
    if not keys:
        raise ValueError(f"data.intake.image_keys {text!r} names no key: give e.g. 'jpg;jpeg;png;webp'")
    return keys


def read_class_list(path: str | Path) -> list[str]:
    """Class names, one per line (blank lines ignored): line i names class id i."""
    names = [line.strip() for line in Path(path).expanduser().read_text().splitlines() if line.strip()]
    if not names:
        raise ValueError(f"data.intake.class_list {path} names no class: write one class name per line")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"data.intake.class_list {path} names {dup[:5]} more than once: class names must be unique")
    return names


@dataclass(frozen=True)
class ForeignKeys(SampleKeys):
    """A foreign sample: its image under the first of `image` present, its label (one field) under `fields[0]`, or in
    the field `label_field` of that member's JSON. A label is a class id or, with `class_names`, a class name."""

    fields: tuple[str, ...] = ("cls",)
    label_field: str | None = None
    class_names: tuple[str, ...] = ()

    def read(self, mm: mmap.mmap, parts: dict) -> list[int]:
        raw = member_bytes(mm, parts[self.fields[0]])
        if self.label_field is None:
            value = raw.decode("utf-8", "replace").strip()
        else:
            record = json.loads(raw)
            if not isinstance(record, dict) or self.label_field not in record:
                raise ValueError(f"its json has no field {self.label_field!r}")
            value = record[self.label_field]
        return [self.class_id(value)]

    @cached_property
    def _ids(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.class_names)}

    def class_id(self, value) -> int:
        """A label's class id: an integer id (within the class list when there is one) or a class name."""
        text = str(value).strip()
        if text.lstrip("-").isdigit():
            cid = int(text)
            if cid < 0 or (self.class_names and cid >= len(self.class_names)):
                raise ValueError(f"label {cid} is outside the class list's ids 0..{len(self.class_names) - 1}")
            if cid >= MAX_CLASSES:  # the class count is the largest id + 1: one damaged label would size every table
                raise ValueError(
                    f"label {cid:,} is above the largest class id taken, {MAX_CLASSES - 1:,} (set "
                    "data.intake.class_list to name the classes)"
                )
            return cid
        if text in self._ids:
            return self._ids[text]
        where = "the class list" if self.class_names else "data.intake.class_list (none set)"
        raise ValueError(f"label {text!r} is not a class id and not in {where}")


def foreign_keys(opts: IntakeConfig) -> ForeignKeys:
    """The keys foreign samples are read with (`data.intake`), the class list read."""
    names = tuple(read_class_list(opts.class_list)) if opts.class_list else ()
    return ForeignKeys(parse_image_keys(opts.image_keys), (opts.label_key.lower(),), opts.label_field, names)


@dataclass
class ForeignSet:
    """An opened set of foreign shards: its index (split computed), classes and the problems met."""

    urls: list[str]
    index: ShardIndex
    class_names: list[str]
    n_old: int
    problems: list[str]
    reused_index: bool


def split_classes(labels: np.ndarray, keys: ForeignKeys, known: list | None) -> tuple[list[int], list[int]]:
    """(known class ids, novel class ids) as make-shards' imagefolder layout sets them: the class list's ids (or
    0..max label), known = `known` (ids or names) or the first half."""
    n = len(keys.class_names) if keys.class_names else int(labels.max(initial=-1)) + 1
    ids = [keys.class_id(k) for k in known] if known is not None else list(range(n // 2))
    return ids, sorted(set(range(n)) - set(ids))


def open_foreign(spec, opts: IntakeConfig, processes: int | None = None) -> ForeignSet:
    """Index (or reuse the saved index of) the foreign shards `spec` names and compute their GCD split."""
    urls = shard_paths(spec, opts.download_cache, opts.sha256)
    refuse_make_shards_tars(spec, urls)
    keys = foreign_keys(opts)
    arrays, problems, reused = cached_index(
        urls, {"kind": "foreign", "keys": repr(keys)}, lambda: _build_rows(urls, keys, processes), opts.index_cache
    )
    shard, rows = arrays["shard"], arrays["rows"]
    if len(rows) == 0:
        raise ValueError(f"data.shards {spec}: no readable sample in {len(urls)} shard(s): {'; '.join(problems[:3])}")
    labels = rows[:, 4]
    known, novel = split_classes(labels, keys, opts.known_classes)
    labelled, targets = gcd_split(labels, known, opts.labelled_prop, opts.split_seed, novel_classes=novel)
    names = list(keys.class_names) or [str(c) for c in range(len(known) + len(novel))]
    index = ShardIndex(
        shard,
        rows[:, 0],
        rows[:, 1],
        rows[:, 2:4],
        targets.astype(np.int64),
        np.arange(len(rows), dtype=np.int64),
        labelled.astype(bool),
    )
    return ForeignSet(urls, index, [names[c] for c in known + novel], len(known), problems, reused)


def make_shards_index_cached(urls: list[str], cache_dir: str) -> tuple[ShardIndex, list[str], bool]:
    """(index, problems, reused) of make-shards' shards `urls`, through the saved index."""
    arrays, problems, reused = cached_index(
        urls, {"kind": "make-shards"}, lambda: _build_rows(urls, SampleKeys(), None), cache_dir
    )
    return make_shards_index(arrays["shard"], arrays["rows"]), problems, reused


def _build_rows(urls: list[str], keys: SampleKeys, processes: int | None) -> tuple[dict[str, np.ndarray], list[str]]:
    shard, rows, problems = index_rows(urls, keys, processes)
    return {"shard": shard, "rows": rows}, problems


# ---- the saved index -----------------------------------------------------------------------------------------------


def _file_stats(urls: list[str]) -> list[list]:
    """[path, size, mtime in ns] per shard; -1, -1 for a missing one (its absence is part of what was indexed)."""
    out = []
    for u in urls:
        try:
            st = os.stat(u)
            out.append([u, st.st_size, st.st_mtime_ns])
        except OSError:
            out.append([u, -1, -1])
    return out


def index_locations(urls: list[str], settings: dict, cache_dir: str) -> list[Path]:
    """Where the index of `urls` read with `settings` is kept: beside the first shard, then in the cache folder."""
    ident = json.dumps({"urls": [os.path.abspath(u) for u in urls], **settings}, sort_keys=True)
    name = f".infosieve-index-{hashlib.sha1(ident.encode()).hexdigest()[:16]}.npz"
    return [Path(urls[0]).resolve().parent / name, Path(cache_dir).expanduser() / name]


def _digest(meta: dict, arrays: dict[str, np.ndarray], problems: list[str]) -> str:
    """sha256 of an index's contents: a saved index whose arrays were edited after it was written does not match."""
    h = hashlib.sha256(json.dumps([meta, problems], sort_keys=True).encode("utf-8", "surrogateescape"))
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _load_saved(path: Path, meta: dict) -> tuple[dict[str, np.ndarray], list[str]] | None:
    """The saved arrays and problems at `path` when they were built from exactly these shard files and are as they
    were written, else None (rebuild)."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            if json.loads(str(saved["meta"])) != meta:
                return None
            arrays = {k: saved[k] for k in saved.files if k not in ("meta", "problems", "digest")}
            problems, digest = [str(p) for p in saved["problems"]], str(saved["digest"])
    except Exception:  # a cache: anything wrong with the file (a damaged zip raises BadZipFile, NotImplementedError)
        return None
    return (arrays, problems) if digest == _digest(meta, arrays, problems) else None


def _save(path: Path, meta: dict, arrays: dict[str, np.ndarray], problems: list[str]) -> bool:
    """Write the index atomically; False when the folder is not writable."""
    fields = {"meta": np.asarray(json.dumps(meta)), "problems": np.asarray(problems, dtype=str), **arrays}
    fields["digest"] = np.asarray(_digest(meta, arrays, problems))
    try:
        atomic_write(path, lambda f: np.savez(f, **fields))
        return True
    except OSError:
        return False


def cached_index(
    urls: list[str], settings: dict, build: Callable[[], tuple[dict[str, np.ndarray], list[str]]], cache_dir: str
) -> tuple[dict[str, np.ndarray], list[str], bool]:
    """(arrays, problems, reused) of the index of `urls`: the saved one when every shard still has the size and
    modification time it was built from, else `build()`, then saved beside the shards or in `cache_dir`."""
    meta = {"version": INDEX_VERSION, "settings": settings, "files": _file_stats(urls)}
    places = index_locations(urls, settings, cache_dir)
    for place in places:
        saved = _load_saved(place, meta)
        if saved is not None:
            return *saved, True
    arrays, problems = build()
    if not any(_save(place, meta, arrays, problems) for place in places):
        where = " or ".join(map(str, places))
        print(
            f"infosieve data: WARNING: the shard index could not be saved in {where}: it is rebuilt on every open "
            "(set data.intake.index_cache to a writable folder)",
            file=sys.stderr,
        )
    return arrays, problems, False
