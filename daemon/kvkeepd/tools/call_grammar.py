"""The grammar of a turn's tool calls: llguidance's Lark syntax, built from a family's syntax
(formats.py), the tools and the turn's tool choice.

- ``required``: the reply is one call or more (one with ``parallel_tool_calls`` off, or in a
  family that makes one call per reply); a named function: one call to it.
- ``auto``: free text, or (where the family allows text first) text and then calls. The free
  text is a lexeme that cannot contain the calls' opening, and the text before a call is a
  lazy lexeme that ends at its first opening, so once the opening is written the rest is held
  to the calls: the lazy trigger of llama.cpp's grammars, as llguidance writes it.
- ``auto`` with a response schema (an agent with tools and a typed answer): the reply is the
  answer, held to the schema, or calls, which begin with their opening. No text comes before
  the calls (it could only be an answer cut short), and the family's opening must differ
  from a JSON answer's (llama3's calls are bare JSON objects: refused there).

Each call is literal text around its name, and its arguments are the tool's parameters
inlined as a JSON schema (``%json``) of their own, so the schema's ``$ref``s resolve against
it. Pieces that the vocabulary has as one control token (``<tool_call>`` in Qwen's,
``[TOOL_CALLS]`` in Mistral's) may be written either way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvkeepd.tools.formats import MISTRAL_ID_LENGTH, Syntax
from kvkeepd.values.toolcall import Tool, ToolChoice

# The JSON the model writes: compact, with the usual spaces after separators (a small model
# left free to choose whitespace may emit it forever), and what templates' `tojson` writes
# for arguments given back. A schema's own "x-guidance" options override these.
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_grammar(
    syntax: Syntax,
    tools: Sequence[Tool],
    choice: ToolChoice,
    parallel: bool,
    specials: Mapping[str, int],
    answer: Mapping[str, Any] | None = None,
) -> str:
    """The Lark grammar of a reply under `choice` (not "none"). `specials`: the syntax's
    markers that the vocabulary has as one control token, and their ids; `answer`: the JSON
    schema of a reply that is not a call (None: free text)."""
    callable_tools = [t for t in tools if choice.mode != "function" or t.name == choice.function]
    several = parallel and syntax.parallel and choice.mode != "function"
    rules = ["%llguidance {}"]
    calls = "call (sep call)*" if several else "call"
    body = f"{_lit(syntax.head, specials)} {calls} {_lit(syntax.tail, specials)}".strip()
    if syntax.trigger:
        opener = _alternatives(syntax.trigger, specials)
        if choice.mode == "auto" and answer is not None:
            rules += [
                f"start: answer | ({opener}) calls_body",
                f"answer: %json {json.dumps(answer_schema(answer), ensure_ascii=False)}",
            ]
        elif choice.mode == "auto":
            special = specials.get(syntax.trigger)
            starts = ["TEXT", "text_head calls_body"]
            if special is not None:
                starts += [f"TEXT <[{special}]> calls_body", f"<[{special}]> calls_body"]
            rules += [
                f"start: {' | '.join(starts)}",
                # Free text never holds the opening; text before a call ends at the first one.
                f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(syntax.trigger)}(?s:.*)/",
                f"text_head[lazy]: TEXT {_string(syntax.trigger)}",
            ]
        else:
            rules.append(f"start: ({opener}) calls_body")
        rules.append(f"calls_body: {body}")
    elif choice.mode == "auto" and answer is not None:
        raise ValueError(f"the {syntax.name} format writes a call as a JSON object, like the answer")
    elif choice.mode == "auto":
        # A reply that is a call begins with its opening brace; free text never does.
        rules += [f"start: TEXT | {body} | ", "TEXT: /[^{](?s:.*)/"]
    else:
        rules.append(f"start: {body}")
    if several:
        rules.append(f"sep: {_lit(syntax.sep, specials)}")
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(callable_tools))))
    for i, tool in enumerate(callable_tools):
        head = _lit(syntax.call_start + tool.name + syntax.call_mid, specials)
        end = _lit(syntax.call_end, specials)
        if syntax.call_id:
            end = f"{_lit(syntax.call_id, specials)} CALL_ID {end}"
        rules.append(f"call_{i}: {head} args_{i} {end}")
        rules.append(f"args_{i}: %json {json.dumps(arguments_schema(tool), ensure_ascii=False)}")
    if syntax.call_id:
        rules.append(f"CALL_ID: /[a-zA-Z0-9]{{{MISTRAL_ID_LENGTH}}}/")
    return "\n".join(rules) + "\n"


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The tool's parameters as the grammar holds its arguments to them: an object, written
    in the JSON style above unless the schema says otherwise, whose objects have only the
    properties they name unless they say otherwise (as llama.cpp's grammars have it: a model
    left free to add properties invents them, and arguments that validate without them
    validate with the schema as given)."""
    schema = _closed(tool.schema())
    assert isinstance(schema, dict)
    schema.setdefault("type", "object")
    style = schema.get("x-guidance")
    schema["x-guidance"] = {**JSON_STYLE, **(style if isinstance(style, dict) else {})}
    return schema


def answer_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A response schema as the grammar holds the answer to it: in the JSON style above unless
    it says otherwise, as a response schema alone is (kvkeepd.engine)."""
    out = dict(schema)
    style = out.get("x-guidance")
    out["x-guidance"] = {**JSON_STYLE, **(style if isinstance(style, dict) else {})}
    return out


# Where a JSON schema holds schemas: maps of them, lists of them, and single ones (a value
# anywhere else, a const or an enum's, is data and stays as it is).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "additionalItems")


def _closed(schema: Any) -> Any:
    """A copy of a schema with `"additionalProperties": false` in every object schema that
    names its properties and says nothing of others."""
    if isinstance(schema, list):  # `items` as a list (older drafts)
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    for key in (*_SCHEMA_LISTS, *_SCHEMA_ONES):
        if key in out:
            out[key] = _closed(out[key])
    if (
        isinstance(out.get("properties"), dict)
        and not {"additionalProperties", "patternProperties"} & out.keys()
    ):
        out["additionalProperties"] = False
    return out


def _lit(text: str, specials: Mapping[str, int]) -> str:
    """`text` as a Lark sequence, each marker in it that is a control token of the vocabulary
    written either as text or as that token."""
    if not text:
        return ""
    for marker in sorted(specials, key=len, reverse=True):
        before, found, after = text.partition(marker)
        if found:
            parts = [_lit(before, specials), f"({_alternatives(marker, specials)})", _lit(after, specials)]
            return " ".join(p for p in parts if p)
    return _string(text)


def _alternatives(marker: str, specials: Mapping[str, int]) -> str:
    special = specials.get(marker)
    return _string(marker) if special is None else f"{_string(marker)} | <[{special}]>"


def _string(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)
