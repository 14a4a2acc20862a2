"""Engine: the one thread that owns llama.cpp (through a LlamaContext).

Callers put work on its inbox (`call` for commands, `submit` for generations) and get
results back through futures; the asyncio side never blocks on llama.cpp. Commands run
between steps, in the order they were queued, and each runs to its end: moving a session's
state into or out of a slot is one command (`load`, `unload`), so a slot is never left
half-moved whatever happens to the request that asked for it.

Each step builds one batch holding the pending tokens of every active generation (prompt
chunks, or the last sampled token), decodes once, and samples per session.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvkeepd.engine import backend, startup, steps
from kvkeepd.engine.context import BatchItem, LlamaContext, ModelInfo
from kvkeepd.engine.context_config import ContextConfig
from kvkeepd.engine.job import Job, Outbox, SeqState
from kvkeepd.engine.streams import StreamPlan
from kvkeepd.errors import ContextFull, CorruptCheckpoint, InvalidRequest, KvkeepError, Unavailable
from kvkeepd.state import cells as kvstate
from kvkeepd.state import layout as kvlayout
from kvkeepd.state import pieces
from kvkeepd.values.sampling import Logits

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Call:
    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[Engine], Any], future: concurrent.futures.Future[Any]) -> None:
        self.fn = fn
        self.future = future


_STOP = object()


class Engine:
    """Owns llama.cpp. `start()` loads the model on the engine thread; `stop()` frees it."""

    def __init__(self, config: ContextConfig) -> None:
        self.config = config
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lifecycle = threading.Lock()
        self._active: list[Job] = []
        # Where jobs' emit callbacks post their output (see Outbox): flushed before each
        # decode and at the end of every turn of the loop.
        self.outbox = Outbox()
        self._ctx: LlamaContext | None = None
        self._stopping = False
        # Set by stop(): a start still loading the model or probing gives up (see Halt).
        self._halt = backend.Halt()
        self.info: ModelInfo | None = None
        self.layout: kvlayout.StateLayout | None = None
        self.stats_evaluated = 0
        self.stats_generated = 0
        # How many prompt tokens a step shared with other work takes (timed on this thread).
        self._pace = steps.Pace(config.step_target, config.prefill_chunk)
        # Calls that read the vocabulary from other threads (tokenize, detokenize): the
        # context is not freed while one runs.
        self._readers = 0
        self._readers_done = threading.Condition()
        # Where states are assembled for llama.cpp, which copies them in at once (pinned
        # memory where there is a GPU); made once the devices are known.
        self._scratch = backend.Scratch(gpu=False)
        # What the context was given: its devices (memory measured once it was made) and
        # its KV streams.
        self.devices: list[backend.Device] = []
        self.streams = StreamPlan(config.slots)

    @property
    def pinned(self) -> bool:
        """Whether host states are assembled in pinned memory (a GPU build, with a layout)."""
        return self._scratch.pinned

    @property
    def ctx(self) -> LlamaContext:
        assert self._ctx is not None, "the engine is not running"
        return self._ctx

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> ModelInfo:
        """Start the engine thread and load the model there. Raises if loading fails."""
        ready: concurrent.futures.Future[ModelInfo] = concurrent.futures.Future()
        # NOTE: a start interrupted (Ctrl-C while the model loads) calls stop from another
        # thread: it finds the engine thread started, or not there at all.
        with self._lifecycle:
            thread = threading.Thread(target=self._main, args=(ready,), name="kvkeep-engine", daemon=True)
            thread.start()
            self._thread = thread
        self.info = ready.result()
        self.layout = self.info.layout
        return self.info

    def stop(self) -> None:
        """Finish: cancel generations, free the context and model, join the thread."""
        with self._lifecycle:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        self._halt.set()
        self._inbox.put(_STOP)
        thread.join()

    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the engine thread between steps."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._thread is None or self._stopping:
            future.set_exception(Unavailable("the engine is not running"))
            return future
        self._inbox.put(_Call(fn, future))
        return future

    def read_vocab(self, fn: Callable[[LlamaContext], T]) -> T:
        """Run `fn(ctx)` on the calling thread: for tokenizing and detokenizing only, which
        read the vocabulary, immutable once loaded, and so run beside decoding (as
        llama-server's request threads do). A long prompt never delays other sessions' steps."""
        with self._readers_done:
            if self._ctx is None or self._stopping:
                raise Unavailable("the engine is not running")
            self._readers += 1
        try:
            return fn(self._ctx)
        finally:
            with self._readers_done:
                self._readers -= 1
                self._readers_done.notify_all()

    def submit(self, job: Job) -> None:
        """Queue a generation; its chunks and final result go to `job.emit`."""
        if self._thread is None or self._stopping:
            raise Unavailable("the engine is not running")
        self._inbox.put(job)

    # ---- thread main -----------------------------------------------------------------------

    def _main(self, ready: concurrent.futures.Future[ModelInfo]) -> None:
        try:
            self._ctx, info, self._scratch = startup.open_context(self.config, self._halt)
        except BaseException as e:  # report to start(), which re-raises
            stopped = Unavailable("the engine was stopped while it started")
            ready.set_exception(stopped if self._halt.is_set() else e)
            return
        self.devices, self.streams = self._ctx.devices, self._ctx.streams
        ready.set_result(info)
        try:
            self._loop()
        finally:
            with self._readers_done:
                self._stopping = True
                self._readers_done.wait_for(lambda: self._readers == 0)
                ctx, self._ctx = self._ctx, None
            assert ctx is not None
            ctx.close()
            self._scratch.free()

    def _loop(self) -> None:
        while True:
            items: list[object] = []
            if not self._active:
                items.append(self._inbox.get())
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is _STOP:
                    self._shut_down()
                    return
                if isinstance(item, Job):
                    self._start_job(item)
                elif isinstance(item, _Call):
                    self._run_call(item)
            if self._active:
                try:
                    self._step()
                except Exception:
                    # The engine thread must outlive any bug in a step: fail the step's
                    # generations (their slots are cleared; their histories are whole).
                    log.exception("an engine step failed")
                    for job in list(self._active):
                        self._fail(job, KvkeepError("the engine failed to run this generation"))
            self.outbox.flush()

    def _shut_down(self) -> None:
        self._stopping = True
        for job in self._active:
            job.finish("cancelled")
        self._active.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                self.outbox.flush()
                return
            if isinstance(item, _Call):
                item.future.set_exception(Unavailable("the daemon is shutting down"))
            elif isinstance(item, Job):
                item.emit(Unavailable("the daemon is shutting down"))

    def _run_call(self, call: _Call) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        try:
            call.future.set_result(call.fn(self))
        except BaseException as e:
            call.future.set_exception(e)

    # ---- sequence commands (engine thread only; through call()) ------------------------------

    def load(self, slot: int, state: SeqState, kv: kvstate.SeqKv | None) -> None:
        """Make the slot hold `kv` (the state after tokens[:kv.n]), or nothing.

        On failure the slot is empty and `state` says so; CorruptCheckpoint is raised.
        """
        ctx = self.ctx
        ctx.clear(slot)
        n = kv.n if kv is not None else 0
        if n != state.n_kv:
            state.logits = None
        state.n_kv = 0
        state.window_from = 0
        if kv is None or not n:
            return
        if kv.layout != self.layout:
            raise KvkeepError("internal: KV of another layout")
        into = None
        if kv.raw is None:
            into = self._scratch.take(pieces.blob_size(kv))
        if not ctx.set_state(slot, pieces.assemble(kv, into=into)):
            ctx.clear(slot)
            state.logits = None
            raise CorruptCheckpoint("llama.cpp did not take the session's state")
        state.n_kv = n
        state.window_from = kv.window_from

    def move(self, src: int, dst: int) -> None:
        """Move a session's cells from one stream to an empty one (a slot to a dock or back,
        streams.py): cells in place, its SeqState still true. On failure both are emptied."""
        try:
            self.ctx.move(src, dst)
        except BaseException:
            self.ctx.clear(src)
            self.ctx.clear(dst)
            raise

    def unload(self, slot: int, state: SeqState, keep: bool) -> kvstate.SeqKv | None:
        """Empty the slot; with keep, return its state first (None if it cannot be kept)."""
        kv: kvstate.SeqKv | None = None
        try:
            if keep and state.n_kv and self.layout is not None:
                kv = self.export(slot, state)
        except KvkeepError:
            log.exception("a slot's state could not be exported; its history stays")
        finally:
            self.ctx.clear(slot)
        if kv is None:
            state.n_kv = 0
            state.logits = None
            state.window_from = 0
        return kv

    def export(self, slot: int, state: SeqState, *, rounded: bool = False) -> kvstate.SeqKv:
        """The slot's state, parsed and checked to cover exactly tokens[:n_kv] (rounded: see
        heap.state_buffer)."""
        if self.layout is None:
            raise KvkeepError("internal: this model's state cannot be exported")
        kv = kvstate.parse(self.ctx.state_bytes(slot, rounded=rounded), self.layout)
        if kv.n != state.n_kv:
            raise KvkeepError(f"internal: the slot holds {kv.n} positions, expected {state.n_kv}")
        return kv

    def truncate(
        self, slot: int, state: SeqState, n_tokens: int, snapshots: Sequence[kvstate.RecurrentCells]
    ) -> None:
        """Keep the first n_tokens of history and a state to match: the slot keeps at most
        n_tokens - 1 positions (the last kept token is evaluated again for its logits),
        fewer where the memory cannot be cut there (see state.rewind)."""
        del state.tokens[n_tokens:]
        if state.n_kv < n_tokens or (state.n_kv == n_tokens and state.logits is not None):
            return
        target = max(n_tokens - 1, 0)
        layout = self.layout
        state.logits = None
        if layout is None or (layout.recurrent is None and pieces.can_cut(layout, state.window_from, target)):
            self.ctx.remove_from(slot, target)
            state.n_kv = target
            return
        kv = pieces.rewind(self.export(slot, state), target, snapshots)
        self.load(slot, state, kv)

    def cut(self, slot: int, state: SeqState, n: int) -> None:
        """Keep the slot's first n positions (the caller checked that the memory can be cut
        there exactly: no recurrent state, a window that holds what n needs)."""
        if not self.ctx.remove_from(slot, n):
            self.ctx.clear(slot)
            state.n_kv = 0
            state.logits = None
            raise KvkeepError("internal: the slot's memory could not be cut")
        state.n_kv = n

    def check(self, slots: Sequence[int | None], deep: bool = True) -> list[str]:
        """Problems with the slots, given per slot its owner's n_kv or None when free. A free
        slot must be empty; an owned one must hold exactly positions [0, n_kv) (and its state
        parse and check, when this model's layout is known and `deep`)."""
        problems = []
        for slot, owner in enumerate(slots):
            lo, hi = self.ctx.positions(slot)
            n_kv = owner or 0
            if not n_kv:
                if (lo, hi) != (-1, -1):
                    problems.append(f"slot {slot} should be empty but holds positions [{lo}, {hi}]")
                continue
            if hi != n_kv - 1:
                problems.append(f"slot {slot} holds positions up to {hi}, its owner {n_kv}")
            if deep and self.layout is not None:
                try:
                    kv = kvstate.parse(self.ctx.state_bytes(slot), self.layout)
                except kvlayout.StateFormatError as e:
                    problems.append(f"slot {slot}: {e}")
                    continue
                if kv.n != n_kv:
                    problems.append(f"slot {slot} holds {kv.n} positions, its owner {n_kv}")
        return problems

    # ---- generation --------------------------------------------------------------------------

    def _start_job(self, job: Job) -> None:
        state = job.state
        try:
            limit = self.config.ctx_per_session
            if len(state.tokens) + len(job.request.prompt) >= limit:
                raise ContextFull(f"the session's context of {limit} tokens is full")
            if not job.request.prompt and state.pending == 0 and state.logits is None:
                if not state.n_kv:
                    raise InvalidRequest("the session has nothing to continue from: give a prompt")
                # The last logits row was not kept: evaluate the last token again to get it.
                self.truncate(job.slot, state, len(state.tokens), ())
            state.tokens.extend(job.request.prompt)
        except BaseException as e:
            job.emit(e)
            return
        prefix = job.prefix
        if prefix is not None and state.n_kv < prefix.n < len(state.tokens):
            try:
                self.load(job.slot, state, prefix)
            except KvkeepError as e:  # the slot is empty now: the history is evaluated
                log.warning("a cached prefix was not taken: %s", e)
        job.begin()
        self._active.append(job)

    def _step(self) -> None:
        for job in [j for j in self._active if j.cancelled]:
            self._active.remove(job)
            job.finish("cancelled")
        ctx = self.ctx
        for job in [j for j in self._active if j.state.pending == 0]:
            assert job.state.logits is not None
            self._sample(job, job.state.logits)
        jobs = list(self._active)
        cfg = self.config
        counts = steps.plan([j.state.pending for j in jobs], cfg.batch_size, self._pace.chunk())
        items: list[BatchItem] = []
        taken: list[tuple[Job, int, bool]] = []  # job, tokens taken, wants logits
        for job, count in zip(jobs, counts, strict=True):
            if not count:
                continue
            state = job.state
            if state.n_kv < job.boundary_at < state.n_kv + count:
                count = job.boundary_at - state.n_kv  # the chunk ends where a snapshot is due
            last = state.n_kv + count == len(state.tokens)
            for k in range(count):
                pos = state.n_kv + k
                items.append(BatchItem(job.slot, state.tokens[pos], pos, last and k == count - 1))
            taken.append((job, count, last))
        if not items:
            return
        # What was sampled from stored logits goes out now, not after this decode.
        self.outbox.flush()
        started = time.perf_counter()
        try:
            rows = ctx.decode(items)
        except KvkeepError as e:
            log.error("%s", e)
            for job, _, _ in taken:
                self._fail(job, KvkeepError("the engine failed to evaluate the batch"))
            return
        if max(counts) >= steps.MIN_CHUNK:  # a prompt's chunk: what the pace sizes
            self._pace.took(len(items), time.perf_counter() - started)
        self.stats_evaluated += len(items)
        rows_iter = iter(rows)
        for job, count, last in taken:
            state = job.state
            state.n_kv += count
            job.evaluated += count
            job.report()
            if state.n_kv == job.boundary_at and job.boundary is None:
                job.boundary = (state.n_kv, self._partial(job))
            if not last:
                state.logits = None
                continue
            state.logits = next(rows_iter)
            if job.snapshot is None and not job.generated and self.layout and self.layout.recurrent:
                # The end of the prompt: where a turn can later be taken back to.
                partial = self._partial(job)
                job.snapshot = next(s for s in partial if isinstance(s, kvstate.RecurrentCells))
            self._sample(job, state.logits)

    def _partial(self, job: Job) -> tuple[kvstate.Section, ...]:
        """The sliding-window and recurrent sections of a job's slot, as they are now."""
        assert self.layout is not None
        blob = self.ctx.state_bytes(job.slot, partial=True)
        return kvstate.parse_partial(blob, self.layout, job.state.n_kv)

    def _sample(self, job: Job, row: Logits) -> None:
        self.stats_generated += 1
        if job.sample(row, self.ctx, self.config.ctx_per_session):
            self._active.remove(job)

    def _fail(self, job: Job, error: BaseException) -> None:
        """End a job with an error. Its slot is emptied (what a failed step wrote is not
        known); its history stays, so the session evaluates it again when next used."""
        if job in self._active:
            self._active.remove(job)
        state = job.state
        self.ctx.clear(job.slot)
        state.n_kv = 0
        state.logits = None
        state.window_from = 0
        job.emit(error)
