"""Tool calls in the model's own format: what the doors call to give a model tools and read its
calls back.

A `Toolkit` is the daemon's tool-call model for its chat template, made once at start-up:

- `shape` gives a conversation and its tools to the template as the template expects them
  (shaping.py), or, for a template without tools, writes them into the conversation;
- `grammar` is the constraint of a turn's reply under its tool choice (call_grammar.py): it goes
  through the same llguidance path as any grammar, kept with the session as a `Constraint`
  of kind "tools", so a reply cut short, restored, forked or restarted continues within it;
- `stream` reads a reply's text back into content and calls (stream.py), in the family's
  syntax (formats.py).

The session layer keeps a session's tools and runs these; the HTTP door (and any other door)
only translates its shapes to `Tool`, `ToolChoice`, `ToolCall` and `Message` values and
`CallDelta`s back.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from kvkeepd.errors import InvalidRequest
from kvkeepd.request_limits import MAX_TOOL_GRAMMAR_CHARS
from kvkeepd.tools.call_grammar import call_grammar
from kvkeepd.tools.formats import SYNTAXES, Syntax
from kvkeepd.tools.shaping import TemplateInput, shape
from kvkeepd.tools.stream import CallStream
from kvkeepd.values.constraints import GrammarSpec
from kvkeepd.values.messages import Message
from kvkeepd.values.toolcall import FormatName, Tool, ToolChoice

__all__ = ["CallStream", "Toolkit", "call_ids_for"]

# Tool lists remembered as checked (an agent sends the same tools every turn).
CHECKED_TOOL_LISTS = 64


class Toolkit:
    """Tool calls for one model and template.

    `specials`: the pieces of the format's syntax that the vocabulary has as one control
    token (their ids); `control_texts`: the texts that become control tokens when a template's
    text is tokenized. A native template writes tools and calls into its own text, so those
    may not appear in them (a tool could otherwise forge a turn); the generic format writes
    them as message content, which is never parsed for control tokens.
    """

    def __init__(self, fmt: FormatName, specials: Mapping[str, int], control_texts: Sequence[str]) -> None:
        self.format = fmt
        self.syntax: Syntax = SYNTAXES[fmt]
        self.specials = {m: specials[m] for m in self.syntax.markers if m in specials}
        self.markers = frozenset(self.specials.values())
        self._control = () if fmt == "generic" else tuple(sorted({t for t in control_texts if t}))
        # Tool lists found free of control texts, the most recent last.
        self._checked: OrderedDict[tuple[Tool, ...], None] = OrderedDict()

    def shape(self, messages: Sequence[Message], tools: Sequence[Tool]) -> TemplateInput:
        """The conversation and tools as the template renders them; InvalidRequest for tools
        or calls that hold a control token's text where the template writes them."""
        if self._control:
            self._check_tools(tuple(tools))
            for m in messages:
                for c in m.tool_calls:
                    self._check_text(c.arguments, f"the arguments of the call to {c.name!r}")
        return shape(self.format, messages, tools)

    def grammar(
        self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool, answer: str = ""
    ) -> GrammarSpec | None:
        """The constraint of a reply under `choice` (None for "none"); `answer`: the JSON
        schema (its text, one that compiles) of a reply that is not a call."""
        if not choice.calls():
            return None
        schema = json.loads(answer) if answer else None
        if schema is not None and choice.mode == "auto" and not self.syntax.trigger:
            raise InvalidRequest(
                f"the model's tool-call format ({self.format}) writes a call as a bare JSON object, "
                "which a JSON answer could be: give tools or a response schema, not both",
                "json_schema",
            )
        text = call_grammar(self.syntax, tools, choice, parallel, self.specials, schema)
        if len(text) > MAX_TOOL_GRAMMAR_CHARS:
            raise InvalidRequest(
                f"the tools' grammar has {len(text)} characters; the limit is {MAX_TOOL_GRAMMAR_CHARS}"
            )
        return GrammarSpec("tools", text)

    def stream(self, call_ids: str) -> CallStream:
        """A reader of one reply whose calls' ids derive from `call_ids`."""
        return CallStream(self.syntax, call_ids, self.markers)

    def _check_tools(self, tools: tuple[Tool, ...]) -> None:
        if tools in self._checked:
            self._checked.move_to_end(tools)
            return
        for t in tools:
            self._check_text(t.description, f"the description of tool {t.name!r}")
            self._check_text(t.parameters, f"the parameters of tool {t.name!r}")
        self._checked[tools] = None
        while len(self._checked) > CHECKED_TOOL_LISTS:
            self._checked.popitem(last=False)

    def _check_text(self, text: str, what: str) -> None:
        found = next((t for t in self._control if t in text), None)
        if found is not None:
            raise InvalidRequest(f"{what} hold {found[:40]!r}, a control token of the model's template")


def call_ids_for(seed: int, start: int) -> str:
    """What a reply's call ids derive from: its seed and where it begins, so that a reply
    made again, continued or restored names its calls the same."""
    return hashlib.blake2b(f"{seed}:{start}".encode(), digest_size=8).hexdigest()
