"""`cache_salt` on the HTTP door's routes: prompts computed under a salt are reused by the
requests that give the same salt, of any tenant, and by no other; the reply is the same, token
for token, whether its prefix was read or evaluated.

What is checked, on a daemon serving two tenants: an Anthropic `cache_control` breakpoint
stored by one tenant under a salt is read after a restart by the other tenant giving that
salt, and by nobody giving none or another; the same through the prefix cache on
`/v1/chat/completions`, where a conversation the door keeps is continued only under the salt
it was begun with; a salt that is no string, too short or too long is a 400 naming
`cache_salt` on every route; and a request continuing a session (`session_id`,
`previous_response_id`) under another salt than the session's is a 400 that leaves the
session as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from auth import TOKENS, write_auth
from daemons import InProcessDaemon, model_path

MODEL = model_path().stem
BLOCK = 64
SALT = "a salt the two tenants share"
OTHER_SALT = "a salt nobody else presents"
SYSTEM = " ".join(
    f"Rule {i}: when the user names a colour, you answer with the fruit of that colour, number {i}."
    for i in range(1, 25)
)


def start(root: Path) -> InProcessDaemon:
    return InProcessDaemon.with_settings(
        root / "state",
        http_address="127.0.0.1:0",
        auth_file=write_auth(root / "auth.toml", TOKENS),
        block_tokens=BLOCK,
    )


def url(d: InProcessDaemon) -> str:
    assert d.daemon is not None
    return f"http://127.0.0.1:{d.daemon.http_port}"


def claude(d: InProcessDaemon, tenant: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url(d), api_key=TOKENS[tenant], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    d = start(tmp_path_factory.mktemp("cache-salt"))
    yield d
    d.stop()


def salted(salt: str | None) -> dict[str, Any]:
    return {} if salt is None else {"cache_salt": salt}


# ---- Anthropic breakpoints -------------------------------------------------------------------


def ask(c: anthropic.Anthropic, salt: str | None) -> Any:
    """A new conversation under the long system prompt, marked for caching, under `salt`."""
    return c.messages.create(
        model="claude-sonnet-4-5",
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Red?"}],
        max_tokens=12,
        extra_body={"temperature": 0, **salted(salt)},
    )


def text(reply: Any) -> str:
    return "".join(b.text for b in reply.content if b.type == "text")


def test_a_breakpoint_kept_under_a_salt_is_read_by_another_tenant_giving_it_and_by_nobody_else(
    tmp_path: Path,
) -> None:
    d = start(tmp_path)
    try:
        with claude(d, "alice") as alice:
            stored = ask(alice, SALT)
        created = stored.usage.cache_creation_input_tokens
        assert created >= 4 * BLOCK and stored.usage.cache_read_input_tokens == 0
    finally:
        d.stop()
    d = start(tmp_path)  # a restart: no session is left, the breakpoint is on disk
    try:
        with claude(d, "bob") as bob:
            read = ask(bob, SALT)
            unsalted = ask(bob, None)
            other = ask(bob, OTHER_SALT)
        # The other tenant, giving the salt, reads alice's breakpoint whole.
        assert read.usage.cache_read_input_tokens == created, read.usage
        # Giving none (its own tenant's salt) or another, it reads nothing and evaluates it.
        for evaluated in (unsalted, other):
            assert evaluated.usage.cache_read_input_tokens == 0, evaluated.usage
            assert evaluated.usage.cache_creation_input_tokens == created, evaluated.usage
            # The same reply, token for token, whether the prefix was read or evaluated.
            assert text(evaluated) == text(read)
            assert evaluated.usage.output_tokens == read.usage.output_tokens
    finally:
        d.stop()


# ---- the prefix cache on chat completions ----------------------------------------------------


def chat(c: openai.OpenAI, messages: list[dict[str, Any]], salt: str | None) -> Any:
    return c.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body=salted(salt),
    )


def cached(r: Any) -> int:
    return int(r.usage.prompt_tokens_details.cached_tokens)


def test_chat_completions_share_the_prefix_cache_by_salt_and_continue_a_conversation_under_its_own(
    door: InProcessDaemon,
) -> None:
    system = {"role": "system", "content": SYSTEM}
    question = [system, {"role": "user", "content": "Green?"}]
    with (
        openai.OpenAI(base_url=url(door) + "/v1", api_key=TOKENS["alice"], max_retries=0) as alice,
        openai.OpenAI(base_url=url(door) + "/v1", api_key=TOKENS["bob"], max_retries=0) as bob,
    ):
        first = chat(alice, [system, {"role": "user", "content": "Red?"}], SALT)
        assert cached(first) == 0
        # Bob, giving the salt, attaches the system prompt alice's session computed.
        read = chat(bob, question, SALT)
        assert cached(read) >= 4 * BLOCK, read.usage
        # Giving none (his own tenant's salt) or another salt, he attaches nothing of it.
        for salt in (None, OTHER_SALT):
            evaluated = chat(bob, question, salt)
            assert cached(evaluated) == 0, (salt, evaluated.usage)
            assert evaluated.choices[0].message.content == read.choices[0].message.content
            assert evaluated.usage.completion_tokens == read.usage.completion_tokens

        # Alice resends her conversation: under another salt (or none) her kept session is not
        # continued, nor its blocks attached; under its own it is, and only what is new is
        # evaluated.
        resent = [
            system,
            {"role": "user", "content": "Red?"},
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And yellow?"},
        ]
        for salt in ("a salt of alice's alone", None):
            assert cached(chat(alice, resent, salt)) == 0
        again = chat(alice, resent, SALT)
        assert cached(again) >= first.usage.prompt_tokens, again.usage


# ---- bad values --------------------------------------------------------------------------------

BAD = {
    "too short": "short salt",
    "too short in bytes": "é" * 7,  # 7 characters, 14 bytes
    "too long": "x" * 257,
    "not a string": 12345678901234567890,
    "empty": "",
}


def post(d: InProcessDaemon, path: str, body: dict[str, Any], tenant: str = "alice") -> httpx.Response:
    headers = {"authorization": f"Bearer {TOKENS[tenant]}"}
    return httpx.post(url(d) + path, json=body, headers=headers, timeout=120)


HI = [{"role": "user", "content": "Hi"}]
# A short request of each route's, one token long.
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": HI, "max_tokens": 1},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 1, "store": False},
    "/v1/messages": {"model": MODEL, "messages": HI, "max_tokens": 1},
}


@pytest.mark.parametrize("route", ROUTES)
def test_a_salt_that_is_no_string_or_of_the_wrong_length_is_refused_naming_it(
    door: InProcessDaemon, route: str
) -> None:
    for why, value in BAD.items():
        r = post(door, route, {**ROUTES[route], "cache_salt": value})
        assert r.status_code == 400, (why, r.text)
        error = r.json()["error"]
        if route == "/v1/messages":  # Anthropic's envelope names the field in its message
            assert error["type"] == "invalid_request_error" and "cache_salt" in error["message"], why
        else:
            assert error["param"] == "cache_salt", (why, error)
    # 16 bytes (8 characters of two bytes each) to 256 bytes are taken.
    for value in ("é" * 8, "x" * 256):
        r = post(door, route, {**ROUTES[route], "cache_salt": value})
        assert r.status_code == 200, r.text


# ---- a session keeps its salt ------------------------------------------------------------------


def refused(r: httpx.Response) -> bool:
    return r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_session_is_continued_only_under_its_own_salt(door: InProcessDaemon, route: str) -> None:
    body = ROUTES[route]
    made = post(door, route, {**body, "session_id": "new", "cache_salt": SALT})
    assert made.status_code == 200, made.text
    session_id = made.json()["session_id"]
    plain = post(door, route, {**body, "session_id": "new"}).json()["session_id"]
    # Another salt, or any salt on a session made without one, is refused...
    assert refused(post(door, route, {**body, "session_id": session_id, "cache_salt": OTHER_SALT}))
    assert refused(post(door, route, {**body, "session_id": plain, "cache_salt": SALT}))
    # ...and its own, or none, continues it.
    for extra in ({"cache_salt": SALT}, {}):
        r = post(door, route, {**body, "session_id": session_id, **extra})
        assert r.status_code == 200 and r.json()["session_id"] == session_id, r.text
    # Another tenant's session is not found, whatever the salt.
    assert post(door, route, {**body, "session_id": session_id, "cache_salt": SALT}, "bob").status_code == 404


def test_a_stored_response_is_continued_only_under_the_salt_its_conversation_began_with(
    door: InProcessDaemon,
) -> None:
    body = {**ROUTES["/v1/responses"], "store": True}
    first = post(door, "/v1/responses", {**body, "cache_salt": SALT})
    assert first.status_code == 200, first.text
    plain = post(door, "/v1/responses", body).json()["id"]
    then = {**body, "previous_response_id": first.json()["id"]}
    assert refused(post(door, "/v1/responses", {**body, "previous_response_id": plain, "cache_salt": SALT}))
    # In place (the session kept at the response), then forked from its checkpoint (the kept
    # session moved on): another salt is refused, and the refusal leaves the conversation as it
    # was, continued under its own salt or none.
    for _ in range(2):
        assert refused(post(door, "/v1/responses", {**then, "cache_salt": OTHER_SALT}))
        r = post(door, "/v1/responses", {**then, "cache_salt": SALT})
        assert r.status_code == 200 and r.json()["previous_response_id"] == first.json()["id"], r.text
    assert post(door, "/v1/responses", then).status_code == 200
