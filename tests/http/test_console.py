"""The web console on the HTTP door (`GET /`, `/console/api/...`), against a real daemon.

- Its JSON routes answer under the API's auth, for the caller's tenant alone: another
  tenant's session is not listed and its tree and checkpoints are 404; the list and the tree
  agree with what the SDK reports (tokens, checkpoints, forks, bytes).
- Its acting routes restore, fork, checkpoint and delete; `--console read-only` refuses each
  with 403 and changes nothing; `--console off` serves none of it, and `--http off` nothing.
- The page and its files are served with a Content-Security-Policy, behind the door's
  Host/Origin rules.
- The list and the tree say where each state lives, as the SDK does: `slot 0`, then `ram`
  once another session takes the only slot, then after a restart `disk` (or `shared store`,
  with the durable store in Redis); a checkpoint's node names its store and where it is kept.
- A persistent fork stays under its parent in the tree after a restart.
- A fork at a message ("branch here") holds the conversation through it and continues as a
  fresh session given those messages does, token for token; its source is unchanged.
- In a real browser (Debian's Chromium driven by Playwright): the list shows a created session
  and where its state lives, the tree a checkpoint (its store) and a fork, a chat turn streams,
  a restore from the tree continues as the SDK's restore does, "branch here" on the turn's
  message forks through it, and a reply or label holding markup is shown as text. It writes the
  screenshots of docs/console.md.
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


def test_a_fork_at_a_message_continues_as_a_fresh_session_given_its_messages(door: InProcessDaemon) -> None:
    with sdk(door, TOKENS["alice"]) as alice:
        session = alice.create_session("Be brief.", sampling=GREEDY)
        first = session.chat("Name a fruit.", max_tokens=24).text
        session.chat("Name a colour.", max_tokens=24)
        mark = session.checkpoint("two turns")
        before = session.info()
        n_listed = len(alice.list_sessions())

        # Through the first reply (message 2), from the session and from its checkpoint.
        forks = []
        for source in ({"session_id": session.session_id}, {"checkpoint_id": mark.checkpoint_id}):
            made = send(door, "POST", "/console/api/forks", source | {"through_message": 2}, **ALICE)
            assert made.status_code == 201, made.text
            assert made.json()["forked_from"] == next(iter(source.values()))
            forks.append(alice.session(made.json()["session_id"]))
        held = [(m.role, m.content) for m in forks[0].info().messages]
        assert held == [("system", "Be brief."), ("user", "Name a fruit."), ("assistant", first)]
        assert [(m.role, m.content) for m in forks[1].info().messages] == held
        after = session.info()  # the source is unchanged
        assert (after.n_tokens, after.messages) == (before.n_tokens, before.messages)

        # Each fork's next turn is a fresh session's given the same messages, token for token.
        fresh = alice.create_session("Be brief.", sampling=GREEDY)
        given = [kvkeep.Message("user", "Name a fruit."), kvkeep.Message("assistant", first)]
        expected = fresh.chat([*given, kvkeep.Message("user", "Name an animal.")], max_tokens=16)
        for fork in forks:
            reply = fork.chat("Name an animal.", max_tokens=16)
            assert (reply.text, reply.usage.prompt_tokens, reply.usage.generated_tokens) == (
                expected.text,
                expected.usage.prompt_tokens,
                expected.usage.generated_tokens,
            )
            assert reply.text and fork.info().n_tokens == fresh.info().n_tokens

        # Through the system prompt alone: a fresh session with it, before its first turn.
        at_system = {"session_id": session.session_id, "through_message": 0}
        bare = send(door, "POST", "/console/api/forks", at_system, **ALICE)
        assert bare.status_code == 201 and bare.json()["n_messages"] == 1
        assert bare.json()["n_tokens"] == alice.create_session("Be brief.").info().n_tokens

        # A message the source does not have is a 400 that leaves no fork behind.
        n_listed += 5  # the two forks, this one and the two fresh sessions
        for through in (5, -1, "2"):
            bad = send(
                door,
                "POST",
                "/console/api/forks",
                {"session_id": session.session_id, "through_message": through},
                **ALICE,
            )
            assert bad.status_code == 400 and "through_message" in bad.json()["error"]["message"], bad.text
        assert len(alice.list_sessions()) == n_listed
        for info in alice.list_sessions():
            alice.session(info.session_id).close()


def test_persistent_forks_stay_under_their_parents_after_a_restart(tmp_path: Path) -> None:
    def start() -> InProcessDaemon:
        return InProcessDaemon.with_settings(tmp_path, http_address="127.0.0.1:0")

    d = start()
    try:
        with kvkeep.Client(d.address, timeout=60) as client:
            parent = client.create_session("Be brief.", sampling=GREEDY, persistent=True)
            parent.chat("Name a fruit.", max_tokens=6)
            mark = parent.checkpoint("one turn")
            from_mark = parent.fork(mark.checkpoint_id, persistent=True)
            from_mark.chat("Name a colour.", max_tokens=4)  # its heads after the fork keep it too
            from_now = parent.fork(persistent=True)
    finally:
        d.stop()
    d = start()
    try:
        tree = send(d, "GET", f"/console/api/sessions/{parent.session_id}").json()
        assert {f["session_id"]: f["forked_from"] for f in tree["forks"]} == {
            from_mark.session_id: mark.checkpoint_id,
            from_now.session_id: parent.session_id,
        }
        rows = {r["session_id"]: r for r in send(d, "GET", "/console/api/sessions").json()["data"]}
        assert rows[parent.session_id]["forked_from"] == ""
        assert rows[from_mark.session_id]["n_messages"] == 5
    finally:
        d.stop()


@pytest.mark.parametrize("store", ["local", "redis"])
def test_the_list_and_the_tree_say_where_each_state_lives(
    tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    url_ = "local" if store == "local" else request.getfixturevalue("redis_server")
    durable, kept_in = ("shared", "shared store") if store == "redis" else ("durable", "disk")

    def start() -> InProcessDaemon:
        return InProcessDaemon.with_settings(tmp_path, http_address="127.0.0.1:0", slots=1, store=url_)

    def rows(d: InProcessDaemon) -> dict[str, dict[str, Any]]:
        listed = {r["session_id"]: r for r in send(d, "GET", "/console/api/sessions").json()["data"]}
        with kvkeep.Client(d.address, timeout=60) as client:  # the SDK says the same
            assert {s.session_id: s.location for s in client.list_sessions()} == {
                sid: r["location"] for sid, r in listed.items()
            }
        return listed

    d = start()
    try:
        with kvkeep.Client(d.address, timeout=60) as client:
            kept = client.create_session("Be brief.", sampling=GREEDY, persistent=True)
            kept.chat("Name a fruit.", max_tokens=4)
            mark = kept.checkpoint("one turn")
            row = rows(d)[kept.session_id]
            assert (row["location"], row["tier"]) == ("slot 0", "hot")
            loose = client.create_session(sampling=GREEDY)
            loose.complete("Bees build", max_tokens=2)  # takes the only slot: kept is parked in RAM
            loose_mark = loose.checkpoint("loose")
            listed = rows(d)
            assert (listed[kept.session_id]["location"], listed[kept.session_id]["tier"]) == ("ram", "warm")
            assert listed[loose.session_id]["location"] == "slot 0"

            tree = send(d, "GET", f"/console/api/sessions/{kept.session_id}").json()
            assert tree["session"]["location"] == "ram"
            (node,) = tree["checkpoints"]
            assert (node["checkpoint_id"], node["store"], node["location"]) == (
                mark.checkpoint_id,
                durable,
                kept_in,
            )
            assert node["bytes_written"] == mark.bytes_written > 0
            tree = send(d, "GET", f"/console/api/sessions/{loose.session_id}").json()
            (node,) = tree["checkpoints"]
            assert (node["checkpoint_id"], node["store"], node["location"]) == (
                loose_mark.checkpoint_id,
                "ephemeral",
                "ram",
            )
    finally:
        d.stop()
    d = start()
    try:
        # After a restart the persistent session is its stored head, on disk or in the shared store.
        row = rows(d)[kept.session_id]
        assert (row["location"], row["tier"]) == (kept_in, "cold")
        assert (
            send(d, "GET", f"/console/api/sessions/{kept.session_id}").json()["session"]["location"]
            == kept_in
        )
    finally:
        d.stop()


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


CHROMIUM = Path("/usr/bin/chromium")
# Debian's Chromium, headless, reaching nothing but the daemon.
BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "console"
MARKUP = "<script>window.pwned=1</script>"
# A reply that is markup: the grammar leaves the model no other.
MARKUP_REPLY = "<img src=x onerror=window.pwned=2><script>window.pwned=3</script>"


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (scripts/servers installs Debian's)")
def test_in_a_browser_the_console_lists_draws_streams_and_restores(start_daemon: Any) -> None:
    from playwright.sync_api import sync_playwright

    d = start_daemon(http_address="127.0.0.1:0")
    with kvkeep.Client(d.address, timeout=60) as client:
        session = client.create_session("Be brief.", sampling=GREEDY)
        session.chat("Name a fruit.", max_tokens=6)
        mark = session.checkpoint(MARKUP)
        session.chat("Name a colour.", max_tokens=6)
        fork = session.fork(mark.checkpoint_id)
        forced = {
            "model": MODEL,
            "session_id": session.session_id,
            "messages": [{"role": "user", "content": "Write a tag."}],
            "grammar": f"root ::= {json.dumps(MARKUP_REPLY)}",
            "max_tokens": 60,
        }
        assert send(d, "POST", "/v1/chat/completions", forced).json()["choices"][0]["message"]["content"] == (
            MARKUP_REPLY
        )
        SCREENSHOTS.mkdir(exist_ok=True)

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("dialog", lambda dialog: dialog.accept())  # the actions' confirmations
            page.goto(url(d, "/"))
            # The list shows the session; its tree the checkpoint and the fork.
            where = page.locator(f'tr[data-session="{session.session_id}"] td.where')
            assert where.text_content() == session.info().location
            assert re.fullmatch(r"slot \d", where.text_content() or "")
            page.locator(f'tr[data-session="{session.session_id}"]').click()
            page.locator(f'g.node.checkpoint[data-id="{mark.checkpoint_id}"]').wait_for()
            page.locator(f'g.node.fork[data-id="{fork.session_id}"]').wait_for()
            page.locator("#conversation .message.assistant").last.wait_for()
            facts = page.locator("#node-facts").text_content() or ""
            assert f"in {where.text_content()} (hot)" in facts, facts
            # A label and a reply holding markup are shown as text, and nothing of them ran.
            label = page.locator(f'g[data-id="{mark.checkpoint_id}"] text.label').text_content()
            assert label == MARKUP
            assert page.locator("#conversation .message.assistant .content").last.text_content() == (
                MARKUP_REPLY
            )
            assert page.locator("#conversation script, #conversation img").count() == 0
            assert page.evaluate("window.pwned") is None
            page.locator("#sessions-pane").screenshot(path=str(SCREENSHOTS / "sessions.png"))
            page.locator("#tree-pane").screenshot(path=str(SCREENSHOTS / "tree.png"))

            # Restore from the tree, then a chat turn that streams.
            page.locator(f'g.node.checkpoint[data-id="{mark.checkpoint_id}"]').click()
            facts = page.locator("#node-facts").text_content() or ""
            assert f"{mark.n_tokens} tokens" in facts and "in the ephemeral store (ram)" in facts, facts
            page.locator("#node-actions button", has_text="Restore").click()
            page.locator("#status", has_text="restored").wait_for()
            page.evaluate(
                # Counted by mutation, not by callback: chunks that arrive together are shown one
                # by one, but reported in one callback.
                """() => { window.updates = 0;
                new MutationObserver((records) => window.updates += records.length).observe(
                  document.querySelector('#chat'),
                  {subtree: true, childList: true, characterData: true}); }"""
            )
            page.fill("#max-tokens", "8")
            page.fill("#message", "Name a colour.")
            page.click("#send")
            turn = page.locator("#chat .message.assistant:not(.streaming) .usage")
            turn.wait_for()
            shown = page.locator("#chat .message.assistant .content").last.text_content()
            usage = turn.text_content() or ""
            assert page.evaluate("window.updates") > 3  # the reply arrived in pieces
            page.locator("#chat .message.user .branch").last.wait_for()
            page.locator("#chat-pane").screenshot(path=str(SCREENSHOTS / "chat.png"))
            page.locator("#daemon-pane").screenshot(path=str(SCREENSHOTS / "daemon.png"))
            page.screenshot(path=str(SCREENSHOTS / "console.png"), full_page=True)

            # "branch here" at the turn's message: a fork holding the conversation through it.
            held = session.info().messages
            listed = {s.session_id for s in client.list_sessions()}
            page.locator("#chat .message.user .branch").last.click()
            page.locator("#status", has_text="forked").wait_for()
            (branch_id,) = {s.session_id for s in client.list_sessions()} - listed
            page.locator(f'g.node.origin[data-id="{session.session_id}"]').wait_for()
            assert client.session(branch_id).info().messages == held[:-1]
            browser.close()

        # The SDK's restore of the same checkpoint, then the same turn: the same reply, tokens
        # and cached prefix.
        after_console = session.info().n_tokens
        session.restore(mark.checkpoint_id)
        again = session.chat("Name a colour.", max_tokens=8, sampling=GREEDY)
        assert shown == again.text and again.text
        assert session.info().n_tokens == after_console
        u = again.usage
        assert usage == f"prompt {u.prompt_tokens} (cached {u.reused_tokens}), generated {u.generated_tokens}"
        assert 0 < u.reused_tokens <= mark.n_tokens  # the restored state was read, not evaluated
        fork.close()
        session.close()
