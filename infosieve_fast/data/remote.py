"""`pipe:` and `http(s)://` shards, fetched once into a local cache folder and read from there.

WebDataset names remote shards by URL (`https://host/train-{000000..000099}.tar`) or by a shell command that writes
the shard to stdout (`pipe:aws s3 cp s3://bucket/train-000000.tar -`). Reading them needs random access (the index,
`predict`), so each is fetched once, with a progress bar, into `data.intake.download_cache` under a name derived from
its URL, then used like a local shard; a later open finds it there and fetches nothing. A download is written to a
temporary file and renamed when complete, so an interrupted one leaves nothing behind. Under torchrun the first
process of each machine fetches while the others wait.
"""

from __future__ import annotations

import hashlib
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from .. import distributed as dist
from ..checkpoint import atomic_write

REMOTE_PREFIXES = ("pipe:", "http://", "https://")
CHUNK = 1 << 20
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # a folder's compressed shards are listed too, to be reported


def is_remote(spec: str) -> bool:
    return spec.startswith(REMOTE_PREFIXES)


def cached_path(url: str, cache_dir: str | Path) -> Path:
    """Where `url`'s shard is kept: a hash of the whole URL (two buckets may hold the same file name), then the
    shard's own name where the URL shows one (a pipe: command's last word that ends like a shard)."""
    words = url.split("?")[0].rstrip("/").rsplit("/", 1)[-1].split()
    names = [Path(w).name for w in words if w.endswith(SHARD_SUFFIXES)]
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / f"{digest}-{(names or ['shard.tar'])[-1]}"


def fetch_all(urls: list[str], cache_dir: str | Path) -> list[str]:
    """The local paths of `urls`, fetching those not in `cache_dir` yet (the first process per machine fetches)."""
    local = [cached_path(u, cache_dir) for u in urls]
    if dist.local_rank() == 0:
        missing = [(u, p) for u, p in zip(urls, local, strict=True) if not p.is_file()]
        for i, (url, path) in enumerate(missing):
            fetch(url, path, f"shard {i + 1}/{len(missing)}")
    if dist.is_distributed():
        dist.barrier()
    return [str(p) for p in local]


def fetch(url: str, path: Path, label: str) -> None:
    """Fetch one shard to `path`, atomically; a clear error names the URL and the fix."""
    with tqdm(desc=f"fetching {label}", unit="B", unit_scale=True, leave=False, dynamic_ncols=True) as bar:
        if url.startswith("pipe:"):
            atomic_write(path, lambda out: _run_pipe(url, out, bar))
        else:
            atomic_write(path, lambda out: _download(url, out, bar))


def _download(url: str, out: BinaryIO, bar: tqdm) -> None:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            expected = response.headers.get("Content-Length")
            bar.total = int(expected) if expected else None
            received = _copy(response, out, bar)
    except urllib.error.HTTPError as err:
        raise FileNotFoundError(
            f"data.shards {url}: the server answered HTTP {err.code} ({err.reason}): check the "
            "URL, or download the shards and set data.shards to their folder"
        ) from err
    except (urllib.error.URLError, OSError) as err:
        raise ConnectionError(
            f"data.shards {url}: the download failed ({err}): check the URL and the network, or "
            "download the shards and set data.shards to their folder"
        ) from err
    if expected is not None and received != int(expected):
        raise ConnectionError(
            f"data.shards {url}: the download stopped after {received:,} of {int(expected):,} "
            "bytes: run again to fetch it again"
        )


def _run_pipe(url: str, out: BinaryIO, bar: tqdm) -> None:
    command = url[len("pipe:") :]
    with subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        _copy(proc.stdout, out, bar)
        error = proc.stderr.read().decode(errors="replace").strip()
    if proc.returncode != 0:
        raise RuntimeError(
            f"data.shards {url}: the command exited with status {proc.returncode}"
            f"{': ' + error.splitlines()[-1] if error else ''}: fix the command, or fetch the shards "
            "yourself and set data.shards to their folder"
        )


def _copy(source: BinaryIO, out: BinaryIO, bar: tqdm) -> int:
    received = 0
    while chunk := source.read(CHUNK):
        out.write(chunk)
        received += len(chunk)
        bar.update(len(chunk))
    return received
