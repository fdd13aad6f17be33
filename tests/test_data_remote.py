"""`http(s)://` and `pipe:` shards: fetched once into the download cache (a second open fetches nothing), read like the
same shards on disk, and every failure named with its URL and the fix, leaving no partial file behind."""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

import pytest

from infosieve_fast.config.settings import IntakeConfig
from infosieve_fast.data.reading.intake import open_foreign, shard_paths
from infosieve_fast.data.reading.remote import cached_path

wds = pytest.importorskip("webdataset")


class CountingHandler(http.server.SimpleHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).requests.append(self.path)
        if self.path.startswith("/truncated/"):  # promises more bytes than it sends, as a dropped connection does
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"x" * 10)
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def shards(realdata, tmp_path_factory) -> Path:
    """6 real CUB images with their class ids in 3 TarWriter shards of 2."""
    out = tmp_path_factory.mktemp("served")
    images = realdata / "cub100" / "images"
    classes = sorted(p for p in images.iterdir() if p.is_dir())[:3]
    files = [(c, sorted(classes[c].iterdir())[i]) for c in range(3) for i in range(2)]
    for s in range(3):
        with wds.TarWriter(str(out / f"train-{s:03d}.tar")) as sink:
            for i in (2 * s, 2 * s + 1):
                c, f = files[i]
                sink.write({"__key__": f"s{i:03d}", "jpg": f.read_bytes(), "cls": c})
    return out


@pytest.fixture(scope="module")
def server(shards):
    handler = functools.partial(CountingHandler, directory=str(shards))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_http_shards_are_fetched_once_and_read_like_local_ones(shards, server, tmp_path):
    cache = tmp_path / "cache"
    CountingHandler.requests.clear()
    opts = IntakeConfig(download_cache=str(cache), index_cache=str(tmp_path / "index"))
    remote = open_foreign(f"{server}/train-{{000..002}}.tar", opts)
    assert sorted(CountingHandler.requests) == [f"/train-{s:03d}.tar" for s in range(3)]
    served = [(shards / f"train-{s:03d}.tar").read_bytes() for s in range(3)]
    assert [Path(u).read_bytes() for u in remote.urls] == served
    local = open_foreign(str(shards), IntakeConfig(index_cache=str(tmp_path / "index2")))
    for field in ("offset", "length", "hw", "cls", "lab"):
        assert (getattr(remote.index, field) == getattr(local.index, field)).all(), field
    assert len(remote.index) == 6 and sorted(set(remote.index.cls.tolist())) == [0, 1, 2]

    again = open_foreign(f"{server}/train-{{000..002}}.tar", opts)
    assert len(CountingHandler.requests) == 3  # nothing fetched again
    assert again.urls == remote.urls and again.reused_index  # the saved index beside the cached shards is reused too


def test_pipe_shards_run_the_command_once(shards, tmp_path):
    cache = tmp_path / "cache"
    url = f"pipe:cat {shards / 'train-001.tar'}"
    [path] = shard_paths(url, str(cache))
    assert Path(path) == cached_path(url, cache) and Path(path).name.endswith("-train-001.tar")
    assert Path(path).read_bytes() == (shards / "train-001.tar").read_bytes()
    (shards / "train-001.tar").rename(shards / "moved.tar")  # the command would now fail: the cache must answer
    try:
        assert shard_paths(url, str(cache)) == [path]
    finally:
        (shards / "moved.tar").rename(shards / "train-001.tar")


def test_a_missing_url_names_the_status_and_the_fix(server, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"/absent\.tar: the server answered HTTP 404 .*set data\.shards"):
        shard_paths(f"{server}/absent.tar", str(tmp_path / "cache"))
    assert not any((tmp_path / "cache").iterdir())


def test_an_interrupted_download_leaves_nothing_behind(server, tmp_path):
    with pytest.raises(ConnectionError, match=r"stopped after 10 of 1,000 bytes: run again"):
        shard_paths(f"{server}/truncated/train-000.tar", str(tmp_path / "cache"))
    assert not any((tmp_path / "cache").iterdir())


def test_a_failing_command_names_its_status_and_error(tmp_path):
    with pytest.raises(RuntimeError, match=r"exited with status 1: .*No such file.*fix the command"):
        shard_paths("pipe:cat /no/such/shard.tar", str(tmp_path / "cache"))
    assert not any((tmp_path / "cache").iterdir())


def test_cache_names_keep_the_shard_name_and_tell_urls_apart(tmp_path):
    a = cached_path("https://a.example/x/train-000.tar", tmp_path)
    b = cached_path("https://b.example/x/train-000.tar", tmp_path)
    assert a != b and a.name.endswith("-train-000.tar") and b.name.endswith("-train-000.tar")
    assert cached_path("pipe:aws s3 cp s3://bucket/part-7.tar -", tmp_path).name.endswith("-part-7.tar")
    assert cached_path("https://h/get?id=3", tmp_path).name.endswith("-shard.tar")
