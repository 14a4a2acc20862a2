"""Prompt caching on the Messages API, with Anthropic's own client: a `cache_control`
breakpoint keeps the conversation's state up to it, and a new conversation sharing that
prefix reads it instead of evaluating it, after a restart too, within its tenant only, with
the same reply as when it is evaluated; usage's three parts say what was read, stored and
evaluated, and add up to the prompt.
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


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_auth(tmp_path / "auth.toml", TOKENS)
    return tmp_path


def start(root: Path) -> InProcessDaemon:
    return InProcessDaemon.with_settings(
        root / "state", http_address="127.0.0.1:0", auth_file=root / "auth.toml", block_tokens=BLOCK
    )


def client(d: InProcessDaemon, tenant: str) -> anthropic.Anthropic:
    assert d.daemon is not None
    url = f"http://127.0.0.1:{d.daemon.http_port}"
    return anthropic.Anthropic(base_url=url, api_key=TOKENS[tenant], max_retries=0, timeout=120)


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
