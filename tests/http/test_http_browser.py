"""A web page cannot drive the HTTP door (cross-site request forgery, DNS rebinding).

- A body that is not JSON (text/plain, form-urlencoded, multipart or none declared: what a
  page sends without a preflight) gets 415 and runs nothing; JSON with a charset or a +json
  type is served.
- Without an auth file, a Host that is not loopback or `--allowed-host` (a rebound name) gets
  403 on every route but the probes.
- A foreign Origin gets 403; the door's own origin passes, and a listed one (`--allowed-origin`)
  gets its preflight answered and Access-Control-Allow-Origin.
- With an auth file any Host is answered (the token decides), unless `--allowed-host` is set;
  a foreign Origin is still refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from auth import TOKENS, write_auth
from daemons import InProcessDaemon, model_path

from kvkeepd.config.settings import ConfigError, Settings

MODEL = model_path().stem
CONSOLE = "https://console.example"
ALLOWED_HOST = "kvkeep.lan"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    """The default set-up (no auth file, HTTP on loopback), a console's origin and a host listed."""
    d = InProcessDaemon.with_settings(
        tmp_path_factory.mktemp("http-browser"),
        http_address="127.0.0.1:0",
        allowed_origin=CONSOLE,
        allowed_host=ALLOWED_HOST,
    )
    yield d
    d.stop()


def url(d: InProcessDaemon, path: str) -> str:
    assert d.daemon is not None
    return f"http://127.0.0.1:{d.daemon.http_port}{path}"


def generated(d: InProcessDaemon) -> int:
    assert d.daemon is not None and d.daemon.manager is not None
    return d.daemon.manager.engine.stats_generated


def sessions(d: InProcessDaemon) -> int:
    assert d.daemon is not None and d.daemon.manager is not None
    return len(d.daemon.manager.sessions)


def send(d: InProcessDaemon, method: str, path: str, body: Any = None, **headers: str) -> httpx.Response:
    content = json.dumps(body).encode() if body is not None else None
    return httpx.request(method, url(d, path), content=content, headers=headers, timeout=120)


def refused(r: httpx.Response, status: int, code: str) -> bool:
    error = r.json()["error"]
    return r.status_code == status and error["code"] == code and bool(error["message"] and error["type"])


def test_a_body_that_is_not_json_gets_415_and_runs_nothing(door: InProcessDaemon) -> None:
    before, held = generated(door), sessions(door)
    body = json.dumps(CHAT).encode()
    for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None):
        headers = {"content-type": content_type} if content_type else {}
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
            r = httpx.post(url(door, path), content=body, headers=headers, timeout=60)
            assert refused(r, 415, "unsupported_media_type"), (content_type, path, r.text)
    form = httpx.post(url(door, "/v1/chat/completions"), files={"f": ("a.json", body)}, timeout=60)
    assert refused(form, 415, "unsupported_media_type"), form.text
    assert (generated(door), sessions(door)) == (before, held)
    # JSON, however its type is spelled, is served.
    for content_type in (
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/vnd.kvkeep+json",
    ):
        r = send(door, "POST", "/v1/chat/completions", CHAT, **{"content-type": content_type})
        assert r.status_code == 200, (content_type, r.text)


def test_a_host_that_is_not_this_machine_gets_403(door: InProcessDaemon) -> None:
    """A page whose name was made to resolve to 127.0.0.1 sends its own name as Host."""
    assert door.daemon is not None
    port = door.daemon.http_port
    json_type = {"content-type": "application/json"}
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil", "[::2]"):
        for method, path, body in (
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", CHAT),
            ("GET", "/v1/responses/resp_0", None),
            ("DELETE", "/v1/responses/resp_0", None),
        ):
            r = send(door, method, path, body, host=host, **json_type)
            assert refused(r, 403, "host_not_allowed"), (host, method, path, r.text)
    for host in (
        f"127.0.0.1:{port}",
        "127.0.0.1",
        "127.8.9.10",
        f"localhost:{port}",
        "LocalHost.",
        f"[::1]:{port}",
        ALLOWED_HOST,
        f"{ALLOWED_HOST.upper()}:{port}",
    ):
        assert send(door, "GET", "/v1/models", host=host).status_code == 200, host
    # The probes answer anyone.
    assert send(door, "GET", "/health", host="evil.example").status_code == 200


