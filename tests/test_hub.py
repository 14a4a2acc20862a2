"""Models from the Hugging Face Hub (`kvkeep pull`, `kvkeep serve --model hf:...`), through
huggingface_hub, against a Hub on loopback: a small HTTP server that answers the requests the
library makes (`/api/models/OWNER/REPO` with the files' sizes and SHA-256s, and
`/OWNER/REPO/resolve/REVISION/FILE` with range requests) and serves a small GGUF the tests
make. Never the internet: HF_ENDPOINT points at it."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import testmodels
from daemons import DaemonProcess

import kvkeep

REVISION = "0123456789abcdef0123456789abcdef01234567"
REPO = "tests/tiny-GGUF"


@dataclass
class Hub:
    """The files of one repository, served as the Hub serves them; what was asked is noted."""

    files: dict[str, bytes]
    # A SHA-256 to list in place of a file's real one (a corrupt download).
    listed_sha256: dict[str, str] = field(default_factory=dict)
    requests: list[tuple[str, str, str]] = field(default_factory=list)
    url: str = ""

    def listing(self) -> dict[str, Any]:
        siblings = [{"rfilename": "README.md", "size": 10}]
        for name, data in sorted(self.files.items()):
            sha = self.listed_sha256.get(name, hashlib.sha256(data).hexdigest())
            lfs = {"size": len(data), "sha256": sha, "pointerSize": 134}
            siblings.append({"rfilename": name, "size": len(data), "blobId": sha[:40], "lfs": lfs})
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
    assert "tiny-Q8_0.gguf" in done.stderr  # the progress bar names the file
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
