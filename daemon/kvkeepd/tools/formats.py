"""The families' syntaxes of tool calls, and which one a chat template speaks.

Each syntax is literal text but for a call's name, its arguments (JSON) and, in Mistral's, an
id the model writes. The grammar (call_grammar.py) holds a reply to it and the stream parser
(stream.py) reads it back, so both are written from the same pieces here:

- ``hermes`` (Hermes, Qwen 2.5, SmolLM3...): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n
  </tool_call>``, one block per call, after any text.
- ``llama3`` (Llama 3.1 to 3.3, JSON-based tool calling): the reply is one
  ``{"name": "f", "parameters": {...}}`` (their templates take one call per message).
- ``mistral`` (Mistral 7B v0.3, Nemo...): ``[TOOL_CALLS][{"name": "f", "arguments": {...},
  "id": "a1b2c3d4e"}, ...]``, the ids 9 letters or digits.
- ``generic``: for templates that render no tools. The daemon writes the tools into the
  system prompt (shaping.py) and the model calls them in the hermes syntax.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvkeepd.values.toolcall import AUTO_FORMAT, FORMATS, FormatName


@dataclass(frozen=True)
class Syntax:
    """How one family writes a reply's calls: ``trigger head`` then the calls separated by
    ``sep`` then ``tail``; each call ``call_start NAME call_mid ARGUMENTS [call_id ID]
    call_end``."""

    name: FormatName
    #: What opens the calls; "" when a reply that calls begins with its call.
    trigger: str
    head: str
    call_start: str
    call_mid: str
    #: Before the id the model writes after the arguments ("" where the family has none).
    call_id: str
    call_end: str
    #: Between two calls; "" where a reply makes one call.
    sep: str
    tail: str
    #: Pieces that some vocabularies have as one control token.
    markers: tuple[str, ...]

    @property
    def text_first(self) -> bool:
        """Text may come before the calls."""
        return bool(self.trigger)

    @property
    def parallel(self) -> bool:
        """A reply may make several calls."""
        return bool(self.sep)


def _hermes(name: FormatName) -> Syntax:
    return Syntax(
        name,
        trigger="<tool_call>",
        head="\n",
        call_start='{"name": "',
        call_mid='", "arguments": ',
        call_id="",
        call_end="}\n</tool_call>",
        sep="\n<tool_call>\n",
        tail="",
        markers=("<tool_call>", "</tool_call>"),
    )


SYNTAXES: dict[FormatName, Syntax] = {
    "hermes": _hermes("hermes"),
    "generic": _hermes("generic"),
    "llama3": Syntax(
        "llama3",
        trigger="",
        head="",
        call_start='{"name": "',
        call_mid='", "parameters": ',
        call_id="",
        call_end="}",
        sep="",
        tail="",
        markers=(),
    ),
    "mistral": Syntax(
        "mistral",
        trigger="[TOOL_CALLS]",
        head="[",
        call_start='{"name": "',
        call_mid='", "arguments": ',
        call_id=', "id": "',
        call_end='"}',
        sep=", ",
        tail="]",
        markers=("[TOOL_CALLS]",),
    ),
}
#: Mistral's call ids: 9 letters or digits (its templates refuse others).
MISTRAL_ID_LENGTH = 9


def detect(source: str) -> FormatName:
    """The family a chat template's source speaks; generic when it renders no tools in a
    syntax named here (Qwen3-Coder's XML calls, Mistral's newer [ARGS] form...)."""
    if "[TOOL_CALLS]" in source and "[ARGS]" not in source:
        return "mistral"
    if "<tool_call>" in source and "<function=" not in source:
        return "hermes"
    if "<|start_header_id|>" in source and '"parameters": ' in source:
        return "llama3"
    return "generic"


def format_named(name: str, source: str) -> FormatName:
    """The format of the daemon flag's value: detected from the template for auto."""
    if name == AUTO_FORMAT:
        return detect(source)
    for known in FORMATS:
        if name == known:
            return known
    raise ValueError(f"the tool format must be {AUTO_FORMAT} or one of {', '.join(FORMATS)}, not {name!r}")
