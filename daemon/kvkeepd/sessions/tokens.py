"""Text to tokens for generation flows: prompts, template renderings, system prompts.

Tokenizing runs in a worker thread beside the engine's steps (Engine.read_vocab). Template
text has its control tokens parsed; message content never does, so a message cannot
forge a turn. Text is refused before tokenizing when it cannot be within the prompt limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvkeepd.engine.context import LlamaContext, ModelInfo
from kvkeepd.engine.engine import Engine
from kvkeepd.errors import InvalidRequest
from kvkeepd.sessions.chat import ChatTemplate, Segment, text_of
from kvkeepd.toolcall import Tool
from kvkeepd.values import Message

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
                segments = template.render(system, False, tools)
            except InvalidRequest:
                if not tools:
                    raise
                segments = template.render(system, False)
            return await self.segments(segments, first=True)
        return await self.tokenize(system_prompt, first=True, parse_special=False)

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
