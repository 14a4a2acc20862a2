"""The web console on the HTTP door (`GET /`, `/console/api/...`), against a real daemon.

- Its JSON routes answer under the API's auth, for the caller's tenant alone: another
  tenant's session is not listed and its tree and checkpoints are 404; the list and the tree
  agree with what the SDK reports (tokens, checkpoints, forks, bytes).
- Its acting routes restore, fork, checkpoint and delete; `--console read-only` refuses each
  with 403 and changes nothing; `--console off` serves none of it, and `--http off` nothing.
- The page and its files are served with a Content-Security-Policy, behind the door's
  Host/Origin rules.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from auth import TOKENS, write_auth
from daemons import InProcessDaemon, model_path

import kvkeep

MODEL = model_path().stem
GREEDY = kvkeep.SamplingParams(temperature=0.0)
ALICE = {"authorization": f"Bearer {TOKENS['alice']}"}
BOB = {"authorization": f"Bearer {TOKENS['bob']}"}


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    """Two tenants (alice, bob), the HTTP door and the console on."""
    state = tmp_path_factory.mktemp("console")
    auth = write_auth(state / "auth.toml", TOKENS)
    d = InProcessDaemon.with_settings(
        state, http_address="127.0.0.1:0", auth_file=auth, idle_ttl=600.0, persistent_ttl=0.0
    )
    yield d
    d.stop()


def url(d: InProcessDaemon, path: str) -> str:
    assert d.daemon is not None
    return f"http://127.0.0.1:{d.daemon.http_port}{path}"


def send(d: InProcessDaemon, method: str, path: str, body: Any = None, **headers: str) -> httpx.Response:
    content = json.dumps(body).encode() if body is not None else None
    if content is not None:
        headers.setdefault("content-type", "application/json")
    return httpx.request(method, url(d, path), content=content, headers=headers, timeout=120)


def sdk(d: InProcessDaemon, token: str) -> kvkeep.Client:
    return kvkeep.Client(d.address, token=token, timeout=60)


def test_the_routes_show_the_callers_sessions_and_trees_alone(door: InProcessDaemon) -> None:
    with sdk(door, TOKENS["alice"]) as alice, sdk(door, TOKENS["bob"]) as bob:
        kept = alice.create_session("Be brief.", sampling=GREEDY, persistent=True)
        kept.chat("Name a colour.", max_tokens=4)
        mark = kept.checkpoint("after one turn")
        fork = kept.fork(mark.checkpoint_id)
        loose = alice.create_session(sampling=GREEDY)
        theirs = bob.create_session("Bob's.", sampling=GREEDY)

        listed = send(door, "GET", "/console/api/sessions", **ALICE)
        assert listed.status_code == 200, listed.text
        rows = {r["session_id"]: r for r in listed.json()["data"]}
        assert {kept.session_id, fork.session_id, loose.session_id} <= set(rows)
        assert theirs.session_id not in rows
        info = kept.info()
        row = rows[kept.session_id]
        assert (row["persistent"], row["n_tokens"], row["n_checkpoints"]) == (True, info.n_tokens, 1)
        assert row["tier"] in ("hot", "warm", "cold") and row["expires_at"] == 0  # persistent: no TTL
        assert rows[loose.session_id]["expires_at"] == pytest.approx(
            rows[loose.session_id]["last_used_at"] + 600
        )
        assert rows[fork.session_id]["forked_from"] == mark.checkpoint_id

        tree = send(door, "GET", f"/console/api/sessions/{kept.session_id}", **ALICE).json()
        assert [m["role"] for m in tree["session"]["messages"]] == ["system", "user", "assistant"]
        (node,) = tree["checkpoints"]
        assert (node["checkpoint_id"], node["label"], node["n_tokens"]) == (
            mark.checkpoint_id,
            "after one turn",
            mark.n_tokens,
        )
        assert node["bytes_written"] == mark.bytes_written > 0 and node["store"] == "durable"
        assert [f["session_id"] for f in tree["forks"]] == [fork.session_id]
        upto = send(door, "GET", f"/console/api/checkpoints/{mark.checkpoint_id}/messages", **ALICE).json()
        assert upto["data"] == tree["session"]["messages"]

        # Another tenant's session and checkpoint are not found; no token is 401.
        for path in (
            f"/console/api/sessions/{kept.session_id}",
            f"/console/api/checkpoints/{mark.checkpoint_id}/messages",
            f"/console/api/checkpoints/{mark.checkpoint_id}/export",
        ):
            r = send(door, "GET", path, **BOB)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", (path, r.text)
        bobs = {r["session_id"] for r in send(door, "GET", "/console/api/sessions", **BOB).json()["data"]}
        assert bobs == {theirs.session_id}
        for path in (
            "/console/api/sessions",
            "/console/api/info",
            f"/console/api/sessions/{kept.session_id}",
        ):
            assert send(door, "GET", path).status_code == 401, path
        assert send(door, "GET", "/console/api/sessions/s_nope", **ALICE).status_code == 400

        glance = send(door, "GET", "/console/api/info", **ALICE).json()
        assert glance["model"]["id"] == MODEL and glance["model"]["mode"] in ("exact", "compact")
        assert glance["slots"] == 4 and glance["console"] == "on"
        assert glance["tenant"]["name"] == "alice" and glance["tenant"]["sessions"]["total"] == 3
        assert glance["counters"]["tokens_generated"] >= 1

        # The export is the file the SDK's export writes.
        exported = send(door, "GET", f"/console/api/checkpoints/{mark.checkpoint_id}/export", **ALICE)
        assert exported.status_code == 200 and exported.content[:4] == _sdk_export(alice, mark, door)[:4]
        for s in (kept, fork, loose):
            s.close()
        theirs.close()


def _sdk_export(client: kvkeep.Client, mark: kvkeep.CheckpointInfo, d: InProcessDaemon) -> bytes:
    path = Path(d.settings.state_dir) / "sdk-export.kvkeep"
    client.export_checkpoint(mark.checkpoint_id, path)
    return path.read_bytes()


def test_the_acting_routes_act_as_the_sdk_does(door: InProcessDaemon) -> None:
    with sdk(door, TOKENS["alice"]) as alice:
        made = send(door, "POST", "/console/api/sessions", {"system_prompt": "Be brief."}, **ALICE)
        assert made.status_code == 201, made.text
        session = alice.session(made.json()["session_id"])
        session.chat("Hi.", max_tokens=3, sampling=GREEDY)
        before = session.info().n_tokens
        mark = send(
            door, "POST", f"/console/api/sessions/{session.session_id}/checkpoints", {"label": "x"}, **ALICE
        )
        assert mark.status_code == 201 and mark.json()["n_tokens"] == before
        checkpoint_id = mark.json()["checkpoint_id"]
        session.chat("More.", max_tokens=3, sampling=GREEDY)
        restored = send(
            door,
            "POST",
            f"/console/api/sessions/{session.session_id}/restore",
            {"checkpoint_id": checkpoint_id},
            **ALICE,
        )
        assert (
            restored.status_code == 200 and restored.json()["n_tokens"] == before == session.info().n_tokens
        )
        forked = send(door, "POST", "/console/api/forks", {"checkpoint_id": checkpoint_id}, **ALICE)
        assert forked.status_code == 201 and forked.json()["forked_from"] == checkpoint_id
        assert alice.session(forked.json()["session_id"]).info().n_tokens == before
        bad = send(door, "POST", "/console/api/forks", {"checkpoint_id": 3}, **ALICE)
        assert bad.status_code == 400 and "checkpoint_id" in bad.json()["error"]["message"]
        assert send(door, "DELETE", f"/console/api/checkpoints/{checkpoint_id}", **BOB).status_code == 404
        assert send(door, "DELETE", f"/console/api/checkpoints/{checkpoint_id}", **ALICE).status_code == 200
        assert alice.list_checkpoints(session.session_id) == []
        for sid in (session.session_id, forked.json()["session_id"]):
            assert send(door, "DELETE", f"/console/api/sessions/{sid}", **ALICE).status_code == 200
        assert {s.session_id for s in alice.list_sessions()} & {session.session_id} == set()


def test_read_only_refuses_every_action_and_off_serves_nothing(
    door: InProcessDaemon, start_daemon: Any
) -> None:
    looking = start_daemon(http_address="127.0.0.1:0", console="read-only")
    with kvkeep.Client(looking.address, timeout=60) as client:
        session = client.create_session(sampling=GREEDY)
        session.chat("Hi.", max_tokens=2)
        mark = session.checkpoint("kept")
        n = session.info().n_tokens
        for method, path, body in (
            ("POST", "/console/api/sessions", {}),
            ("POST", f"/console/api/sessions/{session.session_id}/checkpoints", {"label": "y"}),
            (
                "POST",
                f"/console/api/sessions/{session.session_id}/restore",
                {"checkpoint_id": mark.checkpoint_id},
            ),
            ("POST", "/console/api/forks", {"session_id": session.session_id}),
            ("DELETE", f"/console/api/checkpoints/{mark.checkpoint_id}", None),
            ("DELETE", f"/console/api/sessions/{session.session_id}", None),
        ):
            r = send(looking, method, path, body)
            assert r.status_code == 403 and r.json()["error"]["code"] == "console_read_only", (path, r.text)
        assert [s.session_id for s in client.list_sessions()] == [session.session_id]
        assert [c.checkpoint_id for c in session.checkpoints()] == [mark.checkpoint_id]
        assert session.info().n_tokens == n
        # Looking still works, and says the console is read-only.
        assert send(looking, "GET", f"/console/api/sessions/{session.session_id}").status_code == 200
        assert send(looking, "GET", "/console/api/info").json()["console"] == "read-only"
        session.close()

    off = start_daemon(http_address="127.0.0.1:0", console="off")
    for path in ("/", "/console/console.js", "/console/api/sessions", "/console/api/info"):
        assert send(off, "GET", path).status_code == 404, path
    assert send(off, "GET", "/v1/models").status_code == 200
    no_http = start_daemon()  # --http off
    assert no_http.daemon is not None and no_http.daemon.http_port == 0


def test_the_page_is_served_with_its_policy_behind_the_doors_rules(start_daemon: Any) -> None:
    d = start_daemon(http_address="127.0.0.1:0")
    assert d.daemon is not None
    page = send(d, "GET", "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert '<script type="module" src="/console/console.js">' in page.text
    for name in ("console.js", "api.js", "dom.js", "tree.js"):
        script = send(d, "GET", f"/console/{name}")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        # Model output is set as text alone: nothing of the page parses markup.
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", script.text), name
    assert send(d, "GET", "/console/console.css").headers["content-type"].startswith("text/css")
    assert send(d, "GET", "/console/nothing.js").status_code == 404
    assert send(d, "GET", "/console/..%2Fapp.py").status_code == 404
    # A rebound name and another site's page are refused, as on every route.
    assert send(d, "GET", "/", host="evil.example").status_code == 403
    assert send(d, "GET", "/console/api/sessions", origin="https://evil.example").status_code == 403
    own = f"http://127.0.0.1:{d.daemon.http_port}"
    assert send(d, "POST", "/console/api/sessions", {}, origin=own).status_code == 201
