"""Models from the Hugging Face Hub (`kvkeep pull`, `kvkeep serve --model hf:...`), through
huggingface_hub, against a Hub on loopback: a small HTTP server that answers the requests the
library makes (`/api/models/OWNER/REPO` with the files' sizes and SHA-256s, and
`/OWNER/REPO/resolve/REVISION/FILE` with range requests) and serves a small GGUF the tests
make. Never the internet: HF_ENDPOINT points at it."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import testmodels
from daemons import DaemonProcess
from servers import free_port

import kvkeep
from kvkeepd.model import download

REVISION = "0123456789abcdef0123456789abcdef01234567"
REPO = "tests/tiny-GGUF"


@dataclass
class Hub:
    """The files of one repository, served as the Hub serves them; what was asked is noted."""

    files: dict[str, bytes]
    # A SHA-256 to list in place of a file's real one (a corrupt download), a size likewise.
    listed_sha256: dict[str, str] = field(default_factory=dict)
    listed_size: dict[str, int] = field(default_factory=dict)
    requests: list[tuple[str, str, str]] = field(default_factory=list)
    url: str = ""

    def listing(self) -> dict[str, Any]:
        siblings = [{"rfilename": "README.md", "size": 10}]
        for name, data in sorted(self.files.items()):
            sha = self.listed_sha256.get(name, hashlib.sha256(data).hexdigest())
            size = self.listed_size.get(name, len(data))
            lfs = {"size": size, "sha256": sha, "pointerSize": 134}
            siblings.append({"rfilename": name, "size": size, "blobId": sha[:40], "lfs": lfs})
        return {"id": REPO, "modelId": REPO, "sha": REVISION, "private": False, "siblings": siblings}


def _handler(hub: Hub) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            hub.requests.append((self.command, path, self.headers.get("Range", "")))
            if path in (f"/api/models/{REPO}", f"/api/models/{REPO}/revision/main"):
                self._send(200, json.dumps(hub.listing()).encode(), "application/json", body)
                return
            found = re.fullmatch(rf"/{REPO}/resolve/(\w+)/(.+)", path)
            if found is None or found[2] not in hub.files:
                self._send(404, b'{"error": "Entry not found"}', "application/json", body)
                return
            data = hub.files[found[2]]
            start = 0
            ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
            if ranged:
                start = int(ranged[1])
            self.send_response(206 if ranged else 200)
            self.send_header("X-Repo-Commit", REVISION)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self._finish(data[start:], "application/octet-stream", body)

        def _send(self, status: int, data: bytes, kind: str, body: bool) -> None:
            self.send_response(status)
            self.send_header("X-Repo-Commit", REVISION)
            self._finish(data, kind, body)

        def _finish(self, data: bytes, kind: str, body: bool) -> None:
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


@pytest.fixture
def model_bytes() -> bytes:
    return testmodels.path("qwen3").read_bytes()


@pytest.fixture
def hub(model_bytes: bytes) -> Iterator[Hub]:
    """A repository with two quantizations of the tests' small Qwen3 (the same bytes under
    two names, as far as choosing goes) and a projector file that is no model."""
    served = Hub(
        {
            "tiny-Q8_0.gguf": model_bytes,
            "tiny-Q4_K_M.gguf": model_bytes + b"\0" * 64,
            "mmproj-tiny-f16.gguf": b"GGUF not a model",
        }
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(served))
    served.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()


def hub_env(hub: Hub, tmp_path: Path) -> dict[str, str]:
    """The environment of a kvkeep that asks this Hub (and nothing else) for models."""
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_TOKEN": "",
    }


def pull(hub: Hub, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **hub_env(hub, tmp_path)}
    command = [sys.executable, "-c", "from kvkeep.cli import main; main()", "pull", *args]
    command += ["--model-cache", str(tmp_path / "models")]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_pull_downloads_the_quantization_asked_for_and_checks_it(
    hub: Hub, tmp_path: Path, model_bytes: bytes
) -> None:
    done = pull(hub, tmp_path, f"hf:{REPO}:q8_0")
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path == tmp_path / "models" / "tests" / "tiny-GGUF" / "tiny-Q8_0.gguf"
    assert path.read_bytes() == model_bytes
    assert (
        path.with_name("tiny-Q8_0.gguf.sha256").read_text().strip() == hashlib.sha256(model_bytes).hexdigest()
    )
    assert "downloading tiny-Q8_0.gguf" in done.stderr
    # Pulled again: nothing is downloaded, only the listing is read.
    asked = len(hub.requests)
    again = pull(hub, tmp_path, f"hf:{REPO}:Q8_0")
    assert again.returncode == 0 and Path(again.stdout.strip()) == path
    assert [r for r in hub.requests[asked:] if "/resolve/" in r[1]] == []


def test_without_a_quantization_q4_k_m_is_chosen_and_a_missing_one_lists_the_others(
    hub: Hub, tmp_path: Path
) -> None:
    done = pull(hub, tmp_path, f"hf:{REPO}")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).name == "tiny-Q4_K_M.gguf"
    missing = pull(hub, tmp_path, f"hf:{REPO}:IQ2_XS")
    assert missing.returncode == 1
    assert missing.stderr.splitlines() == [f"error: {REPO} has no GGUF file for IQ2_XS; it has: Q4_K_M, Q8_0"]


def test_a_download_cut_short_goes_on_from_where_it_stopped(
    hub: Hub, tmp_path: Path, model_bytes: bytes
) -> None:
    where = tmp_path / "models" / "tests" / "tiny-GGUF"
    where.mkdir(parents=True)
    half = len(model_bytes) // 2
    (where / "tiny-Q8_0.gguf.part").write_bytes(model_bytes[:half])
    done = pull(hub, tmp_path, f"hf:{REPO}:Q8_0")
    assert done.returncode == 0, done.stderr
    gets = [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]
    assert gets == [("GET", f"/{REPO}/resolve/{REVISION}/tiny-Q8_0.gguf", f"bytes={half}-")]
    assert (where / "tiny-Q8_0.gguf").read_bytes() == model_bytes
    assert not (where / "tiny-Q8_0.gguf.part").exists()


def test_a_file_whose_checksum_is_not_the_hubs_is_removed_with_one_line(hub: Hub, tmp_path: Path) -> None:
    hub.listed_sha256["tiny-Q8_0.gguf"] = "ab" * 32
    done = pull(hub, tmp_path, f"hf:{REPO}:Q8_0")
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()[-1:]
    assert line.startswith(f"error: tiny-Q8_0.gguf of hf:{REPO}:Q8_0 does not have the SHA-256 the Hub lists")
    assert "Traceback" not in done.stderr
    where = tmp_path / "models" / "tests" / "tiny-GGUF"
    assert not (where / "tiny-Q8_0.gguf").exists() and not (where / "tiny-Q8_0.gguf.part").exists()


def test_an_unknown_repository_is_one_line(hub: Hub, tmp_path: Path) -> None:
    done = pull(hub, tmp_path, "hf:tests/nothing-here")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith(
        "error: cannot list the files of hf:tests/nothing-here on the Hub: "
    )
    assert "Traceback" not in done.stderr


def test_a_hub_out_of_reach_points_to_a_mirror_and_to_a_local_file(tmp_path: Path) -> None:
    closed = free_port()  # nothing listens there: the connection is refused, as offline
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{closed}", "HF_HUB_DISABLE_TELEMETRY": "1"}
    command = [sys.executable, "-c", "from kvkeep.cli import main; main()", "pull", f"hf:{REPO}"]
    command += ["--model-cache", str(tmp_path / "models")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    line = one_error(done)
    assert line.startswith(
        f"error: cannot reach the Hub at http://127.0.0.1:{closed} to list the files of hf:{REPO} ("
    )
    assert line.endswith(
        "set HF_ENDPOINT to a mirror this machine reaches, or serve a GGUF file it has with --model PATH"
    )


def test_serve_starts_on_a_model_from_the_hub_and_again_without_it(
    hub: Hub, tmp_path: Path, spawn_daemon: Any
) -> None:
    args = ("--model", f"hf:{REPO}:Q8_0", "--model-cache", str(tmp_path / "models"), "--http", "127.0.0.1:0")
    d: DaemonProcess = spawn_daemon(*args, env=hub_env(hub, tmp_path))
    with kvkeep.Client(d.address, timeout=60) as client:
        info = client.info()
        assert info.model_path.endswith("tiny-GGUF/tiny-Q8_0.gguf")
        # The HTTP door lists the model by its file's name and by the name it was asked for.
        listed = httpx.get(f"http://{info.http_address}/v1/models", timeout=30).json()
        assert [m["id"] for m in listed["data"]] == ["tiny-Q8_0", f"{REPO}:Q8_0"]
    assert "downloading tiny-Q8_0.gguf" in d.log()
    # The Hub gone, the daemon starts again on the copy it has.
    assert d.terminate() == 0
    hub.url = "http://127.0.0.1:1"
    d.env = hub_env(hub, tmp_path)
    d.start()
    assert f"using the copy of hf:{REPO}:Q8_0 kept in" in d.log()


def cache_folder(tmp_path: Path) -> Path:
    return tmp_path / "models" / "tests" / "tiny-GGUF"


def one_error(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed pull wrote (its log lines before it aside)."""
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../../../x-Q4_K_M.gguf", "it holds '..'"),
        ("{tmp}/abs-Q4_K_M.gguf", "an absolute path"),
        ("sub\\x-Q4_K_M.gguf", "it holds a backslash"),
        ("x\0-Q4_K_M.gguf", "it holds a control character"),
        ("x\n-Q4_K_M.gguf", "it holds a control character"),
        ("sub//x-Q4_K_M.gguf", "an empty or '.' part"),
    ],
)
def test_a_file_name_that_would_land_outside_the_repositorys_folder_is_refused(
    hub: Hub, tmp_path: Path, model_bytes: bytes, name: str, why: str
) -> None:
    name = name.replace("{tmp}", str(tmp_path))
    hub.files = {"tiny-Q8_0.gguf": model_bytes, name: model_bytes}
    done = pull(hub, tmp_path, f"hf:{REPO}:Q4_K_M")
    assert (
        one_error(done) == f"error: refused the file {name!r} of hf:{REPO}:Q4_K_M: {why}; nothing was written"
    )
    assert not (tmp_path / "x-Q4_K_M.gguf").exists() and not (tmp_path / "abs-Q4_K_M.gguf").exists()
    assert not (cache_folder(tmp_path) / "refs").exists()  # no later start loads it either
    assert [r for r in hub.requests if "/resolve/" in r[1]] == []


