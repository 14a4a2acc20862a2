"""SessionManager: the registry of sessions, their lifecycle, residency and checkpoints.

A session is a conversation bound to the loaded model: its token history, its sampling
parameters, its chat messages, and the KV cells computed for its history. The cells live
in one of three places:

- *hot*: in an engine slot;
- *warm*: parked in RAM (`Session.parked`), after eviction, a restore or a fork;
- *cold*: in a checkpoint store (`Session.cold`): a persistent session's head after a
  restart or a spill, an ephemeral session's spill (a disk area wiped at every start, and
  of which nothing outlives the session).

A session that needs a slot when none is free takes the one of the least recently used
idle session, whose cells are parked first; parked cells beyond the RAM budget spill to
disk, least recently used first. A sweeper closes sessions idle past their TTL and keeps
the disk under its budget. One request at a time runs on a session; a
second one waits its turn. Persistent sessions are saved (delta) when a generation ends,
on graceful shutdown and when created; ephemeral ones keep their checkpoints in RAM only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import sqlite3
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from kvstashd import state as kvstate
from kvstashd.catalog import CheckpointRow
from kvstashd.chat import ChatMessage, ChatTemplate, Message, Segment, after_prefix, text_of
from kvstashd.checkpoints import CheckpointStore, Loaded
from kvstashd.config import Settings
from kvstashd.engine import Chunk, Engine, GenerationRequest, Job, ModelInfo, SeqState
from kvstashd.errors import (
    Busy,
    ContextFull,
    FailedPrecondition,
    InvalidRequest,
    KvstashError,
    NotFound,
)
from kvstashd.manifest import Snapshot
from kvstashd.sampling import MAX_SEED, SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")

_SESSION_ID = re.compile(r"^s_[0-9a-f]{24}$")
_CHECKPOINT_ID = re.compile(r"^c_[0-9a-f]{24}$")
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_LABEL = 256


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
    # KV cells for state.tokens[:parked.n] while not in a slot (warm).
    parked: kvstate.KvCells | None = None
    # A stored checkpoint whose blocks hold this session's cells (cold), read on first use.
    cold: ColdRef | None = None
    head_checkpoint_id: str = ""
    # Changed since its last save (persistent sessions only).
    dirty: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    job: Job | None = None
    closed: bool = False

    @property
    def busy(self) -> bool:
        return self.lock.locked()

    @property
    def residency(self) -> str:
        if self.state.slot is not None:
            return "hot"
        return "warm" if self.parked is not None else "cold"


@dataclass(frozen=True)
class ColdRef:
    store: CheckpointStore
    checkpoint_id: str
    snapshot: Snapshot


@dataclass(frozen=True)
class Stores:
    """durable: persistent sessions and imports (disk); volatile: ephemeral sessions'
    checkpoints (RAM); spill: ephemeral sessions' cells under memory pressure (disk, wiped
    at start)."""

    durable: CheckpointStore
    volatile: CheckpointStore
    spill: CheckpointStore


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
    swap_ins: int
    swap_in_seconds: float


class SessionManager:
    """Owns every session. Built with the started engine, the settings, the checkpoint
    stores and a clock (tests inject one to drive expiry)."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        stores: Stores,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if engine.info is None:
            raise ValueError("the engine must be started before the session manager")
        self.engine = engine
        self.model: ModelInfo = engine.info
        self.settings = settings
        self.stores = stores
        self.durable = stores.durable
        self.volatile = stores.volatile
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self._slots: list[Session | None] = [None] * settings.slots
        self._slot_freed = asyncio.Event()
        self._waiting = 0
        self.tokens_reused = 0
        self.swap_ins = 0
        self.swap_in_seconds = 0.0
        self.template: ChatTemplate | None = None

    async def start(self) -> None:
        """Finish set-up: the template's BOS/EOS text, and persistent sessions from disk."""
        if self.model.chat_template:
            bos, eos = await self._engine(
                lambda e: (
                    e.detokenize([self.model.bos_token], True),
                    e.detokenize([self.model.eos_token], True),
                )
            )
            self.template = ChatTemplate(self.model.chat_template, bos, eos)
        await asyncio.to_thread(self._load_persistent)

    def _load_persistent(self) -> None:
        for session_id, _created, head in self.durable.catalog.sessions():
            if head is None:
                continue
            try:
                snap = self.durable.snapshot(head)
            except KvstashError as e:
                log.error("persistent session %s is not loaded: %s", session_id, e)
                continue
            session = self._from_snapshot(snap, session_id, True)
            session.cold = ColdRef(self.durable, head, snap) if snap.n_kv else None
            session.head_checkpoint_id = head
            self.sessions[session_id] = session
        if self.sessions:
            log.info("loaded %d persistent sessions", len(self.sessions))

    async def shutdown(self) -> None:
        """Save every persistent session that changed since its last save."""
        for session in list(self.sessions.values()):
            if session.persistent and session.dirty and not session.closed:
                async with self._use(session):
                    await self._save_head(session)

    @contextlib.asynccontextmanager
    async def _use(self, session: Session) -> AsyncIterator[None]:
        """Hold a session's lock; on release, wake requests waiting for a slot, since the
        session may now give its slot up."""
        try:
            async with session.lock:
                yield
        finally:
            self._slot_freed.set()

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

    def all(self) -> list[Session]:
        return sorted(self.sessions.values(), key=lambda s: s.created_at)

    def store_of(self, session: Session) -> CheckpointStore:
        return self.durable if session.persistent else self.volatile

    def checkpoint_count(self, session: Session) -> int:
        return self.store_of(session).catalog.count(session.session_id)

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
        session = self._new_session(params, _check_stop(stop), persistent)
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
        if persistent:
            await self._check_disk()
            await self._save_head(session)
        self.sessions[session.session_id] = session
        return session

    def _new_session(self, params: SamplingParams, stop: tuple[str, ...], persistent: bool) -> Session:
        now = self.clock()
        return Session(
            session_id="s_" + secrets.token_hex(12),
            persistent=persistent,
            params=params,
            stop=stop,
            created_at=now,
            last_used_at=now,
        )

    async def close(self, session_id: str) -> None:
        """Stop the session's generation if any, free its slot and state, forget it.

        A persistent session's head and checkpoints go with it; an ephemeral session's
        checkpoints were only ever in RAM and are dropped.
        """
        session = self.get(session_id)
        session.closed = True
        if session.job is not None:
            session.job.cancelled = True
        async with self._use(session):
            await self._release_slot(session, park=False)
            await self._drop_cold(session)
            session.parked = None
            self.sessions.pop(session_id, None)
            store = self.store_of(session)
            # The session's head and every checkpoint of it go in one transaction.
            await asyncio.to_thread(store.catalog.delete_session, session_id)
            if not session.persistent:
                await asyncio.to_thread(self.volatile.sweep, 0)

    async def rewind(self, session_id: str, n_tokens: int) -> Session:
        """Keep the first n_tokens tokens of history; the session continues from there."""
        session = self.get(session_id)
        async with self._use(session):
            state = session.state
            if not 0 <= n_tokens <= len(state.tokens):
                raise InvalidRequest(f"n_tokens must be in [0, {len(state.tokens)}], got {n_tokens}")
            await self._warm(session)
            await self._truncate(session, n_tokens)
            session.messages = [m for m in session.messages if m.start < n_tokens]
            self._touch(session)
            if session.persistent:
                await self._save_head(session)
        return session

    def counters(self) -> Counters:
        sessions = list(self.sessions.values())
        hot = sum(1 for s in sessions if s.residency == "hot")
        warm = sum(1 for s in sessions if s.residency == "warm")
        return Counters(
            sessions=len(sessions),
            hot=hot,
            warm=warm,
            cold=len(sessions) - hot - warm,
            slots_in_use=sum(1 for s in self._slots if s is not None),
            tokens_evaluated=self.engine.stats_evaluated,
            tokens_generated=self.engine.stats_generated,
            tokens_reused=self.tokens_reused,
            swap_ins=self.swap_ins,
            swap_in_seconds=self.swap_in_seconds,
        )

    def _touch(self, session: Session) -> None:
        session.last_used_at = self.clock()
        session.dirty = True

    # ---- checkpoints -------------------------------------------------------------------------

    async def checkpoint(self, session_id: str, label: str) -> CheckpointRow:
        """An immutable, labelled checkpoint of the session as it is now."""
        session = self.get(session_id)
        if len(label) > MAX_LABEL:
            raise InvalidRequest(f"labels have at most {MAX_LABEL} characters")
        async with self._use(session):
            self._check_open(session)
            snap, cells = await self._snapshot(session, label)
            store = self.store_of(session)
            if session.persistent:
                await self._check_disk()
            row, _ = await self._stored(store.save, snap, cells, kind="explicit", now=self.clock())
            return row

    def list_checkpoints(self, session_id: str) -> list[CheckpointRow]:
        session = self.get(session_id)
        return self.store_of(session).catalog.checkpoints(session_id)

    def _find(self, checkpoint_id: str) -> CheckpointStore:
        if not _CHECKPOINT_ID.match(checkpoint_id):
            raise InvalidRequest(f"malformed checkpoint id: {checkpoint_id[:80]!r}")
        for store in (self.durable, self.volatile):
            if store.catalog.get(checkpoint_id) is not None:
                return store
        raise NotFound(f"no checkpoint {checkpoint_id}")

    async def restore(self, session_id: str, checkpoint_id: str) -> tuple[Session, bool]:
        """Roll the session back to a checkpoint. Returns (session, KV re-evaluated)."""
        session = self.get(session_id)
        store = self._find(checkpoint_id)
        async with self._use(session):
            self._check_open(session)
            loaded = await asyncio.to_thread(store.load, checkpoint_id, self.clock())
            await self._release_slot(session, park=False)
            await self._drop_cold(session)
            self._apply(session, loaded.snapshot, loaded.cells)
            self._touch(session)
            if session.persistent:
                await self._save_head(session)
        return session, loaded.reprefill

    async def fork(self, session_id: str, checkpoint_id: str, persistent: bool) -> tuple[Session, bool]:
        """A new session that continues exactly as the source (a session or a checkpoint)."""
        if bool(session_id) == bool(checkpoint_id):
            raise InvalidRequest("fork from a session_id or from a checkpoint_id (one of them)")
        reprefill = False
        if checkpoint_id:
            store = self._find(checkpoint_id)
            loaded: Loaded = await asyncio.to_thread(store.load, checkpoint_id, self.clock())
            snap, cells, reprefill = loaded.snapshot, loaded.cells, loaded.reprefill
        else:
            source = self.get(session_id)
            async with self._use(source):
                self._check_open(source)
                snap, cells = await self._snapshot(source, "")
        child = self._new_session(snap.params, snap.stop, persistent)
        self._apply(child, snap, cells)
        if persistent:
            await self._check_disk()
            await self._save_head(child)
        self.sessions[child.session_id] = child
        return child, reprefill

    async def delete_checkpoint(self, checkpoint_id: str) -> None:
        store = self._find(checkpoint_id)
        for session in self.sessions.values():
            if session.head_checkpoint_id == checkpoint_id:
                raise FailedPrecondition("that checkpoint is a live session's head; close the session")
        await asyncio.to_thread(store.delete, checkpoint_id)

    async def export_checkpoint(self, checkpoint_id: str) -> AsyncGenerator[bytes, None]:
        store = self._find(checkpoint_id)
        chunks = await asyncio.to_thread(lambda: list(store.export(checkpoint_id)))
        for chunk in chunks:
            yield chunk

    async def import_checkpoint(self, chunks: AsyncIterator[bytes]) -> CheckpointRow:
        limit = self.model.n_ctx_seq * (self.model.kv_layout.cell_bytes if self.model.kv_layout else 0)
        limit = 2 * limit + (64 << 20)
        received: list[bytes] = []
        size = 0
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise InvalidRequest(f"the import exceeds {limit} bytes")
            received.append(chunk)
        await self._check_disk()
        return await self._stored(self.durable.import_, received, limit, self.clock())

    def _apply(self, session: Session, snap: Snapshot, cells: kvstate.KvCells | None) -> None:
        """Make a session's state the snapshot's (its slot, if any, is the caller's affair)."""
        state = session.state
        state.tokens = list(snap.tokens)
        state.draws = snap.draws
        state.n_kv = cells.n if cells is not None else 0
        state.logits = snap.logits if cells is not None and cells.n == len(snap.tokens) else None
        session.parked = cells if cells is not None and cells.n else None
        session.params = snap.params
        session.stop = snap.stop
        session.messages = [replace(m) for m in snap.messages]

    def _from_snapshot(self, snap: Snapshot, session_id: str, persistent: bool) -> Session:
        session = Session(
            session_id=session_id,
            persistent=persistent,
            params=snap.params,
            stop=snap.stop,
            created_at=snap.created_at,
            last_used_at=snap.saved_at,
        )
        self._apply(session, snap, None)
        session.state.n_kv = snap.n_kv
        session.state.logits = snap.logits if snap.n_kv == len(snap.tokens) else None
        return session

    async def _snapshot(self, session: Session, label: str) -> tuple[Snapshot, kvstate.KvCells | None]:
        """The session's state now, with its KV cells (exported from its slot if hot)."""
        state = session.state
        cells: kvstate.KvCells | None = None
        if self.model.kv_layout is not None and state.n_kv:
            if state.slot is not None:
                slot, n_kv = state.slot, state.n_kv
                cells = await self._engine(lambda e: e.export_kv(slot, n_kv))
            else:
                await self._warm(session)
                cells = session.parked
        snap = Snapshot(
            session_id=session.session_id,
            persistent=session.persistent,
            created_at=session.created_at,
            tokens=list(state.tokens),
            n_kv=cells.n if cells is not None else 0,
            logits=state.logits if cells is not None and cells.n == len(state.tokens) else None,
            draws=state.draws,
            params=session.params,
            stop=session.stop,
            messages=[replace(m) for m in session.messages],
            fingerprint="",
            kv_layout=None,
            block_tokens=self.settings.block_tokens,
            label=label,
        )
        return snap, cells

    async def _warm(self, session: Session) -> None:
        """Read a cold session's cells from its store into RAM."""
        ref = session.cold
        if ref is None or session.state.slot is not None:
            return
        cells, _ = await asyncio.to_thread(ref.store.cells, ref.snapshot)
        await self._drop_cold(session)
        if cells is None or cells.n != session.state.n_kv:
            session.state.n_kv = 0
            session.state.logits = None
            session.parked = None
        else:
            session.parked = cells
            await self._enforce_ram(keep=session)

    async def _drop_cold(self, session: Session) -> None:
        """Forget where a session's cells were stored; an ephemeral spill is deleted."""
        ref, session.cold = session.cold, None
        if ref is not None and ref.store is self.stores.spill:
            await asyncio.to_thread(ref.store.delete, ref.checkpoint_id)
            await asyncio.to_thread(ref.store.sweep, 0)

    def parked_bytes(self) -> int:
        return sum(s.parked.nbytes for s in self.sessions.values() if s.parked is not None)

    async def _enforce_ram(self, keep: Session | None = None) -> None:
        """Spill parked cells to disk, least recently used first, while over the RAM budget."""
        while self.parked_bytes() > self.settings.ram_cache:
            idle = [
                s for s in self.sessions.values() if s.parked is not None and not s.busy and s is not keep
            ]
            if not idle:
                return
            victim = min(idle, key=lambda s: s.last_used_at)
            async with self._use(victim):
                await self._spill(victim)

    async def _spill(self, session: Session) -> None:
        """Move a session's parked cells to disk: a persistent session's head, or the spill
        area for an ephemeral one."""
        if session.parked is None:
            return
        if session.persistent:
            if session.dirty or not session.head_checkpoint_id:
                await self._save_head(session)
            snap = await asyncio.to_thread(self.durable.snapshot, session.head_checkpoint_id)
            ref = ColdRef(self.durable, session.head_checkpoint_id, snap)
        else:
            snap, cells = await self._snapshot(session, "")
            row, stored = await self._stored(
                self.stores.spill.save, snap, cells, kind="spill", now=self.clock()
            )
            ref = ColdRef(self.stores.spill, row.checkpoint_id, stored)
        session.parked = None
        session.cold = ref if ref.snapshot.n_kv == session.state.n_kv else None
        if session.cold is None:
            session.state.n_kv = 0

    async def _save_head(self, session: Session) -> None:
        """Autosave a persistent session: its new head manifest, writing only new blocks."""
        snap, cells = await self._snapshot(session, "")
        row, _ = await self._stored(
            self.durable.save, snap, cells, kind="head", now=self.clock(), head_of=session.session_id
        )
        session.head_checkpoint_id = row.checkpoint_id
        session.dirty = False

    async def _stored(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a store write in a worker thread; a failing disk is RESOURCE_EXHAUSTED."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except (OSError, sqlite3.Error) as e:
            log.error("the state store failed: %s", e)
            raise Busy("the state store is failing (disk full?); nothing was saved") from None

    # ---- budgets and expiry ------------------------------------------------------------------

    async def _check_disk(self) -> None:
        """Refuse new persistent state when the disk budget cannot be kept."""
        budget = self.settings.disk_budget
        if self.durable.store.total_bytes() <= budget:
            return
        await asyncio.to_thread(self.durable.sweep, budget)
        if self.durable.store.total_bytes() > budget:
            raise Busy(
                f"the state store holds {self.durable.store.total_bytes()} bytes, over its budget "
                f"of {budget}: delete checkpoints or close persistent sessions"
            )

    async def sweep(self) -> None:
        """One pass of the sweeper: expire idle sessions, keep RAM and disk within budget."""
        now = self.clock()
        idle_ttl, persistent_ttl = self.settings.idle_ttl, self.settings.persistent_ttl
        for session in list(self.sessions.values()):
            if session.busy or session.closed:
                continue
            ttl = persistent_ttl if session.persistent else idle_ttl
            if ttl > 0 and now - session.last_used_at > ttl:
                log.info(
                    "session %s expired after %.0f s idle", session.session_id, now - session.last_used_at
                )
                await self.close(session.session_id)
        await self._enforce_ram()
        await asyncio.to_thread(self.durable.sweep, self.settings.disk_budget)

    async def run_sweeper(self) -> None:
        """Sweep every `sweep_interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.settings.sweep_interval)
            try:
                await self.sweep()
            except Exception:
                log.exception("the sweeper failed; it will try again")

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
    ) -> AsyncGenerator[Chunk, None]:
        """Extend the session by a prompt (text or token ids) and stream the continuation."""
        session = self.get(session_id)
        if prompt and prompt_token_ids:
            raise InvalidRequest("give the prompt as text or as token ids, not both")
        n_vocab = self.model.n_vocab
        bad = next((t for t in prompt_token_ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {n_vocab})")
        request = self._request(max_tokens, sampling, session, stop, logprobs)
        async with self._use(session):
            self._check_open(session)
            if prompt:
                tokens = await self._tokenize(
                    prompt, first=not session.state.tokens, parse_special=parse_special
                )
            else:
                tokens = list(prompt_token_ids)
            request = replace(request, prompt=tuple(tokens))
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
    ) -> AsyncGenerator[Chunk, None]:
        """Add a user message through the chat template and stream the assistant's reply."""
        session = self.get(session_id)
        if self.template is None:
            raise FailedPrecondition("the model has no chat template; use Generate")
        if not message:
            raise InvalidRequest("the message is empty")
        request = self._request(max_tokens, sampling, session, stop, logprobs)
        async with self._use(session):
            self._check_open(session)
            state = session.state
            user = ChatMessage("user", message, len(state.tokens))
            conversation = [Message(m.role, m.content) for m in session.messages]
            conversation.append(Message("user", message))
            segments = self.template.render(conversation, add_generation_prompt=True)
            history = list(state.tokens)
            history_text = await self._engine(lambda e: e.detokenize(history, True))
            delta = after_prefix(segments, history_text)
            if delta is not None:
                tokens = await self._tokenize_segments(delta, first=not state.tokens)
            else:
                # The history is not a prefix of the rendered conversation (raw generation or
                # a stop string left text the template does not have): keep what matches.
                full = await self._tokenize_segments(segments, first=True)
                keep = _common_prefix(full, state.tokens)
                await self._truncate(session, keep)
                tokens = full[keep:]
                user.start = keep
            request = replace(request, prompt=tuple(tokens))
            self._check_fits(session, request)
            reply = ChatMessage("assistant", "", len(state.tokens) + len(tokens))
            session.messages += [user, reply]
            started = False
            try:
                async for chunk in self._run(session, request, reply):
                    started = True
                    yield chunk
            finally:
                if not started:  # nothing was added to the history: neither were messages
                    del session.messages[-2:]

    async def _truncate(self, session: Session, n_tokens: int) -> None:
        state = session.state
        if state.slot is None and session.parked is not None and n_tokens < session.parked.n:
            session.parked = kvstate.head(session.parked, n_tokens) if n_tokens else None
            state.n_kv = n_tokens
            state.logits = None
        await self._engine(lambda e: e.truncate(state, n_tokens))

    def _request(
        self,
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
            prompt=(),
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

    async def _run(
        self, session: Session, request: GenerationRequest, reply: ChatMessage | None = None
    ) -> AsyncGenerator[Chunk, None]:
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
        self._touch(session)
        self.engine.submit(job)
        try:
            while True:
                item = await items.get()
                # Chunks that queued up while the client was being served go out as one.
                while isinstance(item, Chunk) and item.finish_reason is None and not items.empty():
                    following = items.get_nowait()
                    if not isinstance(following, Chunk):
                        raise following
                    item = _merge(item, following)
                if isinstance(item, BaseException):
                    raise item
                if reply is not None:
                    reply.content += item.text
                if item.finish_reason is not None:
                    self.tokens_reused += item.usage.reused_tokens if item.usage else 0
                    session.job = None
                    if session.persistent:
                        # Saved before the last chunk goes out: a client that saw the end of
                        # a generation can rely on it surviving a crash.
                        await self._save_head(session)
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
        """Give the session a slot (a free one, or the least recently used idle one's) and
        load its parked or stored cells into it."""
        if session.state.slot is not None:
            return
        if self._waiting >= self.settings.max_queue:
            raise Busy("too many requests are waiting for a slot; try again later")
        self._waiting += 1
        try:
            while (slot := self._free_slot()) is None:
                victim = self._eviction_victim()
                if victim is not None:
                    # Under the victim's lock, so a request for it waits until it is parked.
                    async with self._use(victim):
                        await self._release_slot(victim, park=True)
                    await self._enforce_ram(keep=session)
                    continue
                self._slot_freed.clear()
                await self._slot_freed.wait()
        finally:
            self._waiting -= 1
        self._slots[slot] = session  # reserved while its cells are read
        await self._warm(session)
        state = session.state
        state.slot = slot
        cells = session.parked
        if cells is None:
            if state.n_kv:  # cells were lost (a stored KV that no longer fits): recompute
                state.n_kv = 0
                state.logits = None
            return
        started = time.perf_counter()
        session.parked = None
        await self._engine(lambda e: e.import_kv(state, cells))
        self.swap_ins += 1
        self.swap_in_seconds += time.perf_counter() - started

    def _free_slot(self) -> int | None:
        return next((i for i, s in enumerate(self._slots) if s is None), None)

    def _eviction_victim(self) -> Session | None:
        idle = [s for s in self._slots if s is not None and not s.busy]
        return min(idle, key=lambda s: s.last_used_at) if idle else None

    async def _release_slot(self, session: Session, *, park: bool) -> None:
        """Take a session out of its slot; with park, its cells move to RAM first."""
        state = session.state
        slot = state.slot
        if slot is None:
            return
        # NOTE: the bookkeeping changes before the engine clears the slot. That is safe
        # because the engine runs its inbox in order: whatever a new owner of the slot
        # queues after this point runs after the export and the clear.
        n_kv = state.n_kv
        keep = park and n_kv > 0 and self.model.kv_layout is not None
        state.slot = None
        self._slots[slot] = None
        self._slot_freed.set()

        def out(e: Engine) -> kvstate.KvCells | None:
            try:
                return e.export_kv(slot, n_kv) if keep else None
            finally:
                e.clear_slot(slot)

        cells = await self._engine(out)
        session.parked = cells
        if cells is None:
            state.n_kv = 0

    # ---- tokens ------------------------------------------------------------------------------

    async def _tokenize(self, text: str, *, first: bool, parse_special: bool) -> list[int]:
        add = first and self.model.add_bos
        return await self._engine(lambda e: e.tokenize(text, add_special=add, parse_special=parse_special))

    async def _tokenize_segments(self, segments: Sequence[Segment], *, first: bool) -> list[int]:
        """Template text with control tokens parsed; message content never."""
        bos = self.model.bos_token

        def run(e: Engine) -> list[int]:
            bos_text = e.detokenize([bos], True)
            add_bos = first and self.model.add_bos and not text_of(segments).startswith(bos_text)
            out: list[int] = [bos] if add_bos else []
            for seg in segments:
                out += e.tokenize(seg.text, add_special=False, parse_special=not seg.content)
            return out

        return await self._engine(run)


def _merge(a: Chunk, b: Chunk) -> Chunk:
    """One chunk for two consecutive ones; the later one's end and usage are kept."""
    return Chunk(
        text=a.text + b.text,
        token_ids=a.token_ids + b.token_ids,
        logprobs=a.logprobs + b.logprobs,
        finish_reason=b.finish_reason,
        usage=b.usage,
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
