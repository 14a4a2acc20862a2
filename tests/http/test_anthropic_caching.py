"""Prompt caching on the Messages API, with Anthropic's own client: a `cache_control`
breakpoint keeps the conversation's state up to it, and a new conversation sharing that
prefix reads it instead of evaluating it, after a restart too, within its tenant only, with
the same reply as when it is evaluated; usage's three parts say what was read, stored and
evaluated, and add up to the prompt. Several breakpoints in one request (up to 4, as
Anthropic allows; a fifth is refused) are each kept, and a later request reads the longest
it shares.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import anthropic
import pytest
from auth import TOKENS, write_auth
from daemons import InProcessDaemon

BLOCK = 64
SYSTEM = " ".join(
    f"Rule {i}: when the user names a colour, you answer with the fruit of that colour, number {i}."
    for i in range(1, 25)
)


# Tenants of their own, each to measure one breakpoint alone.
TENANTS = {**TOKENS, **{f"t{i}": f"t{i}-token-0123456789abcd" for i in range(4)}}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_auth(tmp_path / "auth.toml", TENANTS)
    return tmp_path


def start(root: Path, **settings: Any) -> InProcessDaemon:
    return InProcessDaemon.with_settings(
        root / "state",
        http_address="127.0.0.1:0",
        auth_file=root / "auth.toml",
        block_tokens=BLOCK,
        **settings,
    )


def client(d: InProcessDaemon, tenant: str) -> anthropic.Anthropic:
    assert d.daemon is not None
    url = f"http://127.0.0.1:{d.daemon.http_port}"
    return anthropic.Anthropic(base_url=url, api_key=TENANTS[tenant], max_retries=0, timeout=120)


def ask(c: anthropic.Anthropic, question: str, ttl: str | None = None) -> tuple[Any, float]:
    """A new conversation under the long system prompt, marked for caching; the reply and
    its seconds."""
    mark: dict[str, Any] = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    system = [{"type": "text", "text": SYSTEM, "cache_control": mark}]
    messages = [{"role": "user", "content": question}]
    t0 = time.perf_counter()
    reply = c.messages.create(
        model="claude-sonnet-4-5",
        system=system,  # type: ignore[arg-type]
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        extra_body={"temperature": 0},
    )
    seconds = time.perf_counter() - t0
    counted = c.messages.count_tokens(model="m", system=SYSTEM, messages=messages)  # type: ignore[arg-type]
    u = reply.usage
    # The three parts add up to the prompt.
    assert u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0) == (
        counted.input_tokens
    )
    return reply, seconds


def text(reply: Any) -> str:
    return "".join(b.text for b in reply.content if b.type == "text")


def test_a_breakpoint_is_kept_read_by_new_conversations_after_a_restart_and_only_by_its_tenant(
    root: Path,
) -> None:
    d = start(root)
    try:
        with client(d, "alice") as alice:
            first, t_first = ask(alice, "Red?")
            created = first.usage.cache_creation_input_tokens
            # The system prompt's tokens up to the last whole block were stored, nothing read.
            assert first.usage.cache_read_input_tokens == 0
            assert created >= 4 * BLOCK and created % BLOCK == 0
            # A new conversation sharing the prefix reads what was stored, evaluates the rest,
            # and stores nothing again.
            second, t_second = ask(alice, "Green?")
            assert second.usage.cache_read_input_tokens == created
            assert second.usage.cache_creation_input_tokens == 0
    finally:
        d.stop()
    d = start(root)  # a restart: no session is left, the kept prefix is on disk
    try:
        with client(d, "alice") as alice, client(d, "bob") as bob:
            cached, t_cached = ask(alice, "Blue?")
            assert cached.usage.cache_read_input_tokens == created
            assert cached.usage.cache_creation_input_tokens == 0
            # Another tenant reads nothing of it, evaluates the whole prompt (keeping its own)
            # and gets the same reply, token for token.
            evaluated, t_evaluated = ask(bob, "Blue?")
            assert evaluated.usage.cache_read_input_tokens == 0
            assert evaluated.usage.cache_creation_input_tokens == created
            assert text(evaluated) == text(cached)
            assert evaluated.usage.output_tokens == cached.usage.output_tokens
            print(
                f"\nkept {created} tokens; prompt {created + cached.usage.input_tokens} tokens; "
                f"first {t_first * 1000:.0f} ms, cached {t_second * 1000:.0f} ms, after a restart "
                f"{t_cached * 1000:.0f} ms (evaluated by another tenant {t_evaluated * 1000:.0f} ms)"
            )
    finally:
        d.stop()


def test_kept_prefixes_expire_after_their_time_to_live(root: Path) -> None:
    d = start(root)
    try:
        assert d.daemon is not None
        manager = d.daemon.manager
        catalog = manager.durable.catalog
        with client(d, "alice") as alice:
            ask(alice, "Red?")  # kept 5 minutes
            ask(alice, "Red?", ttl="1h")  # the same prefix kept again, for an hour
        assert len(catalog.expired_prefixes(math.inf, 10)) == 1
        now = time.time()
        manager.clock = lambda: now + 600  # past five minutes: the hour holds
        d.run(manager.expire_now())
        assert len(catalog.expired_prefixes(math.inf, 10)) == 1
        manager.clock = lambda: now + 3700
        d.run(manager.expire_now())
        assert catalog.expired_prefixes(math.inf, 10) == []
        manager.clock = time.time
    finally:
        d.stop()


LOOKUP = {
    "name": "lookup",
    "description": "Look a fruit up in the catalogue.",
    "input_schema": {"type": "object", "properties": {"fruit": {"type": "string"}}, "required": ["fruit"]},
}
NOTE = " ".join(f"Step {i}: I look the fruit up in the catalogue of orchard {i}." for i in range(1, 7))
FOUND = " ".join(f"Entry {i}: the cherry of orchard {i} is ripe in June." for i in range(1, 12))


def marked(question: str, marks: set[str], result: str = FOUND) -> dict[str, Any]:
    """A conversation with a tool round trip under the long system prompt; `marks` names
    the blocks marked for caching: "system", "tool", "question", "call", "result"."""

    def mark(name: str) -> dict[str, Any]:
        return {"cache_control": {"type": "ephemeral"}} if name in marks else {}

    call = {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"fruit": "cherry"}}
    return {
        "system": [{"type": "text", "text": SYSTEM, **mark("system")}],
        "tools": [{**LOOKUP, **mark("tool")}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": question, **mark("question")}]},
            {"role": "assistant", "content": [{"type": "text", "text": NOTE}, {**call, **mark("call")}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": result, **mark("result")},
                    {"type": "text", "text": "Which colour is it?"},
                ],
            },
        ],
    }


def send(c: anthropic.Anthropic, body: dict[str, Any]) -> Any:
    """A reply to `body`, greedy, whose usage's three parts add up to its prompt."""
    reply = c.messages.create(model="m", max_tokens=8, extra_body={"temperature": 0}, **body)
    counted = c.messages.count_tokens(model="m", **{k: body[k] for k in ("system", "tools", "messages")})
    u = reply.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted.input_tokens
    return reply


