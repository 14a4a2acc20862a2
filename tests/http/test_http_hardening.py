"""The HTTP door against hostile or careless clients.

- A client that leaves before its whole (non-streamed) response stops its generation, and
  the slots it held serve others at once.
- Idle and slow connections are closed after --http-read-timeout, a peer holds at most
  --http-connections-per-peer connections, and thousands of idle connections (from many
  loopback addresses: all of 127.0.0.0/8 is this machine's) do not keep the door from serving.
- A session id of another tenant changes nothing: the door's kept session stays its tenant's.
- A request cannot forge a line of the log: line breaks and escapes in its path or in a field
  the log names are escaped, in text and JSON logs alike.
"""

from __future__ import annotations

import json
import resource
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from auth import TOKENS, write_auth
from daemons import DaemonProcess, InProcessDaemon, model_path, wait_until

import kvkeep
from kvkeepd.api.http.door import HttpDoor

MODEL = model_path().stem
READ_TIMEOUT = 5.0
PER_PEER = 8
# Idle connections opened at once (and as many descriptors on the daemon's side, which runs
# in this process): more than the 1,024 requests the door serves at once.
IDLE = 2000
# A counting prompt: greedy, it goes on counting for far more than the tokens asked for.
COUNTING = "1, 2, 3, 4, 5,"


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    """Two tenants over HTTP, a short read timeout and a small bound per peer."""
    root = tmp_path_factory.mktemp("http-hardening")
    d = InProcessDaemon.with_settings(
        root / "state",
        http_address="127.0.0.1:0",
        auth_file=write_auth(root / "auth.toml", TOKENS),
        http_read_timeout=READ_TIMEOUT,
        http_connections_per_peer=PER_PEER,
    )
    yield d
    d.stop()


def port(d: InProcessDaemon) -> int:
    assert d.daemon is not None
    return d.daemon.http_port


def http_door(d: InProcessDaemon) -> HttpDoor:
    assert d.daemon is not None and d.daemon._http is not None
    return d.daemon._http


def generated(d: InProcessDaemon) -> int:
    """Tokens the daemon's engine has generated, for any tenant."""
    assert d.daemon is not None and d.daemon.manager is not None
    return d.daemon.manager.engine.stats_generated


def post(d: InProcessDaemon, path: str, body: dict[str, Any], tenant: str = "alice") -> httpx.Response:
    url = f"http://127.0.0.1:{port(d)}/v1{path}"
    return httpx.post(url, json=body, headers={"authorization": f"Bearer {TOKENS[tenant]}"}, timeout=120)


def request_bytes(path: str, body: dict[str, Any], tenant: str = "alice") -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST /v1{path} HTTP/1.1\r\nhost: kvkeep\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {TOKENS[tenant]}\r\ncontent-length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def connect(d: InProcessDaemon, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port(d)))
    return s


