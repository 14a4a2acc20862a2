"""Structured output's values: what a request asked its output to match, and a session's open
constraint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from kvkeepd.errors import InvalidRequest
from kvkeepd.request_limits import MAX_GRAMMAR_CHARS

#: A GBNF (or Lark) grammar, a JSON schema, or the Lark grammar of a turn's tool calls
#: (kvkeepd.tools), which may be longer: it holds every tool's parameters.
Kind = Literal["gbnf", "json_schema", "tools"]
KINDS: tuple[Kind, ...] = get_args(Kind)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asked its output to match."""

    kind: Kind
    text: str

    @staticmethod
    def of(grammar: str, json_schema: str) -> GrammarSpec | None:
        """The spec of a request's `grammar` and `json_schema` fields (None: neither)."""
        if grammar and json_schema:
            raise InvalidRequest("give a grammar or a JSON schema, not both")
        kind: Kind = "gbnf" if grammar else "json_schema"
        text = grammar or json_schema
        if not text:
            return None
        if len(text) > MAX_GRAMMAR_CHARS:
            name = "grammar" if grammar else "JSON schema"
            raise InvalidRequest(f"the {name} has {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}")
        return GrammarSpec(kind, text)


@dataclass(frozen=True)
class Constraint:
    """An open constrained output: its grammar, and the history position where it begins.
    A tool-call constraint also keeps what its calls' ids derive from (kvkeepd.tools), so a
    reply continued elsewhere names its calls as the uninterrupted one would."""

    spec: GrammarSpec
    start: int
    call_ids: str = ""


def next_constraint(
    current: Constraint | None, spec: GrammarSpec | None, start: int, continuing: bool
) -> Constraint | None:
    """The constraint a request runs under. `start` is where its output begins; `continuing`:
    the request adds no prompt. Such a request continues the open constraint when it gives
    no grammar or the same one; anything else starts `spec` afresh (or runs unconstrained)."""
    if continuing and current is not None and spec in (None, current.spec):
        return current
    return Constraint(spec, start) if spec is not None else None