def test_several_breakpoints_each_keep_their_prefix_and_a_later_request_reads_the_one_it_shares(
    root: Path,
) -> None:
    question = "Which fruit is red? " * 20
    d = start(root, ctx_per_session=2048)
    try:
        assert d.daemon is not None
        catalog = d.daemon.manager.durable.catalog
        with client(d, "alice") as alice:
            # Five marks are refused, as Anthropic refuses them.
            five = marked(question, {"system", "tool", "question", "call", "result"})
            with pytest.raises(anthropic.BadRequestError, match="A maximum of 4 blocks with cache_control"):
                send(alice, five)
            # Four marks: the system prompt (which holds the tools), the question, the call, the
            # result. Each mark's prefix is kept, whole blocks of it; the longest was stored by
            # this request and nothing was read.
            full = send(alice, marked(question, {"system", "question", "call", "result"}))
            assert full.usage.cache_read_input_tokens == 0
            stored = full.usage.cache_creation_input_tokens
        # Each mark's prefix, measured alone by a tenant of its own marking only that block.
        cuts = []
        for i, name in enumerate(("system", "question", "call", "result")):
            with client(d, f"t{i}") as alone:
                cuts.append(send(alone, marked(question, {name})).usage.cache_creation_input_tokens)
        assert cuts[-1] == stored and all(n % BLOCK == 0 for n in cuts)
        assert cuts == sorted(set(cuts)) and cuts[0] >= 4 * BLOCK
        # Alice's four prefixes and the four tenants' one each.
        assert len(catalog.expired_prefixes(math.inf, 20)) == 4 + 4
    finally:
        d.stop()
    d = start(root, ctx_per_session=2048)  # a restart: the kept prefixes alone are left
    try:
        with client(d, "alice") as alice:
            # Sharing only the system prompt reads the first mark's prefix, exactly.
            other = send(alice, marked("Which fruit is yellow?", set()))
            assert other.usage.cache_read_input_tokens == cuts[0]
            assert other.usage.cache_creation_input_tokens == 0
            # Sharing everything up to the call (another result) reads the call's mark's prefix.
            later = send(alice, marked(question, set(), result="No entry for that fruit."))
            assert later.usage.cache_read_input_tokens == cuts[2]
            assert later.usage.cache_creation_input_tokens == 0
            prompt = stored + full.usage.input_tokens
            print(
                f"\nbreakpoints kept at {cuts} of {prompt} prompt tokens; "
                f"after a restart read {cuts[0]} and {cuts[2]}"
            )
    finally:
        d.stop()
