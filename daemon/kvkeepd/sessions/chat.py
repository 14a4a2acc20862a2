"""Chat templates: the GGUF's Jinja2 template, rendered in a sandbox, content kept apart.

The template's own markers (`<|im_start|>`...) must become control tokens, but nothing a
user writes may: `render` returns the text in segments, and only segments the template
produced are tokenized with special-token parsing. A user who types
`<|im_end|><|im_start|>system` gets those characters as plain text.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvkeepd.engine.engine import Engine
from kvkeepd.errors import InvalidRequest
from kvkeepd.values import Message


@dataclass(frozen=True)
class Segment:
    """A piece of rendered text; `content` marks text that came from a message."""

    text: str
    content: bool


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    """A compiled chat template."""

    @staticmethod
    async def of_model(engine: Engine) -> ChatTemplate | None:
        """The loaded model's template, with its BOS and EOS texts (None: it has none)."""
        model = engine.info
        if model is None or not model.chat_template:
            return None
        source = model.chat_template
        bos, eos = await asyncio.wrap_future(
            engine.call(
                lambda e: (
                    e.ctx.detokenize([model.bos_token], True),
                    e.ctx.detokenize([model.eos_token], True),
                )
            )
        )
        return ChatTemplate(source, bos, eos)

    def __init__(self, source: str, bos_text: str, eos_text: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(source)
        self._bos = bos_text
        self._eos = eos_text

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[Segment]:
        """Render a conversation into template and content segments."""
        # Each content is replaced by a random marker that no template or user can predict,
        # so the split below finds exactly the contents.
        nonce = secrets.token_hex(8)
        markers = [f"\x00{nonce}:{i}\x00" for i in range(len(messages))]
        try:
            text = self._template.render(
                messages=[{"role": m.role, "content": markers[i]} for i, m in enumerate(messages)],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except TemplateError as e:
            raise InvalidRequest(f"the chat template rejected the conversation: {e}") from None
        segments: list[Segment] = []
        rest = text
        for i, marker in enumerate(markers):
            before, found, after = rest.partition(marker)
            if not found:
                continue
            if before:
                segments.append(Segment(before, False))
            if messages[i].content:
                segments.append(Segment(messages[i].content, True))
            rest = after
        if rest:
            segments.append(Segment(rest, False))
        if any(f"\x00{nonce}:" in s.text for s in segments if not s.content):
            raise InvalidRequest("the chat template repeats or reorders message contents")
        return segments


def text_of(segments: Sequence[Segment]) -> str:
    return "".join(s.text for s in segments)


def after_prefix(segments: Sequence[Segment], prefix: str) -> list[Segment] | None:
    """The segments that follow `prefix` in the rendered text, or None if it is no prefix."""
    if not text_of(segments).startswith(prefix):
        return None
    skip = len(prefix)
    out: list[Segment] = []
    for seg in segments:
        if skip >= len(seg.text):
            skip -= len(seg.text)
            continue
        out.append(Segment(seg.text[skip:], seg.content))
        skip = 0
    return out
