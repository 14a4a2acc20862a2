"""Stateless agents on the Responses API: a client that stores nothing (`store: false`) and
resends its whole conversation every turn with a `prompt_cache_key`, as Codex CLI does, is
answered in a session the door keeps for the tenant and that key.

What is checked, with OpenAI's own client on a daemon with two tenants: each step of a
five-step conversation reads again all that the step before it held (its prompt and its
reply), and its reply is the one a fresh evaluation gives at temperature 0; a conversation
under another key that begins the same way does not take the first one's session; another
tenant sending the same conversation under the same key reads nothing of it; an empty input
is refused naming `input`; the steps leave one session, not one each; and the first turn
after a restart reads the system prompt kept in the durable store.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from auth import TOKENS, write_auth
from daemons import InProcessDaemon, model_path

MODEL = model_path().stem
INSTRUCTIONS = "You are a careful assistant who answers in one short sentence. " * 20
# Tokens of a step's end that the next step renders again rather than reads (the end of turn).
SLACK = 4
BLOCK_TOKENS = 64


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    root = tmp_path_factory.mktemp("stateless")
    d = InProcessDaemon.with_settings(
        root / "state",
        http_address="127.0.0.1:0",
        auth_file=write_auth(root / "auth.toml", TOKENS),
        block_tokens=BLOCK_TOKENS,
    )
    yield d
    d.stop()


def client(door: InProcessDaemon, tenant: str) -> openai.OpenAI:
    assert door.daemon is not None
    url = f"http://127.0.0.1:{door.daemon.http_port}/v1"
    return openai.OpenAI(base_url=url, api_key=TOKENS[tenant], max_retries=0, timeout=120)


def step(c: openai.OpenAI, items: list[dict[str, Any]], **kw: Any) -> Any:
    options: dict[str, Any] = {"store": False, "temperature": 0, "max_output_tokens": 12, **kw}
    return c.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=items, **options)  # type: ignore[arg-type]


def question(k: int) -> dict[str, Any]:
    return {"role": "user", "content": f"Question {k}: name a colour and a number."}


def reads_all_before(response: Any, before: Any) -> bool:
    """The response read again the whole of `before`'s prompt and reply (less the end of turn)."""
    held = before.usage.input_tokens + before.usage.output_tokens
    return bool(response.usage.input_tokens_details.cached_tokens >= held - SLACK)


def test_each_resent_step_reads_what_the_step_before_held(door: InProcessDaemon) -> None:
    with client(door, "alice") as alice, client(door, "bob") as bob:
        items: list[dict[str, Any]] = []
        inputs: list[list[dict[str, Any]]] = []
        replies: list[str] = []
        steps: list[Any] = []
        for k in range(5):
            items.append(question(k))
            r = step(alice, items, prompt_cache_key="agent-1")
            assert r.output_text
            if steps:
                assert reads_all_before(r, steps[-1]), (k, r.usage, steps[-1].usage)
            inputs.append(list(items))
            replies.append(r.output_text)
            steps.append(r)
            items.append({"role": "assistant", "content": r.output_text})
        assert steps[0].usage.input_tokens_details.cached_tokens < BLOCK_TOKENS * 4

        # Another tenant, the same conversation under the same key: nothing of alice's is read.
        theirs = step(bob, inputs[-1], prompt_cache_key="agent-1")
        assert theirs.usage.input_tokens == steps[-1].usage.input_tokens
        assert theirs.usage.input_tokens_details.cached_tokens == 0

        # Each reply is the one a fresh evaluation gives: a stored response of a new conversation.
        for given, reply in zip(inputs, replies, strict=True):
            assert step(bob, given, store=True).output_text == reply


def test_two_prompt_cache_keys_do_not_take_each_others_session(door: InProcessDaemon) -> None:
    with client(door, "alice") as alice:
        first = [question(10)]
        a = step(alice, first, prompt_cache_key="agent-a")
        held = a.usage.input_tokens + a.usage.output_tokens
        # Where the step ends between blocks, the prefix cache alone reads less than all of it.
        assert held % BLOCK_TOKENS > SLACK + 1, held
        exchange = [*first, {"role": "assistant", "content": a.output_text}]

        # Another agent whose conversation begins with the same exchange, under its own key,
        # is answered in a session of its own...
        b = step(alice, [*exchange, question(11)], prompt_cache_key="agent-b")
        assert b.output_text
        # ...so the first agent's next step still finds its session where it left it.
        a2 = step(alice, [*exchange, question(12)], prompt_cache_key="agent-a")
        assert reads_all_before(a2, a), (a2.usage, a.usage)


def test_an_empty_input_is_refused_naming_it(door: InProcessDaemon) -> None:
    with (
        client(door, "alice") as alice,
        pytest.raises(openai.BadRequestError, match="the input is empty") as e,
    ):
        step(alice, [], prompt_cache_key="agent-1")
    assert e.value.body["param"] == "input"  # type: ignore[index]


def test_a_conversation_sent_whole_keeps_one_session(door: InProcessDaemon) -> None:
    # A conversation sent whole leaves one session behind per key, not one per step.
    assert door.daemon is not None
    manager = door.daemon.manager
    before = {s.session_id for s in manager.sessions.values() if s.tenant == "alice"}
    with client(door, "alice") as alice:
        items = [question(20)]
        for k in range(3):
            r = step(alice, items, prompt_cache_key="agent-count")
            items += [{"role": "assistant", "content": r.output_text}, question(21 + k)]
    after = {s.session_id for s in manager.sessions.values() if s.tenant == "alice"}
    assert len(after - before) == 1


def test_the_first_turn_after_a_restart_reads_the_kept_system_prompt(tmp_path: Path) -> None:
    # A named conversation's leading system messages are kept in the durable store: after a
    # restart (its session gone), its next turn reads them instead of evaluating them.
    def serve() -> InProcessDaemon:
        return InProcessDaemon.with_settings(
            tmp_path / "state",
            http_address="127.0.0.1:0",
            auth_file=write_auth(tmp_path / "auth.toml", TOKENS),
            block_tokens=BLOCK_TOKENS,
        )

    d = serve()
    try:
        with client(d, "alice") as alice:
            first = step(alice, [question(30)], prompt_cache_key="agent-r")
            items = [question(30), {"role": "assistant", "content": first.output_text}, question(31)]
    finally:
        d.stop()
    d = serve()
    try:
        with client(d, "alice") as alice:
            after = step(alice, items, prompt_cache_key="agent-r")
    finally:
        d.stop()
    cached = after.usage.input_tokens_details.cached_tokens
    # All of the system prompt to the block grid: the first turn less its question and opening.
    assert cached >= first.usage.input_tokens - 2 * BLOCK_TOKENS and cached % BLOCK_TOKENS == 0, cached
