"""`pipe:` and `http(s)://` shards, fetched once into a local cache folder and read from there.

WebDataset names remote shards by URL (`https://host/train-{000000..000099}.tar`) or by a shell command that writes
the shard to stdout (`pipe:aws s3 cp s3://bucket/train-000000.tar -`). Reading them needs random access (the index,
`predict`), so each is fetched once, with a progress bar, into `data.intake.download_cache` under a name derived from
its URL, then used like a local shard; a later open finds it there and fetches nothing. A download is written to a
temporary file and renamed when complete, so an interrupted one leaves nothing behind. Under torchrun the first
process of each machine fetches while the others wait.

A shard pinned in `data.intake.sha256` (URL -> SHA-256) is hashed after its download and on every later open from the
cache: a file that differs is removed and refused, naming the URL and both hashes.

An HTTP download ends with an error when a read waits more than `TIMEOUT_S`, when less than `MIN_RATE` bytes/s arrive
over any `RATE_WINDOW_S` (a server that trickles a byte now and then never hits the read timeout), or when it runs
past `DEADLINE_S` in all. A body without a Content-Length (and not chunked) carries no proof that it is whole: it is
kept only when it is a tar that reads to its end-of-archive marker (or a compressed shard, which the reader refuses
anyway, naming the fix).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from ...common import distributed as dist
from ...common.files import atomic_write, file_sha256
from .tar import compression, ends_with_marker

REMOTE_PREFIXES = ("pipe:", "http://", "https://")
CHUNK = 1 << 20
TIMEOUT_S = 60  # a server that sends nothing for this long fails the download
MIN_RATE = 1024  # bytes/s over each RATE_WINDOW_S: a slower download fails
RATE_WINDOW_S = 60
DEADLINE_S = 6 * 3600  # no one download runs longer
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


def fetch_all(urls: list[str], cache_dir: str | Path, pins: dict[str, str] | None = None) -> list[str]:
    """The local paths of `urls`, fetching those not in `cache_dir` yet (the first process per machine fetches);
    those `pins` names (URL -> SHA-256) are checked (`check_pin`)."""
    local = [cached_path(u, cache_dir) for u in urls]
    if dist.local_rank() == 0:
        missing = [(u, p) for u, p in zip(urls, local, strict=True) if not p.is_file()]
        for i, (url, path) in enumerate(missing):
            fetch(url, path, f"shard {i + 1}/{len(missing)}")
        for url, path in zip(urls, local, strict=True):
            if pins and url in pins:
                check_pin(url, path, pins[url])
    if dist.is_distributed():
        dist.barrier()
    return [str(p) for p in local]


def check_pin(url: str, path: Path, expected: str) -> None:
    """Refuse (and remove) the fetched file of `url` when its SHA-256 is not the pinned `expected` one."""
    got = file_sha256(path)
    if got != expected.lower():
        path.unlink(missing_ok=True)
        raise ValueError(
            f"data.shards {url}: its SHA-256 is {got}, data.intake.sha256 pins {expected.lower()}: the file was "
            "removed; check the URL and the pinned hash"
        )


class _FetchFailed(Exception):
    """Carries a failed fetch's own error through `atomic_write`, which would report an OSError as a disk write."""


def fetch(url: str, path: Path, label: str) -> None:
    """Fetch one shard to `path`, atomically; a clear error names the URL and the fix."""
    copy = _run_pipe if url.startswith("pipe:") else _download
    whole = True  # the transport proved the body whole (a pipe's exit status, a length or HTTP chunks)

    def write(out: BinaryIO) -> None:
        nonlocal whole
        try:
            whole = copy(url, out, bar)
        except (ConnectionError, FileNotFoundError) as err:
            raise _FetchFailed(err) from err

    with tqdm(desc=f"fetching {label}", unit="B", unit_scale=True, leave=False, dynamic_ncols=True) as bar:
        try:
            atomic_write(path, write)
        except _FetchFailed as failed:
            raise failed.args[0] from failed.args[0].__cause__
    if not whole and not _complete_shard(path):
        size = path.stat().st_size
        path.unlink()
        raise ConnectionError(
            f"data.shards {url}: the server sent {size:,} bytes without a Content-Length and they are not a whole tar "
            "(no end-of-archive marker): the download was cut short and is not kept; run again to fetch it again"
        )