def test_a_foreign_origin_gets_403_and_a_listed_one_gets_cors(door: InProcessDaemon) -> None:
    assert door.daemon is not None
    port = door.daemon.http_port
    json_type = {"content-type": "application/json"}
    before = generated(door)
    for origin in ("https://evil.example", f"http://localhost:{port + 1}", "null"):
        r = send(door, "POST", "/v1/chat/completions", CHAT, origin=origin, **json_type)
        assert refused(r, 403, "origin_not_allowed"), (origin, r.text)
        preflight = send(door, "OPTIONS", "/v1/chat/completions", origin=origin, **{
            "access-control-request-method": "POST", "access-control-request-headers": "content-type"
        })  # fmt: skip
        assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    assert generated(door) == before
    # A page the door serves itself: its origin is the Host it asks.
    own = send(door, "POST", "/v1/chat/completions", CHAT, origin=f"http://127.0.0.1:{port}", **json_type)
    assert own.status_code == 200 and "access-control-allow-origin" not in own.headers
    # A listed origin: the preflight that JSON needs is answered, and the answers name it.
    preflight = send(door, "OPTIONS", "/v1/chat/completions", origin=CONSOLE, **{
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    })  # fmt: skip
    assert preflight.status_code == 204, preflight.text
    assert preflight.headers["access-control-allow-origin"] == CONSOLE
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "content-type" in preflight.headers["access-control-allow-headers"]
    listed = send(door, "POST", "/v1/chat/completions", CHAT, origin=CONSOLE, **json_type)
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == CONSOLE
    assert "origin" in listed.headers["vary"].lower()
    # Even a listed origin sends JSON.
    plain = httpx.post(
        url(door, "/v1/chat/completions"), content=b"{}", headers={"origin": CONSOLE}, timeout=60
    )
    assert refused(plain, 415, "unsupported_media_type")


def test_with_an_auth_file_the_token_decides_and_any_host_is_answered(
    start_daemon: Callable[..., InProcessDaemon], tmp_path: Path
) -> None:
    """Clients elsewhere name a daemon that listens beyond loopback as they please; a page
    cannot add the bearer token. A foreign Origin is refused still, and --allowed-host
    checks the Host again."""
    auth = write_auth(tmp_path / "auth.toml", TOKENS)
    d = start_daemon(http_address="127.0.0.1:0", auth_file=auth)
    token = {"authorization": f"Bearer {TOKENS['alice']}"}
    assert send(d, "GET", "/v1/models", host="daemon.example:8080", **token).status_code == 200
    assert send(d, "GET", "/v1/models", host="daemon.example:8080").status_code == 401
    r = send(d, "GET", "/v1/models", host="daemon.example", origin="https://evil.example", **token)
    assert refused(r, 403, "origin_not_allowed")
    pinned = start_daemon(http_address="127.0.0.1:0", auth_file=auth, allowed_host="daemon.example")
    assert send(pinned, "GET", "/v1/models", host="daemon.example:8080", **token).status_code == 200
    assert refused(send(pinned, "GET", "/v1/models", host="other.example", **token), 403, "host_not_allowed")


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("allowed_host", "http://kvkeep.lan"),
        ("allowed_host", "kvkeep.lan/v1"),
        ("allowed_host", "a b"),
        ("allowed_origin", "console.example"),
        ("allowed_origin", "https://console.example/app"),
        ("allowed_origin", "https://user@console.example"),
    ],
)
def test_a_malformed_allowed_host_or_origin_is_refused_at_start(
    setting: str, value: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=setting.replace("_", "-")):
        Settings(model_path=model_path(), state_dir=tmp_path, **{setting: value}).validate()
