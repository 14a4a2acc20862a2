"""Structured output: a GBNF grammar or a JSON schema, applied as a mask on the logits row.

llguidance compiles a grammar against the model's vocabulary; for every token it says which
tokens may follow (a bitmask, computed in microseconds, within fuel limits that bound every
step), and the sampler draws from the row with the others at -inf. Nothing random is added,
so the same seed gives the same output.

A session's open constraint is a `Constraint`: the grammar's text and the position in the
history where its output begins. That is all a checkpoint keeps; the matcher is rebuilt by
replaying `tokens[start:]`, so a restored, forked or resumed session continues within the
grammar exactly where it was. A constraint closes when its output is complete (an
end-of-generation token, allowed only once the grammar accepts) and is replaced by the next
request that gives a prompt or a chat message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

import llguidance
import numpy as np
import numpy.typing as npt
from llguidance.gbnf_to_lark import gbnf_to_lark

from kvkeepd.errors import InvalidRequest, KvkeepError
from kvkeepd.tools.call_grammar import JSON_STYLE
from kvkeepd.values.constraints import Constraint, GrammarSpec

log = logging.getLogger(__name__)

# Compact JSON with the usual spaces after separators (kvkeepd.tools.call_grammar): a small model
# left free to choose whitespace may emit it forever. A schema's own "x-guidance" options
# override these.
JSON_OPTIONS: llguidance._lib.JsonCompileOptions = {
    "whitespace_flexible": JSON_STYLE["whitespace_flexible"],
    "item_separator": JSON_STYLE["item_separator"],
    "key_separator": JSON_STYLE["key_separator"],
}
# Compiled grammars kept for reuse (per tenant: compile times must not tell one tenant
# which schemas another uses).
CACHE_ENTRIES = 64
# A GBNF rule the converter to Lark cannot take: it names root so.
_GBNF_START = re.compile(r"(?m)^\s*start\s*::=")
# The request field each kind of grammar comes in.
_FIELDS = {"gbnf": "grammar", "json_schema": "json_schema", "tools": "tools"}
# An error message from the compiler is cut to this many characters.
MAX_ERROR_CHARS = 600


class Matcher:
    """A grammar's state after some output: which tokens may come next. Used by one thread
    at a time (the engine's, while its generation runs)."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int) -> None:
        self._m = matcher
        self._n_vocab = n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    def allowed(self) -> npt.NDArray[np.bool_]:
        """A boolean row over the vocabulary: True where the token may come next."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        row = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._n_vocab].view(np.bool_)
        if not row.any():
            raise KvkeepError("internal: the grammar allows no token")
        return row

    def consume(self, token: int) -> None:
        """Advance past `token` (one the last mask allowed)."""
        self._m.consume_token(token)
        self._check()

    def _check(self) -> None:
        if self._m.is_error():
            # A grammar can meet the engine's limits late (too ambiguous after some output).
            raise InvalidRequest(f"the grammar could not be followed: {_short(self._m.get_error())}")


Tokenizer = Callable[[], Awaitable[llguidance.LLTokenizer]]


class Grammars:
    """Compiles grammars against the model's vocabulary and builds matchers.

    `tokenizer` gives the vocabulary as llguidance sees it (built on first use: it takes a
    few hundred milliseconds). Compiling runs in a worker thread, never on the event loop or
    the engine; llguidance's limits bound its time and memory.
    """

    def __init__(self, tokenizer: Tokenizer, n_vocab: int) -> None:
        self._make_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = asyncio.Lock()
        self.n_vocab = n_vocab
        self._cache: OrderedDict[tuple[str, GrammarSpec], llguidance.LLMatcher] = OrderedDict()
        self._limits = llguidance.LLParserLimits()

    async def warm(self) -> None:
        """Build the vocabulary llguidance needs now, so that the first request with tools or
        a schema after a start does not wait for it (a few hundred milliseconds). A failure
        is left to that request, which builds it again and says why."""
        try:
            await self._llg_tokenizer()
        except Exception:
            log.debug("the grammars' vocabulary was not built ahead", exc_info=True)

    @property
    def warmed(self) -> bool:
        """Whether the vocabulary llguidance needs is built."""
        return self._tokenizer is not None

    async def check(self, tenant: str, spec: GrammarSpec) -> None:
        """Compile `spec` (or find it compiled); InvalidRequest says what is wrong with it."""
        await self._compiled(tenant, spec)

    async def matcher(self, tenant: str, constraint: Constraint, output: Sequence[int]) -> Matcher:
        """A matcher for `constraint` after `output` (the history since its start)."""
        template = await self._compiled(tenant, constraint.spec)
        tokens = list(output)

        def replay() -> llguidance.LLMatcher:
            m = template.deep_copy()
            m.consume_tokens(tokens)
            return m

        m = await asyncio.to_thread(replay) if tokens else template.deep_copy()
        if m.is_error():
            raise InvalidRequest(
                f"the session's output since position {constraint.start} does not match its grammar; "
                "give a prompt to continue without it"
            )
        return Matcher(m, self.n_vocab)

    async def _compiled(self, tenant: str, spec: GrammarSpec) -> llguidance.LLMatcher:
        key = (tenant, spec)
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            return found
        tokenizer = await self._llg_tokenizer()
        compiled = await asyncio.to_thread(compile_spec, tokenizer, spec, self._limits)
        self._cache[key] = compiled
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return compiled

    async def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = await self._make_tokenizer()
            return self._tokenizer


def compile_spec(
    tokenizer: llguidance.LLTokenizer, spec: GrammarSpec, limits: llguidance.LLParserLimits
) -> llguidance.LLMatcher:
    """A fresh matcher for `spec`; InvalidRequest when it does not compile."""
    name = {"gbnf": "grammar", "json_schema": "JSON schema", "tools": "tools' parameters schema"}[spec.kind]
    try:
        if spec.kind == "tools":
            # Built by kvkeepd.tools in llguidance's Lark syntax, each tool's parameters
            # inlined as a JSON schema: one that does not compile is named in the error.
            definition = llguidance.LLMatcher.grammar_from_lark(spec.text)
        elif spec.kind == "gbnf":
            # GBNF is converted to llguidance's Lark syntax, which is also accepted as it is (it
            # has no "::="; llguidance's own guess, a rule named "start", mistakes GBNF's).
            if _GBNF_START.search(spec.text):
                raise ValueError("a GBNF rule may not be named 'start' (the converter's name for root)")
            lark = gbnf_to_lark(spec.text) if "::=" in spec.text else spec.text
            definition = llguidance.LLMatcher.grammar_from_lark(lark)
        else:
            schema = json.loads(spec.text)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be a JSON object")
            definition = llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)
    except Exception as e:  # the GBNF converter raises bare Exceptions and RecursionError
        raise InvalidRequest(f"the {name} is invalid: {_short(e)}", _FIELDS[spec.kind]) from None
    matcher = llguidance.LLMatcher(tokenizer, definition, log_level=0, limits=limits)
    if not matcher.is_error():
        # Some limits are met only by the first mask (a grammar too ambiguous to follow).
        first = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
    if matcher.is_error():
        raise InvalidRequest(f"the {name} is invalid: {_short(matcher.get_error())}", _FIELDS[spec.kind])
    return matcher


def _short(error: object) -> str:
    text = str(error)
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."