def test_the_model_cache_is_private_and_a_file_in_a_folder_stays_in_it(
    hub: Hub, tmp_path: Path, model_bytes: bytes
) -> None:
    hub.files = {"Q8_0/tiny-Q8_0.gguf": model_bytes}
    done = pull(hub, tmp_path, f"hf:{REPO}:Q8_0")
    assert done.returncode == 0, done.stderr
    where = cache_folder(tmp_path)
    assert Path(done.stdout.strip()) == where / "Q8_0" / "tiny-Q8_0.gguf"
    modes = {
        str(p.relative_to(tmp_path)): stat.S_IMODE(p.lstat().st_mode)
        for p in [tmp_path / "models", *sorted((tmp_path / "models").rglob("*"))]
    }
    assert modes == {
        "models": 0o700,
        "models/tests": 0o700,
        "models/tests/tiny-GGUF": 0o700,
        "models/tests/tiny-GGUF/lock": 0o600,
        "models/tests/tiny-GGUF/Q8_0": 0o700,
        "models/tests/tiny-GGUF/Q8_0/tiny-Q8_0.gguf": 0o600,
        "models/tests/tiny-GGUF/Q8_0/tiny-Q8_0.gguf.sha256": 0o600,
        "models/tests/tiny-GGUF/refs": 0o700,
        "models/tests/tiny-GGUF/refs/Q8_0": 0o600,
    }


