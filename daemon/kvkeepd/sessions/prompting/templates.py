"""Chat templates: the GGUF's Jinja2 template, rendered in a sandbox, content kept apart.

The template's own markers (`<|im_start|>`...) must become control tokens, but nothing a
user writes may: `render` returns the text in segments, and only segments the template
produced are tokenized with special-token parsing. A user who types
`<|im_end|><|im_start|>system` gets those characters as plain text. Content a template writes
through `tojson` (Llama 3.1's tool results) is a content segment too, JSON-escaped as
`tojson` would have written it. Tools and calls are given as the template's format expects
them (kvkeepd.tools); `tojson` writes JSON as Hugging Face's templates expect: keys in their
order, nothing HTML-escaped.

A template is code the operator chose, run on what callers send: whatever it raises, and a
rendering that runs past RENDER_SECONDS of its thread's CPU time, refuses the request with
the reason. What the template writes between two messages (its framing, measured once on a
probe conversation) lets a conversation too long for the context be refused before it is
rendered at all (kvkeepd.sessions.prompting.tokens).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from jinja2 import Template, TemplateError, nodes
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvkeepd.config.option import ConfigError
from kvkeepd.engine.engine import Engine
from kvkeepd.errors import FailedPrecondition, InvalidRequest
from kvkeepd.request_limits import RENDER_SECONDS
from kvkeepd.tools import Toolkit
from kvkeepd.tools.formats import format_named
from kvkeepd.tools.shaping import WrittenJson, template_message
from kvkeepd.values.messages import Message
from kvkeepd.values.toolcall import AUTO_FORMAT, Tool, ToolCall

log = logging.getLogger(__name__)

T = TypeVar("T")

# A conversation that shows whether a template renders tools, calls and results.
_PROBE = "kvkeep_probe"
_PROBE_TOOL = Tool(_PROBE, "Probe.", '{"type": "object", "properties": {"x": {"type": "integer"}}}')
_PROBE_CALL = ToolCall("probe1234", _PROBE, '{"x": 1}')
_PROBE_MESSAGES = (
    Message("user", "hello"),
    Message("assistant", "", (_PROBE_CALL,)),
    Message("tool", f"{_PROBE}_result", tool_call_id=_PROBE_CALL.call_id),
)
# Conversations that show what a template writes between messages: the first it renders.
_FRAMING_PROBES = (
    tuple(Message(r, f"{_PROBE}_{i}") for i, r in enumerate(("system", "user", "assistant", "user"))),
    tuple(Message(r, f"{_PROBE}_{i}") for i, r in enumerate(("user", "assistant", "user"))),
)
# A template's loop iterations and calls between two looks at the rendering thread's CPU clock.
_TICKS_PER_LOOK = 256
# The filter that paces a loop's iterable (a name no template uses).
_PACED = "kvkeep_paced"


@dataclass(frozen=True)
class Segment:
    """A piece of rendered text; `content` marks text that came from a message."""

    text: str
    content: bool


@dataclass(frozen=True)
class Framing:
    """What a template writes around messages, as a probe conversation showed: the contents
    of messages of `roles`, each, and between two such contents at least `tokens` tokens of
    its own text. Framing(0, frozenset()): nothing is known (no probe rendered)."""

    tokens: int
    roles: frozenset[str]


class _Overtime(Exception):
    """A rendering ran past its time."""


class _Clock(threading.local):
    """The CPU time left to the rendering under way in this thread (a template renders in
    several threads at once)."""

    limit = math.inf
    countdown = _TICKS_PER_LOOK

    def start(self, seconds: float) -> None:
        self.limit = time.thread_time() + seconds

    def stop(self) -> None:
        self.limit = math.inf

    def tick(self) -> None:
        """_Overtime once the thread's CPU clock is past the limit (looked at every
        _TICKS_PER_LOOK ticks: the clock is a system call)."""
        self.countdown -= 1
        if self.countdown <= 0:
            self.countdown = _TICKS_PER_LOOK
            if time.thread_time() > self.limit:
                raise _Overtime


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox, whose templates' every call ticks `clock` (and every loop's every
    iteration, once `paced`): a template can run long only by looping or calling."""

    def __init__(self, clock: _Clock, **options: Any) -> None:
        super().__init__(**options)
        self.clock = clock
        self.filters[_PACED] = self._paced

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.clock.tick()
        return super().call(context, obj, *args, **kwargs)

    def _paced(self, iterable: Iterable[T]) -> Iterator[T]:
        for item in iterable:
            self.clock.tick()
            yield item

    def paced(self, source: str) -> Template:
        """`source` compiled with each loop's iterable ticking the clock."""
        tree = self.parse(source)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _PACED, [], [], None, None)
        return self.from_string(tree)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as Hugging Face's template renderer writes it (the templates were written for it);
    a call's arguments that are not JSON as the model wrote them."""
    if isinstance(value, WrittenJson):
        return str(value)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    """A compiled chat template and the tool-call model of its format (`toolkit`)."""

    @staticmethod
    async def of_model(
        engine: Engine, tool_format: str = AUTO_FORMAT, source: str | None = None
    ) -> ChatTemplate | None:
        """The loaded model's template (or `source`, one given in its place), with the model's
        BOS and EOS texts and its tool format: the one named, or the one its source speaks
        (None: there is no template). A template that does not render tools, calls and results
        as its format has them takes the generic format (named, it is refused:
        FailedPrecondition). ConfigError if `source` is no Jinja template."""
        model = engine.info
        if source is None and model is not None:
            source = model.chat_template
        if model is None or not source:
            return None
        try:
            ImmutableSandboxedEnvironment().parse(source)
        except TemplateError as e:
            raise ConfigError("chat-template-file", f"not a Jinja template: {e}") from None
        bos, eos, (specials, control) = await asyncio.wrap_future(
            engine.call(
                lambda e: (
                    e.ctx.detokenize([model.bos_token], True),
                    e.ctx.detokenize([model.eos_token], True),
                    e.ctx.special_tokens(),
                )
            )
        )
        fmt = format_named(tool_format, source)
        template = ChatTemplate(source, bos, eos, Toolkit(fmt, specials, control))
        if fmt != "generic" and not template.renders_tools():
            if tool_format != AUTO_FORMAT:
                raise FailedPrecondition(
                    f"--tool-format {fmt}: the model's chat template does not render tools, calls and "
                    "results as that format has them"
                )
            log.warning("the chat template looks %s but does not render tools: generic tool format", fmt)
            template = ChatTemplate(source, bos, eos, Toolkit("generic", specials, control))
        template.framing = await template._measure_framing(engine)
        return template

    def __init__(self, source: str, bos_text: str, eos_text: str, toolkit: Toolkit) -> None:
        self._clock = _Clock()
        env = _Sandbox(self._clock, trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson
        self._template = env.paced(source)
        self._bos = bos_text
        self._eos = eos_text
        self.toolkit = toolkit
        self.framing = Framing(0, frozenset())

    async def _measure_framing(self, engine: Engine) -> Framing:
        """The template's framing, from the first probe conversation it renders: the fewest
        tokens of its own text between two contents (each such text is tokenized apart from
        the contents around it, as a conversation's is)."""
        for probe in _FRAMING_PROBES:
            try:
                segments = self.render(probe, True)
            except InvalidRequest:
                continue
            break
        else:
            log.warning("no probe conversation renders with the chat template: none is refused unrendered")
            return Framing(0, frozenset())
        gaps = _gaps(segments)
        counts = await asyncio.wrap_future(
            engine.call(
                lambda e: [len(e.ctx.tokenize(g, add_special=False, parse_special=True)) for g in gaps]
            )
        )
        written = {s.text for s in segments if s.content}
        return Framing(min(counts, default=0), frozenset(m.role for m in probe if m.content in written))

    def renders_tools(self) -> bool:
        """The template writes a tool, a call to it and its result into the prompt."""
        try:
            text = text_of(self.render(_PROBE_MESSAGES, True, (_PROBE_TOOL,)))
        except InvalidRequest:
            return False
        return text.count(_PROBE) >= 3

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool, tools: Sequence[Tool] = ()
    ) -> list[Segment]:
        """Render a conversation (and the tools it may call) into template and content segments."""
        given = self.toolkit.shape(messages, tools)
        # Each content is replaced by a random marker that no template or user can predict,
        # so the split below finds exactly the contents.
        nonce = secrets.token_hex(8)
        variables: dict[str, Any] = {
            "messages": [
                template_message(m, "" if m.tool_calls and not m.content else f"\x00{nonce}:{i}\x00")
                for i, m in enumerate(given.messages)
            ],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self._bos,
            "eos_token": self._eos,
        }
        if given.tools is not None:
            variables["tools"] = given.tools
        self._clock.start(RENDER_SECONDS)
        try:
            text = self._template.render(**variables)
        except TemplateError as e:
            raise InvalidRequest(f"the chat template rejected the conversation: {e}") from None
        except _Overtime:
            raise InvalidRequest(
                f"the chat template ran for more than {RENDER_SECONDS:g} s of CPU time on the conversation"
            ) from None
        except Exception as e:  # the template's own code failed, however it did
            raise InvalidRequest(
                f"the chat template could not render the conversation: {type(e).__name__}: {e}"
            ) from None
        finally:
            self._clock.stop()
        # A marker as it is, or as `tojson` writes it.
        found = re.compile(f"\x00{nonce}:([0-9]+)\x00|\\\\u0000{nonce}:([0-9]+)\\\\u0000")
        segments: list[Segment] = []
        seen: set[int] = set()
        at = 0
        for match in found.finditer(text):
            raw, escaped = match.groups()
            i = int(raw if raw is not None else escaped)
            if i in seen or i >= len(given.messages):
                raise InvalidRequest("the chat template repeats message contents")
            seen.add(i)
            if match.start() > at:
                segments.append(Segment(text[at : match.start()], False))
            content = given.messages[i].content
            if escaped is not None:
                content = json.dumps(content, ensure_ascii=False)[1:-1]
            if content:
                segments.append(Segment(content, True))
            at = match.end()
        if at < len(text):
            segments.append(Segment(text[at:], False))
        return segments


def _gaps(segments: Sequence[Segment]) -> list[str]:
    """The template's text between each two consecutive contents ("" where none)."""
    gaps: list[str] = []
    gap: str | None = None
    for seg in segments:
        if seg.content:
            if gap is not None:
                gaps.append(gap)
            gap = ""
        elif gap is not None:
            gap = seg.text
    return gaps


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
