"""Downloads are held to a minimum rate and a deadline, and a body without a Content-Length is kept only when it is a
whole tar. Before: a server sending a byte now and then kept a download "fetching" for ever (every read came within
the read timeout), a tar cut between two members and sent without a length was cached and read as a smaller shard,
and a cut or timed-out download ended `infosieve train` in a ConnectionError traceback."""

from __future__ import annotations

import http.server
import io
import tarfile
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from infosieve_fast import cli
from infosieve_fast.data.reading import remote
from infosieve_fast.data.reading.intake import shard_paths
from infosieve_fast.data.reading.remote import cached_path

from .fuzz_profiles import no_hang


def tar_bytes(n: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(n):
            data = bytes([i]) * 700
            info = tarfile.TarInfo(f"s{i:03d}.bin")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


WHOLE = tar_bytes(6)
CUT = WHOLE[: 3 * (512 + 1024)]  # three whole members: a tar cut between two of them reads as a smaller shard


class Handler(http.server.BaseHTTPRequestHandler):
    """GET /whole, /cut: the tar without a Content-Length; /trickle?every=S&n=N: N bytes, one every S seconds."""

    protocol_version = "HTTP/1.0"  # the body ends when the connection closes, as a server without a length sends it

    def do_GET(self):  # noqa: N802 (http.server's name)
        url = urllib.parse.urlsplit(self.path)
        q = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
        self.send_response(200)
        self.end_headers()
        if url.path == "/trickle":
            try:
                for _ in range(int(q["n"])):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(float(q["every"]))
            except BrokenPipeError:  # the client gave up, as it should
                pass
            return
        self.wfile.write(WHOLE if url.path == "/whole" else CUT)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_tar_without_a_length_is_kept_only_when_whole(server, tmp_path):
    [path] = shard_paths(f"{server}/whole", str(tmp_path))
    assert Path(path).read_bytes() == WHOLE
    url = f"{server}/cut"
    with pytest.raises(ConnectionError) as err:
        shard_paths(url, str(tmp_path))
    message = str(err.value)
    assert message.startswith(f"data.shards {url}: the server sent {len(CUT):,} bytes without a Content-Length")
    assert "\n" not in message
    assert not cached_path(url, tmp_path).exists() and not list(tmp_path.glob(".*.tmp"))  # nothing kept


def test_a_trickling_server_fails_the_minimum_rate(server, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "RATE_WINDOW_S", 0.3)  # 1024 bytes/s over 0.3 s; the server sends 10 bytes/s
    url = f"{server}/trickle?every=0.1&n=100"
    slow = r"bytes in 0 s, below the 1,024 bytes/s a download must keep"
    with no_hang(5), pytest.raises(ConnectionError, match=slow):
        shard_paths(url, str(tmp_path))
    assert not cached_path(url, tmp_path).exists()


def test_a_download_past_its_deadline_fails(server, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "DEADLINE_S", 0.3)
    url = f"{server}/trickle?every=0.05&n=100"
    with no_hang(5), pytest.raises(ConnectionError, match=r"the download ran past its 0.3 s deadline"):
        shard_paths(url, str(tmp_path))


def test_a_failed_download_ends_train_in_one_line(server, tmp_path, capsys):
    url = f"{server}/cut"
    argv = ["train", "--config", "configs/demo.yaml", "--set", "data.source=shards", "--data.shards", url]
    argv += ["--set", f"data.intake.download_cache={tmp_path / 'cache'}", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err  # after the progress bar's line, cleared
    assert "Traceback" not in err and err.count("error: ") == 1
    assert err.rsplit("\r", 1)[-1].startswith(f"error: data.shards {url}: the server sent")