# Links planted in the cache, each pointing at the victim, and whether the pull is refused
# (a `.sha256` mark is replaced by a file of its own, not written through).
PLANTED = [
    ("", True),
    ("lock", True),
    ("refs", True),
    ("tiny-Q8_0.gguf.part", True),
    ("tiny-Q8_0.gguf", True),
    ("tiny-Q8_0.gguf.sha256", False),
]


@pytest.mark.parametrize(("planted", "refused"), PLANTED)
def test_a_link_planted_in_the_model_cache_is_not_followed(
    hub: Hub, tmp_path: Path, planted: str, refused: bool
) -> None:
    where = cache_folder(tmp_path)
    directory = planted in ("", "refs")
    victim = tmp_path / ("victim-dir" if directory else "victim")
    if directory:
        victim.mkdir()
    else:
        victim.write_bytes(b"precious")
    link = where / planted if planted else where
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    done = pull(hub, tmp_path, f"hf:{REPO}:Q8_0")
    if refused:
        kind = "a directory" if directory else "a file"
        assert one_error(done) == (
            f"error: {link.parent / link.name} is a symbolic link where the daemon keeps {kind} "
            "(the daemon follows no links in its model cache): remove it and start again"
        )
    else:
        assert done.returncode == 0, done.stderr
        assert not link.is_symlink()
        assert link.read_text().strip() == hashlib.sha256(hub.files["tiny-Q8_0.gguf"]).hexdigest()
    assert (list(victim.iterdir()) == []) if directory else (victim.read_bytes() == b"precious")


