"""SessionManager: the registry of sessions, their lifecycle and their residency in slots.

A session is a conversation bound to the loaded model: its token history, its sampling
parameters, its chat messages. While it is *hot* it owns one engine slot; a session that
needs a slot when none is free takes the one of the least recently used idle session. One
request at a time runs on a session; a second one waits its turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from kvstashd.chat import ChatTemplate, Message, Segment, after_prefix, text_of
from kvstashd.config import Settings
from kvstashd.engine import Chunk, Engine, GenerationRequest, Job, ModelInfo, SeqState
from kvstashd.errors import (
    Busy,
    ContextFull,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
)
from kvstashd.sampling import MAX_SEED, SamplingParams

T = TypeVar("T")

_SESSION_ID = re.compile(r"^s_[0-9a-f]{24}$")
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


@dataclass
class ChatMessage:
    """A recorded chat message and the history index where its tokens begin."""

    role: str
    content: str
    start: int


@dataclass
class Session:
    session_id: str
    persistent: bool
    params: SamplingParams
    stop: tuple[str, ...]
    created_at: float
    last_used_at: float
    state: SeqState = field(default_factory=SeqState)
    messages: list[ChatMessage] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    job: Job | None = None
    closed: bool = False

    @property
    def busy(self) -> bool:
        return self.lock.locked()


@dataclass(frozen=True)
class SamplingOverrides:
    """Optional per-request or per-session values; None keeps the current one."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    penalty_last_n: int | None = None
    seed: int | None = None

    def apply(self, base: SamplingParams) -> SamplingParams:
        return base.merged(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            penalty_last_n=self.penalty_last_n,
            seed=self.seed,
        )


@dataclass(frozen=True)
class Counters:
    sessions: int
    hot: int
    warm: int
    cold: int
    slots_in_use: int
    tokens_evaluated: int
    tokens_generated: int
    tokens_reused: int


