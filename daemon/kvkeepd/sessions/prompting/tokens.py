"""Text to tokens for generation flows: prompts, template renderings, system prompts.

Rendering and tokenizing run in worker threads, never on the event loop: a template
renders in one of asyncio's, and tokenizing beside the engine's steps (Engine.read_vocab).
Template text has its control tokens parsed; message content never does, so a message
cannot forge a turn. Text is refused before tokenizing when it cannot be within the prompt
limit, and conversations are bounded from below before they are rendered (`least_of`) and
before they are tokenized (`least`), so a conversation far beyond the context costs little.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvkeepd.engine.context import LlamaContext, ModelInfo
from kvkeepd.engine.engine import Engine
from kvkeepd.errors import InvalidRequest
from kvkeepd.sessions.prompting.templates import ChatTemplate, Segment, text_of
from kvkeepd.values.messages import Message
from kvkeepd.values.toolcall import Tool

T = TypeVar("T")


class Tokenizer:
    """Tokenizes for the generation flows with the model's vocabulary and chat template."""

    def __init__(
        self, engine: Engine, model: ModelInfo, prompt_limit: int, template: ChatTemplate | None
    ) -> None:
        self.engine = engine
        self.model = model
        self.prompt_limit = prompt_limit
        self.template = template

    async def system(self, system_prompt: str, tools: Sequence[Tool] = ()) -> list[int]:
        """A session's system prompt as the model's template renders it (or as plain text),
        with the session's tools where the template writes them there. A template that writes
        tools elsewhere (Llama 3.1: into the first user message) renders the prompt without;
        the first turn adds them."""
        self.check_bytes(system_prompt, "system prompt")
        template = self.template
        if template is not None:
            system = [Message("system", system_prompt)]
            template.toolkit.shape((), tools)  # tools the template may not take are refused
            try:
                segments = await self.render(system, False, tools)
            except InvalidRequest:
                if not tools:
                    raise
                segments = await self.render(system, False)
            return await self.segments(segments, first=True)
        return await self.tokenize(system_prompt, first=True, parse_special=False)

    async def render(
        self, messages: Sequence[Message], add_generation_prompt: bool, tools: Sequence[Tool] = ()
    ) -> list[Segment]:
        """The chat template's rendering (ChatTemplate.render), in a worker thread."""
        template = self.template
        assert template is not None
        return await asyncio.to_thread(template.render, messages, add_generation_prompt, tools)

    def least_of(self, messages: Sequence[Message]) -> int:
        """The fewest tokens `messages` can take once rendered, before rendering them: each
        content the template writes (its framing's roles) takes at least a token per
        `max_token_bytes` bytes of it, and the template's text between two such contents at
        least the framing's tokens. Calls are not counted (they are written otherwise)."""
        assert self.template is not None
        framing = self.template.framing
        least, after_content = 0, False
        for m in messages:
            counted = m.role in framing.roles and not m.tool_calls and bool(m.content)
            if counted:
                least += self._least_text(m.content) + (framing.tokens if after_content else 0)
            after_content = counted
        return least

    def least(self, segments: Sequence[Segment]) -> int:
        """The fewest tokens rendered `segments` can take: each is tokenized on its own, so
        each takes a token or more, and at least one per `max_token_bytes` bytes."""
        return sum(self._least_text(s.text) for s in segments if s.text)

    def _least_text(self, text: str) -> int:
        return max(1, math.ceil(len(text.encode("utf-8", "surrogatepass")) / self.model.max_token_bytes))

    async def tokenize(self, text: str, *, first: bool, parse_special: bool) -> list[int]:
        """Text, with the model's BOS before it when `first` and the model adds one."""
        add = first and self.model.add_bos
        return await self.vocab(lambda c: c.tokenize(text, add_special=add, parse_special=parse_special))

    async def segments(self, segments: Sequence[Segment], *, first: bool) -> list[int]:
        """Template text with control tokens parsed; message content never."""
        model = self.model

        def run(c: LlamaContext) -> list[int]:
            bos_text = c.detokenize([model.bos_token], True)
            add_bos = first and model.add_bos and not text_of(segments).startswith(bos_text)
            out: list[int] = [model.bos_token] if add_bos else []
            for seg in segments:
                out += c.tokenize(seg.text, add_special=False, parse_special=not seg.content)
            return out

        return await self.vocab(run)

    def check_bytes(self, text: str, what: str) -> None:
        """InvalidRequest, before any tokenizing, for text too long to be within the prompt
        limit whatever its tokens (each takes at most `max_token_bytes` of it)."""
        limit = self.prompt_limit * self.model.max_token_bytes
        if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
            raise InvalidRequest(
                f"the {what} is longer than {limit} bytes: more tokens than the prompt limit of "
                f"{self.prompt_limit}"
            )

    async def vocab(self, fn: Callable[[LlamaContext], T]) -> T:
        """`fn` on the vocabulary, in a worker thread beside the engine's steps."""
        return await asyncio.to_thread(self.engine.read_vocab, fn)