def test_a_model_larger_than_the_free_space_is_refused_before_it_is_downloaded(
    hub: Hub, tmp_path: Path
) -> None:
    hub.listed_size["tiny-Q8_0.gguf"] = 1 << 50
    done = pull(hub, tmp_path, f"hf:{REPO}:Q8_0")
    where = cache_folder(tmp_path)
    line = one_error(done)
    assert line.startswith(f"error: hf:{REPO}:Q8_0 needs 1048576.0 GiB more in {where}, which has ")
    assert line.endswith(" free: make room, or choose another --model-cache")
    assert [r for r in hub.requests if "/resolve/" in r[1]] == []
    assert not (where / "tiny-Q8_0.gguf.part").exists()


@dataclass
class Source:
    """A file served as a failing server serves it: in pieces of `piece` bytes `pace` seconds
    apart (a drip), falling silent after `stall_after` bytes of each response, and answering
    a range request with the range, or (with `ranges` off) with the whole file from byte 0.
    The Range header of each request is noted, and whether it had an Authorization header;
    `/moved` redirects to the file by another name of the host (`localhost`)."""

    data: bytes
    piece: int = 4096
    pace: float = 0.0
    stall_after: int | None = None
    ranges: bool = True
    asked: list[str] = field(default_factory=list)
    authorized: list[bool] = field(default_factory=list)
    closing: threading.Event = field(default_factory=threading.Event)


def _source_handler(source: Source) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            source.authorized.append("Authorization" in self.headers)
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/model.gguf")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            asked = self.headers.get("Range", "")
            source.asked.append(asked)
            ranged = re.fullmatch(r"bytes=(\d+)-", asked) if source.ranges else None
            start = int(ranged[1]) if ranged else 0
            data = source.data
            self.send_response(206 if ranged else 200)
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            sent = 0
            try:
                for at in range(start, len(data), source.piece):
                    if source.stall_after is not None and sent >= source.stall_after:
                        source.closing.wait()  # silent, the connection held, until the test ends
                        return
                    self.wfile.write(data[at : at + source.piece])
                    self.wfile.flush()
                    sent += source.piece
                    if source.pace:
                        source.closing.wait(source.pace)
            except OSError:  # the client gave up
                pass

    return Handler


@pytest.fixture
def serve() -> Iterator[Any]:
    """serve(source) -> the URL of its file, on loopback."""
    running: list[tuple[http.server.ThreadingHTTPServer, Source]] = []

    def start(source: Source) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _source_handler(source))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        running.append((server, source))
        return f"http://127.0.0.1:{server.server_address[1]}/model.gguf"

    yield start
    for server, source in running:
        source.closing.set()
        server.shutdown()
        server.server_close()


def part_file(tmp_path: Path) -> int:
    return os.open(tmp_path / "model.gguf.part", os.O_RDWR | os.O_CREAT, 0o600)