class SessionManager:
    """Owns every session. Built with the engine (already started) and the settings."""

    def __init__(
        self, engine: Engine, settings: Settings, clock: Callable[[], float] = time.time
    ) -> None:
        if engine.info is None:
            raise ValueError("the engine must be started before the session manager")
        self.engine = engine
        self.model: ModelInfo = engine.info
        self.settings = settings
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self._slots: list[Session | None] = [None] * settings.slots
        self._slot_freed = asyncio.Event()
        self._waiting = 0
        self.tokens_reused = 0
        self.template: ChatTemplate | None = None
        if self.model.chat_template:
            self.template = ChatTemplate(self.model.chat_template, "", "")

    async def start(self) -> None:
        """Finish set-up that needs the engine thread (the template's BOS/EOS text)."""
        if self.model.chat_template:
            bos, eos = await self._engine(
                lambda e: (e.detokenize([self.model.bos_token], True),
                           e.detokenize([self.model.eos_token], True))
            )
            self.template = ChatTemplate(self.model.chat_template, bos, eos)

    async def _engine(self, fn: Callable[[Engine], T]) -> T:
        return await asyncio.wrap_future(self.engine.call(fn))

    # ---- registry ----------------------------------------------------------------------------

    def get(self, session_id: str) -> Session:
        """The open session with this id; InvalidRequest if malformed, NotFound if unknown."""
        if not _SESSION_ID.match(session_id):
            raise InvalidRequest(f"malformed session id: {session_id[:80]!r}")
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            raise NotFound(f"no session {session_id}")
        return session

    def list(self) -> list[Session]:
        return sorted(self.sessions.values(), key=lambda s: s.created_at)

    async def create(
        self,
        system_prompt: str,
        sampling: SamplingOverrides,
        stop: Sequence[str],
        persistent: bool,
    ) -> Session:
        """A new session; its system prompt is rendered now and evaluated on first use."""
        seed = sampling.seed if sampling.seed is not None else secrets.randbelow(MAX_SEED + 1)
        params = replace(sampling, seed=seed).apply(SamplingParams())
        now = self.clock()
        session = Session(
            session_id="s_" + secrets.token_hex(12),
            persistent=persistent,
            params=params,
            stop=_check_stop(stop),
            created_at=now,
            last_used_at=now,
        )
        if system_prompt:
            if self.template is not None:
                segments = self.template.render([Message("system", system_prompt)], False)
                tokens = await self._tokenize_segments(segments, first=True)
            else:
                tokens = await self._tokenize(system_prompt, first=True, parse_special=False)
            if len(tokens) >= self.model.n_ctx_seq:
                raise ContextFull(
                    f"the system prompt has {len(tokens)} tokens; the session's context holds "
                    f"{self.model.n_ctx_seq}"
                )
            session.state.tokens = tokens
            session.messages.append(ChatMessage("system", system_prompt, 0))
        self.sessions[session.session_id] = session
        return session

    async def close(self, session_id: str) -> None:
        """Stop the session's generation if any, free its slot, forget it."""
        session = self.get(session_id)
        session.closed = True
        if session.job is not None:
            session.job.cancelled = True
        async with session.lock:
            await self._release_slot(session)
            self.sessions.pop(session_id, None)

    async def rewind(self, session_id: str, n_tokens: int) -> Session:
        """Keep the first n_tokens tokens of history; the session continues from there."""
        session = self.get(session_id)
        async with session.lock:
            if not 0 <= n_tokens <= len(session.state.tokens):
                raise InvalidRequest(
                    f"n_tokens must be in [0, {len(session.state.tokens)}], got {n_tokens}"
                )
            state = session.state
            await self._engine(lambda e: e.truncate(state, n_tokens))
            session.messages = [m for m in session.messages if m.start < n_tokens]
            session.last_used_at = self.clock()
        return session

    def counters(self) -> Counters:
        hot = sum(1 for s in self.sessions.values() if s.state.slot is not None)
        return Counters(
            sessions=len(self.sessions),
            hot=hot,
            warm=0,
            cold=len(self.sessions) - hot,
            slots_in_use=sum(1 for s in self._slots if s is not None),
            tokens_evaluated=self.engine.stats_evaluated,
            tokens_generated=self.engine.stats_generated,
            tokens_reused=self.tokens_reused,
        )

    # ---- generation --------------------------------------------------------------------------

    async def generate(
        self,
        session_id: str,
        *,
        prompt: str,
        prompt_token_ids: Sequence[int],
        parse_special: bool,
        max_tokens: int | None,
        sampling: SamplingOverrides,
        stop: Sequence[str],
        logprobs: int,
    ) -> AsyncIterator[Chunk]:
        """Extend the session by a prompt (text or token ids) and stream the continuation."""
        session = self.get(session_id)
        if prompt and prompt_token_ids:
            raise InvalidRequest("give the prompt as text or as token ids, not both")
        n_vocab = self.model.n_vocab
        bad = next((t for t in prompt_token_ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {n_vocab})")
        request = self._request((), max_tokens, sampling, session, stop, logprobs)
        async with session.lock:
            self._check_open(session)
            if prompt:
                tokens = await self._tokenize(
                    prompt, first=not session.state.tokens, parse_special=parse_special
                )
            else:
                tokens = list(prompt_token_ids)
            request = _with_prompt(request, tokens)
            self._check_fits(session, request)
            async for chunk in self._run(session, request):
                yield chunk

    async def chat(
        self,
        session_id: str,
        *,
        message: str,
        max_tokens: int | None,
        sampling: SamplingOverrides,
        stop: Sequence[str],
        logprobs: int,
    ) -> AsyncIterator[Chunk]:
        """Add a user message through the chat template and stream the assistant's reply."""
        session = self.get(session_id)
        if self.template is None:
            raise FailedPrecondition("the model has no chat template; use Generate")
        if not message:
            raise InvalidRequest("the message is empty")
        request = self._request((), max_tokens, sampling, session, stop, logprobs)
        async with session.lock:
            self._check_open(session)
            state = session.state
            user = ChatMessage("user", message, len(state.tokens))
            conversation = [Message(m.role, m.content) for m in session.messages]
            conversation.append(Message("user", message))
            segments = self.template.render(conversation, add_generation_prompt=True)
            history_text = await self._engine(lambda e: e.detokenize(state.tokens, True))
            delta = after_prefix(segments, history_text)
            if delta is not None:
                tokens = await self._tokenize_segments(delta, first=not state.tokens)
            else:
                # The history is not a prefix of the rendered conversation (raw generation or
                # a stop string left text the template does not have): keep what matches.
                full = await self._tokenize_segments(segments, first=True)
                keep = _common_prefix(full, state.tokens)
                await self._engine(lambda e: e.truncate(state, keep))
                tokens = full[keep:]
                user.start = keep
            request = _with_prompt(request, tokens)
            self._check_fits(session, request)
            session.messages.append(user)
            reply_start = len(state.tokens) + len(tokens)
            text: list[str] = []
            async for chunk in self._run(session, request):
                text.append(chunk.text)
                yield chunk
            session.messages.append(ChatMessage("assistant", "".join(text), reply_start))

    def _request(
        self,
        prompt: tuple[int, ...],
        max_tokens: int | None,
        sampling: SamplingOverrides,
        session: Session,
        stop: Sequence[str],
        logprobs: int,
    ) -> GenerationRequest:
        if max_tokens is not None and max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be > 0, got {max_tokens}")
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
        return GenerationRequest(
            prompt=prompt,
            max_tokens=max_tokens,
            params=sampling.apply(session.params),
            stop=session.stop + _check_stop(stop),
            logprobs=logprobs,
        )

    def _check_fits(self, session: Session, request: GenerationRequest) -> None:
        n_prompt = len(request.prompt)
        if n_prompt > self.settings.prompt_limit:
            raise InvalidRequest(
                f"the prompt has {n_prompt} tokens; the limit is {self.settings.prompt_limit}"
            )
        state = session.state
        if not n_prompt and not state.tokens:
            raise InvalidRequest("the prompt is empty and the session has nothing to continue")
        n_ctx = self.model.n_ctx_seq
        needed = len(state.tokens) + n_prompt + (request.max_tokens or 1)
        if needed > n_ctx:
            raise ContextFull(
                f"history ({len(state.tokens)}) + prompt ({n_prompt}) + max_tokens "
                f"({request.max_tokens or 1}) is {needed} tokens; the session's context is {n_ctx}"
            )

    def _check_open(self, session: Session) -> None:
        if session.closed:
            raise NotFound(f"no session {session.session_id}")

    async def _run(self, session: Session, request: GenerationRequest) -> AsyncIterator[Chunk]:
        """Run one generation on a session whose lock the caller holds."""
        await self._acquire_slot(session)
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()
        done: asyncio.Future[None] = loop.create_future()

        def deliver(item: Chunk | BaseException) -> None:
            items.put_nowait(item)
            final = not isinstance(item, Chunk) or item.finish_reason is not None
            if final and not done.done():
                done.set_result(None)

        def emit(item: Chunk | BaseException) -> None:
            loop.call_soon_threadsafe(deliver, item)

        job = Job(session.state, request, emit)
        session.job = job
        session.last_used_at = self.clock()
        self.engine.submit(job)
        try:
            while True:
                item = await items.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    self.tokens_reused += item.usage.reused_tokens if item.usage else 0
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not done.done():
                job.cancelled = True
                # The engine stops the job within one step; wait, so that the session's
                # history is settled before the next request may touch it.
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(done)
            session.job = None
            session.last_used_at = self.clock()

    # ---- slots -------------------------------------------------------------------------------

    async def _acquire_slot(self, session: Session) -> None:
        """Give the session a slot: a free one, or the least recently used idle one."""
        if session.state.slot is not None:
            return
        if self._waiting >= self.settings.max_queue:
            raise Busy("too many requests are waiting for a slot; try again later")
        self._waiting += 1
        try:
            while (slot := self._free_slot()) is None:
                victim = self._eviction_victim()
                if victim is not None:
                    await self._release_slot(victim)
                    continue
                self._slot_freed.clear()
                await self._slot_freed.wait()
        finally:
            self._waiting -= 1
        self._slots[slot] = session
        session.state.slot = slot

    def _free_slot(self) -> int | None:
        return next((i for i, s in enumerate(self._slots) if s is None), None)

    def _eviction_victim(self) -> Session | None:
        idle = [s for s in self._slots if s is not None and not s.busy]
        return min(idle, key=lambda s: s.last_used_at) if idle else None

    async def _release_slot(self, session: Session) -> None:
        """Take a session out of its slot. Its history stays; its KV is computed again later."""
        state = session.state
        slot = state.slot
        if slot is None:
            return
        # NOTE: the bookkeeping changes before the engine clears the slot. That is safe
        # because the engine runs its inbox in order: whatever a new owner of the slot
        # queues after this point runs after the clear.
        state.slot = None
        state.n_kv = 0
        self._slots[slot] = None
        self._slot_freed.set()
        await self._engine(lambda e: e.clear_slot(slot))

    # ---- tokens ------------------------------------------------------------------------------

    async def _tokenize(self, text: str, *, first: bool, parse_special: bool) -> list[int]:
        add = first and self.model.add_bos
        return await self._engine(
            lambda e: e.tokenize(text, add_special=add, parse_special=parse_special)
        )

    async def _tokenize_segments(self, segments: Sequence[Segment], *, first: bool) -> list[int]:
        """Template text with control tokens parsed; message content never."""
        bos_text = await self._engine(lambda e: e.detokenize([self.model.bos_token], True))
        add_bos = first and self.model.add_bos and not text_of(segments).startswith(bos_text)

        def run(e: Engine) -> list[int]:
            out: list[int] = [self.model.bos_token] if add_bos else []
            for seg in segments:
                out += e.tokenize(seg.text, add_special=False, parse_special=not seg.content)
            return out

        return await self._engine(run)


def _with_prompt(request: GenerationRequest, tokens: Sequence[int]) -> GenerationRequest:
    return GenerationRequest(
        prompt=tuple(tokens),
        max_tokens=request.max_tokens,
        params=request.params,
        stop=request.stop,
        logprobs=request.logprobs,
    )


def _check_stop(stop: Sequence[str]) -> tuple[str, ...]:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for s in stop:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise InvalidRequest(f"stop strings must have 1 to {MAX_STOP_LENGTH} characters")
    return tuple(stop)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

