"""Generations: a session's computed state, a request to extend it, and the token output.

A `Job` is created on the asyncio side and run by the engine thread, which owns the job's
`SeqState` while it runs; everything the job produces reaches the asyncio side through its
`emit` callback, the last `Chunk` carrying the finish reason and usage. The daemon's
callbacks post to the engine's `Outbox`, which hands a step's output to each event loop in
one wake-up, as the next decode starts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvkeepd.engine.sampling import sample, top_logprobs
from kvkeepd.engine.structured_output import Matcher
from kvkeepd.engine.text import StopMatcher, Utf8Stream
from kvkeepd.errors import KvkeepError
from kvkeepd.state import cells as kvstate
from kvkeepd.tools import CallStream
from kvkeepd.values.generation import (
    Chunk,
    FinishReason,
    GeneratedToken,
    GenerationRequest,
    PromptProgress,
    TokenLogprob,
    Usage,
)
from kvkeepd.values.sampling import Logits
from kvkeepd.values.toolcall import CallDelta

log = logging.getLogger(__name__)
# Epochs of computed states: unique across SeqStates, so none is ever reused.
_EPOCHS = itertools.count(1)


@dataclass
class SeqState:
    """A session's computed state.

    Invariant: wherever the session's KV is (a slot, RAM, the store), it holds exactly the
    state after `tokens[:n_kv]`, and `logits` (when set) is the row the model gave after
    them. Tokens past n_kv are pending: the last sampled token, or prompt tokens not yet
    evaluated. `window_from` is the first position whose sliding-window cells are real (a
    restored session's cells below its window are zeros). While the session is in a slot,
    only the engine thread writes this; otherwise only the asyncio side does.

    `epoch` changes whenever cells are taken away (n_kv lowered: a cut, a clear, a load),
    never while cells are only added: at two moments of one epoch, the cells below the
    smaller n_kv are the same bytes (see Residency.rewind_to).
    """

    tokens: list[int] = field(default_factory=list)
    n_kv: int = 0
    logits: Logits | None = None
    draws: int = 0
    window_from: int = 0
    epoch: int = field(default_factory=lambda: next(_EPOCHS))

    def __setattr__(self, name: str, value: object) -> None:
        if name == "n_kv" and isinstance(value, int) and value < getattr(self, "n_kv", 0):
            object.__setattr__(self, "epoch", next(_EPOCHS))
        object.__setattr__(self, name, value)

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.n_kv


class Vocab(Protocol):
    """What token output needs from the model."""

    def piece(self, token: int, special: bool) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...


class Job:
    """One generation in flight on a slot: under the open constraint's `matcher` (structured
    output), advanced by every sampled token, and with a reply's tool calls read back from
    its text by `calls` (the content streams as text, the calls as their pieces)."""

    def __init__(
        self,
        state: SeqState,
        slot: int,
        request: GenerationRequest,
        emit: Callable[[Chunk | BaseException], None],
        *,
        matcher: Matcher | None = None,
        calls: CallStream | None = None,
    ) -> None:
        self.state = state
        self.slot = slot
        self.request = request
        self.emit = emit
        self.matcher = matcher
        self.calls = calls
        # Set from the asyncio thread; read by the engine at the start of every step.
        self.cancelled = False
        self.generated: list[int] = []
        self.text = ""
        self.reused = 0
        self.evaluated = 0
        # The context to evaluate before the first token, and when its evaluation began
        # (set by begin).
        self._total = 0
        self._began = 0.0
        # The recurrent state at the end of the prompt (models with one): a point the
        # session can later rewind to without evaluating from the start.
        self.snapshot: kvstate.RecurrentCells | None = None
        # A cached state of the history's first positions (the prefix cache), loaded into the
        # slot at the start when it covers more than the slot holds.
        self.prefix: kvstate.SeqKv | None = None
        # Where the prefix cache wants the sliding-window and recurrent sections kept (the
        # last block boundary of the system prompt, for models that have them; 0: nowhere),
        # and what they were there.
        self.boundary_at = 0
        self.boundary: tuple[int, tuple[kvstate.Section, ...]] | None = None
        self._utf8 = Utf8Stream()
        self._stop = StopMatcher(request.stop)
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[GeneratedToken] = []
        self._pending_calls: list[CallDelta] = []

    def begin(self) -> None:
        """The prompt's evaluation begins: what the slot holds now is reused; the first
        progress report (its processed tokens are the cached ones)."""
        self.reused = self.state.n_kv
        self._total = len(self.state.tokens)
        self._began = time.monotonic()
        self.report()

    def report(self) -> None:
        """After each chunk of the prompt is evaluated: how far it is, when the request asked."""
        if not self.request.progress or self.generated:
            return
        progress = PromptProgress(
            total=self._total,
            cached=self.reused,
            processed=self.state.n_kv,
            time_ms=(time.monotonic() - self._began) * 1000.0,
        )
        self.emit(Chunk(text="", token_ids=(), progress=progress))

    def usage(self) -> Usage:
        prompt = len(self.state.tokens) - len(self.generated)
        return Usage(
            prompt_tokens=prompt,
            generated_tokens=len(self.generated),
            reused_tokens=self.reused,
            # Less than the rest of the prompt only where the request ended during it.
            evaluated_tokens=min(self.evaluated, prompt - self.reused),
            added_tokens=len(self.request.prompt),
            decoded_tokens=self.evaluated,
        )

    def sample(self, row: Logits, vocab: Vocab, ctx_limit: int) -> bool:
        """Draw the next token from `row`, record and stream it. True when the job ends."""
        state, req = self.state, self.request
        try:
            allowed = self.matcher.allowed() if self.matcher is not None else None
            token = sample(row, state.tokens, req.params, state.draws, allowed)
            if self.matcher is not None:
                self.matcher.consume(token)
        except KvkeepError as e:  # the grammar met its engine's limits: nothing was added
            self.emit(e)
            return True
        state.draws += 1
        state.tokens.append(token)
        self.generated.append(token)
        eog = vocab.is_eog(token)
        released = "" if eog else self._released(vocab, token)
        self.text += released
        self._pending_ids.append(token)
        if req.logprobs > 0:
            lp, top = top_logprobs(row, token, req.logprobs)
            text = _text_of(vocab, token)
            self._pending_logprobs.append(
                GeneratedToken(
                    sampled=TokenLogprob(token, text, lp),
                    top=tuple(TokenLogprob(t, _text_of(vocab, t), v) for t, v in top),
                )
            )
        reason: FinishReason | None = None
        if eog:
            reason = "tool_calls" if self.calls is not None and self.calls.calls else "eos"
        elif self._stop.matched:
            reason = "stop"
        elif (limit := req.max_tokens or req.default_max_tokens) is not None and len(self.generated) >= limit:
            reason = "length"
        elif len(state.tokens) >= ctx_limit:
            reason = "context_full"
        if reason is not None:
            self.finish(reason, released)
            return True
        self._emit_pending(released)
        return False

    def _released(self, vocab: Vocab, token: int) -> str:
        """The text a token releases: its content through the stop matcher (a reply's calls
        are read apart, the control tokens of their syntax included)."""
        calls = self.calls
        if calls is None:
            return self._stop.feed(self._utf8.feed(vocab.piece(token, False)))
        content, deltas = calls.feed(self._utf8.feed(vocab.piece(token, token in calls.markers)))
        self._pending_calls += deltas
        return self._stop.feed(content)

    def finish(self, reason: FinishReason, released: str = "") -> None:
        """Emit the last chunk: what the stop matcher held back (unless a stop matched)."""
        if reason != "stop":
            tail = self._utf8.flush()
            if self.calls is not None:
                content, deltas = self.calls.feed(tail)
                self._pending_calls += deltas
                tail = content + self.calls.finish()
            tail = self._stop.feed(tail) + self._stop.flush()
            self.text += tail
            released += tail
        self._emit_pending(released, reason)

    def _emit_pending(self, text: str, reason: FinishReason | None = None) -> None:
        self.emit(
            Chunk(
                text=text,
                token_ids=tuple(self._pending_ids),
                logprobs=tuple(self._pending_logprobs),
                finish_reason=reason,
                usage=self.usage() if reason else None,
                tool_calls=tuple(self._pending_calls),
                stop_sequence=self._stop.matched if reason == "stop" else "",
            )
        )
        self._pending_ids = []
        self._pending_logprobs = []
        self._pending_calls = []


def _text_of(vocab: Vocab, token: int) -> str:
    return vocab.piece(token, True).decode("utf-8", "replace")


class Outbox:
    """What the engine thread hands to event loops: calls posted during a step, delivered
    together by `flush`, one `call_soon_threadsafe` per loop.

    The engine flushes once a step's tokens are all sampled, just before it decodes again:
    the asyncio side then wakes once per step, not once per session, and serves the step's
    chunks while llama.cpp computes the next one (the decode releases the GIL). Woken
    earlier, in the middle of the sampling, it would hold the GIL while the engine waits
    for it at its next ctypes call.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[Any], object], Any]]] = {}

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable[[Any], object], item: Any) -> None:
        """Queue `fn(item)` to run on `loop` at the next flush; from any thread."""
        with self._lock:
            self._pending.setdefault(loop, []).append((fn, item))

    def flush(self) -> None:
        """Deliver everything posted so far, in order, per loop."""
        with self._lock:
            if not self._pending:
                return
            pending, self._pending = self._pending, {}
        for loop, calls in pending.items():
            try:
                loop.call_soon_threadsafe(_deliver, calls)
            except RuntimeError:  # the loop is closed: nobody waits for these any more
                log.debug("%d outputs for a closed event loop dropped", len(calls))


def _deliver(calls: list[tuple[Callable[[Any], object], Any]]) -> None:
    for fn, item in calls:
        fn(item)