def _complete_shard(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(512)
    return compression(head) is not None or ends_with_marker(str(path))


def _download(url: str, out: BinaryIO, bar: tqdm) -> bool:
    """Copy `url`'s body to `out`; whether its length was declared (or chunked), so that a cut is detected."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            expected = _declared_length(response.headers.get("Content-Length"))
            bar.total = expected
            received = _copy(response, out, bar, url)
            chunked = bool(getattr(response, "chunked", False))
    except urllib.error.HTTPError as err:
        raise FileNotFoundError(
            f"data.shards {url}: the server answered HTTP {err.code} ({_one_line(err.reason)}): check the "
            "URL, or download the shards and set data.shards to their folder"
        ) from err
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:  # HTTPException: a garbled answer
        raise ConnectionError(
            f"data.shards {url}: the download failed ({_one_line(err)}): check the URL and the network, or "
            "download the shards and set data.shards to their folder"
        ) from err
    if expected is not None and received != expected:
        raise ConnectionError(
            f"data.shards {url}: the download stopped after {received:,} of {expected:,} "
            "bytes: run again to fetch it again"
        )
    return expected is not None or chunked


def _one_line(err) -> str:
    """An error's text on one line (a redirect loop's or a garbled answer's text spans several)."""
    return " ".join(str(err).split())


def _declared_length(header: str | None) -> int | None:
    """The Content-Length a server declared; None when it declared none, or no valid one (as http.client reads it)."""
    text = (header or "").strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _run_pipe(url: str, out: BinaryIO, bar: tqdm) -> bool:
    command = url[len("pipe:") :]
    # its own session, so that a stop ends the command and whatever it started (`proc.kill` would end the shell only)
    with subprocess.Popen(
        command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    ) as proc:
        try:
            _copy(proc.stdout, out, bar)
            error = proc.stderr.read().decode(errors="replace").strip()
        except BaseException:  # a stop signal, a full disk: Popen's exit would wait for the command to end by itself
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    if proc.returncode != 0:
        raise RuntimeError(
            f"data.shards {url}: the command exited with status {proc.returncode}"
            f"{': ' + error.splitlines()[-1] if error else ''}: fix the command, or fetch the shards "
            "yourself and set data.shards to their folder"
        )
    return True


def _copy(source: BinaryIO, out: BinaryIO, bar: tqdm, url: str | None = None) -> int:
    """Copy `source` to `out`; the bytes copied. With `url` (a download), held to `MIN_RATE` and `DEADLINE_S`:
    `read1` returns what has arrived, so the clock is read at least every `TIMEOUT_S`."""
    received, start = 0, time.monotonic()
    window_start, window_bytes = start, 0
    while chunk := source.read1(CHUNK):
        out.write(chunk)
        received += len(chunk)
        window_bytes += len(chunk)
        bar.update(len(chunk))
        if url is None:
            continue
        now = time.monotonic()
        if now - start > DEADLINE_S:
            raise ConnectionError(
                f"data.shards {url}: the download ran past its {DEADLINE_S:,} s deadline ({received:,} bytes): "
                "download the shards yourself and set data.shards to their folder"
            )
        if now - window_start >= RATE_WINDOW_S:
            if window_bytes < MIN_RATE * (now - window_start):
                raise ConnectionError(
                    f"data.shards {url}: the server sent {window_bytes:,} bytes in {now - window_start:.0f} s, below "
                    f"the {MIN_RATE:,} bytes/s a download must keep: try again later, or download the shards "
                    "yourself and set data.shards to their folder"
                )
            window_start, window_bytes = now, 0
    return received