def test_a_server_that_drips_is_given_up_once_slower_than_the_least_rate(tmp_path: Path, serve: Any) -> None:
    """A byte every 20 ms never reaches a read timeout; a window of 0.5 s at 1 KiB/s ends it."""
    source = Source(os.urandom(4096), piece=1, pace=0.02)
    url = serve(source)
    fd = part_file(tmp_path)
    started = time.monotonic()
    with pytest.raises(download.DownloadError) as failed:
        download.download(url, {}, fd, 4096, download.Limits(read_timeout=5, min_rate=1024, window=0.5))
    took = time.monotonic() - started
    line = str(failed.value)
    assert re.fullmatch(
        r"too slow: [\d.]+ B/s over the last 0\.\d+ s, under the 1\.0 KiB/s a download needs, "
        r"at \d+ B of 4\.0 KiB",
        line,
    ), line
    assert 0.5 <= took < 2.0
    assert source.asked == ["bytes=0-"]  # too slow is not resumed
    kept = os.fstat(fd).st_size
    assert 0 < kept < 100 and (tmp_path / "model.gguf.part").read_bytes() == source.data[:kept]


def test_a_server_that_stalls_is_resumed_while_each_try_brings_more(tmp_path: Path, serve: Any) -> None:
    data = os.urandom(64 << 10)
    limits = download.Limits(read_timeout=0.3, resumes=5)
    source = Source(data, stall_after=16 << 10)
    fd = part_file(tmp_path)
    download.download(serve(source), {}, fd, len(data), limits)
    assert (tmp_path / "model.gguf.part").read_bytes() == data
    assert source.asked == ["bytes=0-", "bytes=16384-", "bytes=32768-", "bytes=49152-"]
    # At most `resumes` of them.
    os.ftruncate(fd, 0)
    source = Source(data, stall_after=16 << 10)
    started = time.monotonic()
    with pytest.raises(download.DownloadError) as failed:
        download.download(serve(source), {}, fd, len(data), dataclasses.replace(limits, resumes=2))
    assert str(failed.value) == "nothing came for 0.3 s at 48.0 KiB of 64.0 KiB, after 2 resumes"
    assert time.monotonic() - started < 2.5
    assert source.asked == ["bytes=0-", "bytes=16384-", "bytes=32768-"]


def test_a_server_that_starts_again_from_byte_0_and_stalls_is_given_up_on_its_second_try(
    tmp_path: Path, serve: Any
) -> None:
    """A server that answers a range request with the whole file, and falls silent after the
    same bytes each time, would be resumed from byte 0 forever."""
    data = os.urandom(64 << 10)
    source = Source(data, stall_after=16 << 10, ranges=False)
    fd = part_file(tmp_path)
    started = time.monotonic()
    with pytest.raises(download.DownloadError) as failed:
        download.download(serve(source), {}, fd, len(data), download.Limits(read_timeout=0.3))
    assert str(failed.value) == (
        "nothing came for 0.3 s at 16.0 KiB of 64.0 KiB (no further than the try before)"
    )
    assert time.monotonic() - started < 2.0
    assert source.asked == ["bytes=0-", "bytes=16384-"]
    assert (tmp_path / "model.gguf.part").read_bytes() == data[: 16 << 10]


def test_a_server_that_answers_nothing_is_given_up_at_once(tmp_path: Path, serve: Any) -> None:
    source = Source(os.urandom(4096), stall_after=0)
    fd = part_file(tmp_path)
    with pytest.raises(download.DownloadError) as failed:
        download.download(serve(source), {}, fd, 4096, download.Limits(read_timeout=0.3))
    assert str(failed.value) == "nothing came for 0.3 s at 0 B of 4.0 KiB"
    assert source.asked == ["bytes=0-"]


def test_the_token_is_not_sent_after_a_redirect_to_another_host(tmp_path: Path, serve: Any) -> None:
    data = os.urandom(4096)
    source = Source(data)
    url = serve(source).replace("/model.gguf", "/moved")
    download.download(url, {"Authorization": "Bearer secret"}, part_file(tmp_path), len(data))
    assert (tmp_path / "model.gguf.part").read_bytes() == data
    assert source.authorized == [True, False]
