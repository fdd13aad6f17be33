"""Fuzzed remote intake: a local server that lies about Content-Length (or sends a garbled one), redirects (in loops
too), stalls past the timeout or answers garbage. Every fetch ends in the served bytes on disk or a one-line error
naming the URL with nothing left in the cache; a shard pinned by SHA-256 in `data.intake.sha256` that differs is
refused naming the URL and both hashes, and removed."""

from __future__ import annotations

import hashlib
import http.server
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infosieve_fast.config.settings import ConfigError, load_config
from infosieve_fast.data.reading import remote
from infosieve_fast.data.reading.intake import shard_paths
from infosieve_fast.data.reading.remote import cached_path

from .fuzz_profiles import no_hang, scaled

TIMEOUT_S = 0.3  # the download timeout during these tests


def payload(n: int) -> bytes:
    return bytes((i * 7 + n) % 256 for i in range(n))


class LyingHandler(http.server.BaseHTTPRequestHandler):
    """GET /?size=N&length=HEADER&redirects=K&stall=BYTES&status=CODE: after K redirects, answers `status` with
    `payload(N)` declaring Content-Length HEADER (omitted when empty), and stalls after BYTES bytes (-1: never)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        q = {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).items()}
        redirects = int(q.get("redirects", 0))
        if redirects:
            target = self.path.replace(f"redirects={redirects}", f"redirects={redirects - 1}")
            if q.get("loop") == "1":
                target = self.path  # a redirect to itself, forever
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if q.get("garbage") == "1":
            self.wfile.write(b"NOT HTTP AT ALL\r\n\r\n")
            return
        body, stall = payload(int(q["size"])), int(q.get("stall", -1))
        self.send_response(int(q.get("status", 200)))
        if q.get("length", ""):
            self.send_header("Content-Length", q["length"])
        self.end_headers()
        if stall >= 0:
            self.wfile.write(body[:stall])
            self.wfile.flush()
            time.sleep(TIMEOUT_S * 4)  # past the client's timeout
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), LyingHandler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setattr(remote, "TIMEOUT_S", TIMEOUT_S)


answers = st.fixed_dictionaries(
    {
        "size": st.integers(0, 3000),
        "length": st.one_of(
            st.just("exact"),
            st.just(""),
            st.integers(0, 5000).map(str),
            st.sampled_from(["-5", "abc", "1e3", " 12", "99999999999999"]),
        ),
        "redirects": st.integers(0, 3),
        "loop": st.sampled_from(["0", "0", "1"]),
        "stall": st.one_of(st.just(-1), st.just(-1), st.integers(0, 3000)),
        "status": st.sampled_from([200, 200, 200, 404, 500]),
        "garbage": st.sampled_from(["0"] * 9 + ["1"]),
    }
)


@settings(max_examples=scaled(25))
@given(answers)
def test_a_lying_or_stalling_server_ends_in_the_bytes_or_a_named_error(server, answer):
    if answer["length"] == "exact":
        answer["length"] = str(answer["size"])
    url = f"{server}/shard.tar?{urllib.parse.urlencode(answer)}"
    body = payload(answer["size"])
    with tempfile.TemporaryDirectory() as cache:
        with no_hang(30):
            try:
                [path] = shard_paths(url, cache)
            except (ConnectionError, FileNotFoundError) as exn:
                assert url in str(exn) and "\n" not in str(exn)
                assert not any(Path(cache).iterdir())  # nothing half-written left behind
                return
        data = Path(path).read_bytes()
    declared = answer["length"].strip()
    # a server may declare fewer bytes than it sends: the client reads what it declared (a SHA-256 pin catches it)
    want = body[: int(declared)] if declared.isdigit() and int(declared) <= len(body) else body
    assert answer["status"] == 200 and answer["garbage"] == "0" and (answer["loop"] == "0" or not answer["redirects"])
    assert answer["stall"] < 0 or answer["stall"] >= len(want)
    assert data == want


def test_a_pinned_shard_is_kept_when_its_hash_matches_and_removed_when_not(server, tmp_path):
    url = f"{server}/shard.tar?size=2000&length=1000"  # the server cuts the shard to the 1000 bytes it declares
    got = hashlib.sha256(payload(2000)[:1000]).hexdigest()
    want = hashlib.sha256(payload(2000)).hexdigest()
    with pytest.raises(ValueError) as err:
        shard_paths(url, str(tmp_path / "cache"), {url: want})
    message = str(err.value)
    assert url in message and got in message and want in message and "\n" not in message
    assert not cached_path(url, tmp_path / "cache").exists()  # the download is removed
    [path] = shard_paths(url, str(tmp_path / "cache"), {url: got.upper()})  # a pin matches in either case
    assert Path(path).read_bytes() == payload(2000)[:1000]
    Path(path).write_bytes(b"swapped in the cache")  # a later open hashes the cached file again
    with pytest.raises(ValueError, match="data.intake.sha256 pins"):
        shard_paths([url], str(tmp_path / "cache"), {url: got})
    assert not Path(path).exists()


def test_a_pin_that_is_no_sha256_is_refused_when_the_config_loads(tmp_path):
    url = "https://host/train-000.tar"
    cfg = load_config(None, [f"data.intake.sha256={{'{url}': '{'ab' * 32}'}}"])
    assert cfg.data.intake.sha256 == {url: "ab" * 32}
    with pytest.raises(ConfigError, match=r"data.intake.sha256\['https://host/train-000.tar'\] must be .* got 'abc'"):
        load_config(None, [f"data.intake.sha256={{'{url}': abc}}"])
    with pytest.raises(ConfigError, match="maps remote shard URLs .* not '/local/train.tar'"):
        load_config(None, [f"data.intake.sha256={{'/local/train.tar': '{'ab' * 32}'}}"])