def closed_by_peer(s: socket.socket, within: float) -> bool:
    """Whether the daemon closes `s` within `within` seconds (nothing is sent to it)."""
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_client_that_leaves_a_whole_response_stops_its_generation(door: InProcessDaemon) -> None:
    """Four non-streamed requests of 300 tokens whose clients leave after 0.3 s generate far
    fewer, and a small request beside them (queued behind them: the daemon has 4 slots) is
    answered as soon as they have left."""
    before = generated(door)
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 300, "temperature": 0}
    leaving = [connect(door) for _ in range(4)]
    for s in leaving:
        s.sendall(request_bytes("/completions", body))
    small: dict[str, Any] = {}

    def ask() -> None:
        start = time.monotonic()
        r = post(door, "/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        small.update(status=r.status_code, seconds=time.monotonic() - start, generated=generated(door))

    asker = threading.Thread(target=ask)
    asker.start()
    time.sleep(0.3)
    for s in leaving:
        s.close()
    asker.join(180)
    assert small["status"] == 200
    # Once one of them had generated all its 300 tokens, a slot would have been free.
    assert small["generated"] - before < 300, small
    door.run(door.daemon.manager.settle(), 60)  # type: ignore[union-attr]
    assert generated(door) - before - 4 < 300


def test_idle_and_slow_connections_are_closed_and_do_not_close_the_door(door: InProcessDaemon) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * IDLE + 1000  # both ends of each connection live in this process
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
        if min(want, hard) < want:
            pytest.skip(f"needs {want} file descriptors; the hard limit is {hard}")
    held = http_door(door).peers
    idle: list[socket.socket] = []
    try:
        # PER_PEER from each of 250 loopback addresses (127.0.1.0 and up).
        opened = time.monotonic()
        for i in range(IDLE):
            n = 256 + i // PER_PEER
            idle.append(connect(door, f"127.0.{n // 256}.{n % 256}"))
        wait_until(lambda: held.held >= IDLE, 30, "the daemon to hold the idle connections")

        # A slow client: a request head trickled in a byte at a time, never finished.
        slow = connect(door, "127.0.0.3")
        idle.append(slow)
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: kvkeep\r\nx-slow: ")
        # A body that never arrives whole.
        half = connect(door, "127.0.0.3")
        idle.append(half)
        half.sendall(request_bytes("/completions", {"model": MODEL, "prompt": "Hi"})[:-3])

        # Authorized requests are served meanwhile, on new and kept-alive connections.
        with httpx.Client(headers={"authorization": f"Bearer {TOKENS['alice']}"}, timeout=60) as c:
            url = f"http://127.0.0.1:{port(door)}/v1"
            assert c.get(f"{url}/models").status_code == 200
            r = c.post(f"{url}/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
            assert r.status_code == 200, r.text
        assert time.monotonic() - opened < READ_TIMEOUT and held.held >= IDLE  # all still open

        # At the bound on connections in all (half the descriptors; lowered here), a new one
        # closes the connection that has owed a request longest, and is served.
        wait_until(lambda: held.held == IDLE + 2, 10, "the daemon to let the client's connection go")
        total, held.total = held.total, held.held
        try:
            r = post(door, "/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert closed_by_peer(idle[0], 1) and not closed_by_peer(idle[1], 0.01)
        finally:
            held.total = total

        # One peer beyond its bound: the connections beyond it are closed at once.
        own = [connect(door, "127.0.0.2") for _ in range(PER_PEER + 2)]
        assert [closed_by_peer(s, 0.5) for s in own[PER_PEER:]] == [True, True]
        assert not any(closed_by_peer(s, 0.01) for s in own[:PER_PEER])
        for s in own:
            s.close()

        for _ in range(int(READ_TIMEOUT / 0.25) + 8):  # the slow client goes on sending
            try:
                slow.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.25)
        assert closed_by_peer(slow, 5) and closed_by_peer(half, 5)
        # Every idle connection is closed once the read timeout has passed.
        assert all(closed_by_peer(s, READ_TIMEOUT + 10) for s in idle)
        wait_until(lambda: held.held == 0, 30, "the daemon to let every connection go")
    finally:
        for s in idle:
            s.close()


def test_another_tenants_session_id_leaves_the_kept_session_alone(door: InProcessDaemon) -> None:
    """Alice naming the session the door keeps for Bob's conversation gets 404 and changes
    nothing: Bob's resent conversation continues that session."""
    with kvkeep.Client(door.address, token=TOKENS["bob"]) as bob:
        before = {s.session_id for s in bob.list_sessions()}
        conversation = [{"role": "user", "content": "Name a colour."}]
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0}
        first = post(door, "/chat/completions", {**body, "messages": conversation}, "bob").json()
        (kept,) = {s.session_id for s in bob.list_sessions()} - before

        naming = (("/chat/completions", {"messages": conversation}), ("/completions", {"prompt": "x"}))
        for path, extra in naming:
            r = post(door, path, {**body, **extra, "session_id": kept}, "alice")
            assert r.status_code == 404 and "no session" in r.json()["error"]["message"], r.text

        conversation += [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Another."},
        ]
        second = post(door, "/chat/completions", {**body, "messages": conversation}, "bob").json()
        assert {s.session_id for s in bob.list_sessions()} - before == {kept}
        usage = first["usage"]
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= usage["prompt_tokens"] + usage["completion_tokens"] - 1


# A whole access-log line claiming that another tenant deleted a stored response.
FORGED = "2030-01-01 00:00:00,000 INFO kvkeepd.access: http DELETE /v1/responses/resp_0 tenant=bob 0.001s 200"


def answer_status(address: str, request: bytes) -> int:
    """The status of a request sent as these bytes (no client library to normalise them)."""
    host, _, port_ = address.rpartition(":")
    with socket.create_connection((host, int(port_)), timeout=60) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize("log_json", [False, True], ids=["text", "json"])
def test_a_request_cannot_forge_a_line_of_the_log(
    spawn_daemon: Callable[..., DaemonProcess], log_json: bool
) -> None:
    d = spawn_daemon("--http", "127.0.0.1:0", *(["--log-json"] if log_json else []))
    with kvkeep.Client(d.address, timeout=60) as c:
        http = c.info().http_address
    # CR LF, the forged line and a terminal escape (clear the screen), percent-encoded in
    # the path as HTTP requires: the door sees them decoded.
    path = "/v1/models" + urllib.parse.quote("\r\n" + FORGED + "\x1b[2J", safe="")
    request = f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
    assert answer_status(http, request.encode()) == 404
    # Written as they are, HTTP's parser refuses them before the door sees the request.
    assert answer_status(http, b"GET /v1/models\x1b[2J HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n") == 400
    # A field the access line names (the session) from a JSON body.
    forging = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "session_id": "s_\n" + FORGED}
    body = json.dumps(forging).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    assert answer_status(http, head.encode() + body) == 400

    def access_lines() -> list[str] | None:
        lines = [line for line in d.log().splitlines() if "kvkeepd.access" in line and "http " in line]
        return lines if len(lines) >= 2 else None

    lines = wait_until(access_lines, 10, "the requests' lines in the access log")
    log = d.log()
    assert "\x1b" not in log and "\r" not in log
    if log_json:
        entries = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        assert not [e for e in entries if any(c in e["message"] for c in "\r\n\x1b")]
        messages = [e["message"] for e in entries if e["logger"] == "kvkeepd.access"]
    else:
        assert not [line for line in log.splitlines() if line.startswith(FORGED[:10])]
        messages = [line.split("kvkeepd.access: ", 1)[1] for line in lines]
    assert any(m.startswith(f"http GET /v1/models\\x0d\\x0a{FORGED}\\x1b[2J ") for m in messages), messages
    assert any(f"session=s_\\x0a{FORGED}" in m for m in messages), messages
