"""Conversations resent whole to /v1/chat/completions under a `prompt_cache_key`, as agent
frameworks send them: each is continued only in the session the door keeps for the tenant
and that key, so a step evaluates only what is new and `cached_tokens` says so.

What is checked, with OpenAI's own client: an agent's four resent steps each read again all
that the step before held (its prompt and its reply), the cached tokens growing step by
step, while a second agent under another key resends the first one's transcript with its
own question after each step (a fork of it, which without keys would take the first one's
session and leave it to start over).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from daemons import InProcessDaemon, model_path

MODEL = model_path().stem
# Tokens of a step's end that the next step renders again rather than reads (the end of turn).
SLACK = 4
# The largest block: the prefix cache attaches no block of the first steps' conversations,
# so what they read they read from their own kept session.
BLOCK_TOKENS = 128


@pytest.fixture(scope="module")
def oai(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    d = InProcessDaemon.with_settings(
        tmp_path_factory.mktemp("stateless-chat") / "state",
        http_address="127.0.0.1:0",
        block_tokens=BLOCK_TOKENS,
        ctx_per_session=2048,
    )
    assert d.daemon is not None
    url = f"http://127.0.0.1:{d.daemon.http_port}/v1"
    with openai.OpenAI(base_url=url, api_key="any", max_retries=0, timeout=120) as c:
        yield c
    d.stop()


def step(c: openai.OpenAI, messages: list[dict[str, Any]], key: str) -> Any:
    return c.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
        prompt_cache_key=key,
    )


def held(r: Any) -> int:
    return int(r.usage.prompt_tokens + r.usage.completion_tokens)


def cached(r: Any) -> int:
    return int(r.usage.prompt_tokens_details.cached_tokens)


def test_each_resent_step_under_its_key_reads_what_the_step_before_held(oai: openai.OpenAI) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a terse assistant."}]
    steps: list[Any] = []
    for k in range(4):
        messages.append({"role": "user", "content": f"Question {k}: name a colour."})
        r = step(oai, messages, "agent-a")
        if steps:
            assert cached(r) >= held(steps[-1]) - SLACK, (k, r.usage, steps[-1].usage)
            assert cached(r) > cached(steps[-1]), (k, r.usage, steps[-1].usage)
        assert r.usage.prompt_tokens - cached(r) < 40, r.usage  # the new message and its turn's frame
        steps.append(r)
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        # Another agent forks the transcript under its own key: it does not take agent-a's session.
        fork = step(oai, [*messages, {"role": "user", "content": "And a number?"}], "agent-b")
        assert fork.choices[0].message is not None
    print(
        "cached tokens by step:",
        [cached(r) for r in steps],
        "prompt tokens:",
        [r.usage.prompt_tokens for r in steps],
    )
