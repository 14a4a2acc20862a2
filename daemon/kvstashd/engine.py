"""Engine: the one thread that owns llama.cpp's model and context.

Every llama.cpp call of the daemon happens on this thread. Callers put work on its inbox
(`call` for short operations, `submit` for generations) and get results back through
futures; the asyncio side never blocks on llama.cpp.

Each resident session owns one sequence id (a *slot*). The context runs with one KV
stream per slot (`kv_unified=false`) and flash attention off: the "exact" mode, in which a
session's logits do not depend on what else shares the batch, on prefill chunking, or on
which slot holds it. Every step builds one batch holding the pending tokens of every active
generation (prompt chunks, or the last sampled token), decodes once, and samples per session.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import llama_cpp as llama
import numpy as np

from kvstashd import state as kvstate
from kvstashd.errors import (
    ContextFull,
    CorruptCheckpoint,
    InvalidRequest,
    KvstashError,
    Unavailable,
)
from kvstashd.sampling import Logits, SamplingParams, sample, top_logprobs
from kvstashd.text import StopMatcher, Utf8Stream

log = logging.getLogger(__name__)
llama_log = logging.getLogger("kvstashd.llama_cpp")

T = TypeVar("T")

KV_TYPE_IDS = {
    "f16": llama.GGML_TYPE_F16,
    "q8_0": llama.GGML_TYPE_Q8_0,
    "q4_0": llama.GGML_TYPE_Q4_0,
}
# While other sessions are decoding, a prefill chunk this small keeps their streams moving
# (a 512-token chunk stalls them about a second on two cores).
BUSY_PREFILL_CHUNK = 64


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs from the daemon's settings."""

    model_path: Path
    slots: int
    ctx_per_session: int
    batch_size: int
    threads: int
    gpu_layers: int
    kv_type: str
    kv_unified: bool


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model and context."""

    description: str
    n_vocab: int
    n_ctx_train: int
    n_ctx_seq: int
    n_layer: int
    chat_template: str | None
    bos_token: int
    eos_token: int
    add_bos: bool
    # None when this model's sequence state is not one state.py can parse: sessions then
    # checkpoint their token history only and restore by evaluating it again.
    kv_layout: kvstate.KvLayout | None
    # Logits do not depend on how a session's tokens were batched (see _probe_exact).
    exact: bool


@dataclass
class SeqState:
    """A session's computed state as the engine sees it.

    Invariant: the slot's KV cells hold exactly `tokens[:n_kv]` at positions 0..n_kv-1, and
    `logits` (when set) is the row the model gave after `tokens[:n_kv]`. Tokens past n_kv are
    pending: the last sampled token, or prompt tokens not yet evaluated.
    """

    tokens: list[int] = field(default_factory=list)
    n_kv: int = 0
    logits: Logits | None = None
    draws: int = 0
    slot: int | None = None

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.n_kv


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_tokens: int = 0
    evaluated_tokens: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class GeneratedToken:
    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Chunk:
    """One piece of a streamed generation; the last carries finish_reason and usage."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[GeneratedToken, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request to extend a session by `prompt` and generate."""

    prompt: tuple[int, ...]
    max_tokens: int | None
    params: SamplingParams
    stop: tuple[str, ...]
    logprobs: int = 0


class Job:
    """One generation in flight. Created on the asyncio side, run by the engine thread."""

    def __init__(
        self,
        state: SeqState,
        request: GenerationRequest,
        emit: Callable[[Chunk | BaseException], None],
    ) -> None:
        self.state = state
        self.request = request
        self.emit = emit
        # Set from the asyncio thread; read by the engine at the start of every step.
        self.cancelled = False
        self.generated: list[int] = []
        self.text = ""
        self.raw_text = ""
        self._utf8 = Utf8Stream()
        self._raw_utf8 = Utf8Stream()
        self._stop = StopMatcher(request.stop)
        self._reused = 0
        self._evaluated = 0
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[GeneratedToken] = []

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=len(self.request.prompt),
            generated_tokens=len(self.generated),
            reused_tokens=self._reused,
            evaluated_tokens=self._evaluated,
        )


class _Call:
    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[Engine], Any], future: concurrent.futures.Future[Any]) -> None:
        self.fn = fn
        self.future = future


_STOP = object()


class Engine:
    """Owns llama.cpp. `start()` loads the model on the engine thread; `stop()` frees it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._active: list[Job] = []
        self._model: Any = None
        self._ctx: Any = None
        self._vocab: Any = None
        self._mem: Any = None
        self._batch: Any = None
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._stopping = False
        self.info: ModelInfo | None = None
        self.stats_evaluated = 0
        self.stats_generated = 0

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> ModelInfo:
        """Start the engine thread and load the model there. Raises if loading fails."""
        ready: concurrent.futures.Future[ModelInfo] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(ready,), name="kvstash-engine", daemon=True)
        self._thread.start()
        self.info = ready.result()
        return self.info

    def stop(self) -> None:
        """Finish: cancel generations, free the context and model, join the thread."""
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        self._thread.join()
        self._thread = None

    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the engine thread between steps."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._thread is None or self._stopping:
            future.set_exception(Unavailable("the engine is not running"))
            return future
        self._inbox.put(_Call(fn, future))
        return future

    def submit(self, job: Job) -> None:
        """Queue a generation; its chunks and final result go to `job.emit`."""
        if self._thread is None or self._stopping:
            raise Unavailable("the engine is not running")
        self._inbox.put(job)

    @property
    def active_jobs(self) -> int:
        return len(self._active)

    # ---- thread main -----------------------------------------------------------------------

    def _main(self, ready: concurrent.futures.Future[ModelInfo]) -> None:
        try:
            info = self._load()
        except BaseException as e:  # report to start(), which re-raises
            ready.set_exception(e)
            return
        ready.set_result(info)
        try:
            self._loop()
        finally:
            self._unload()

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
                    self._stopping = True
                    for job in self._active:
                        self._finish(job, "cancelled")
                    self._active.clear()
                    self._drain_after_stop()
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
                    # generations (their sessions keep a consistent history) and go on.
                    log.exception("an engine step failed")
                    for job in list(self._active):
                        self._fail(job, KvstashError("the engine failed to run this generation"))

    def _drain_after_stop(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
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

    # ---- model and context -----------------------------------------------------------------

    def _load(self) -> ModelInfo:
        cfg = self.config
        route_llama_log()
        llama.llama_backend_init()
        mparams = llama.llama_model_default_params()
        mparams.n_gpu_layers = 2**31 - 1 if cfg.gpu_layers < 0 else cfg.gpu_layers
        model = llama.llama_model_load_from_file(str(cfg.model_path).encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load the model {cfg.model_path}")
        self._model = model
        cparams = llama.llama_context_default_params()
        cparams.n_ctx = cfg.slots * cfg.ctx_per_session
        cparams.n_batch = cfg.batch_size
        cparams.n_ubatch = cfg.batch_size
        cparams.n_seq_max = cfg.slots
        cparams.n_threads = cfg.threads
        cparams.n_threads_batch = cfg.threads
        cparams.kv_unified = cfg.kv_unified
        quantized = cfg.kv_type != "f16"
        # Flash attention changes logits with batch neighbours; quantized K/V requires it.
        cparams.flash_attn_type = (
            llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if quantized else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.type_k = KV_TYPE_IDS[cfg.kv_type]
        cparams.type_v = KV_TYPE_IDS[cfg.kv_type]
        cparams.no_perf = True
        ctx = llama.llama_init_from_model(model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self._ctx = ctx
        self._vocab = llama.llama_model_get_vocab(model)
        self._mem = llama.llama_get_memory(ctx)
        self._batch = llama.llama_batch_init(cfg.batch_size, 0, 1)
        n_ctx_seq = int(llama.llama_n_ctx_seq(ctx))
        if n_ctx_seq < cfg.ctx_per_session:
            raise RuntimeError(f"llama.cpp gave {n_ctx_seq} cells per session, not {cfg.ctx_per_session}")
        template = llama.llama_model_chat_template(model, None)
        desc = ctypes.create_string_buffer(256)
        llama.llama_model_desc(model, desc, 256)
        n_layer = int(llama.llama_model_n_layer(model))
        return ModelInfo(
            description=desc.value.decode("utf-8", "replace"),
            n_vocab=int(llama.llama_vocab_n_tokens(self._vocab)),
            n_ctx_train=int(llama.llama_model_n_ctx_train(model)),
            n_ctx_seq=cfg.ctx_per_session,
            n_layer=n_layer,
            chat_template=template.decode("utf-8") if template else None,
            bos_token=int(llama.llama_vocab_bos(self._vocab)),
            eos_token=int(llama.llama_vocab_eos(self._vocab)),
            add_bos=bool(llama.llama_vocab_get_add_bos(self._vocab)),
            kv_layout=self._probe_layout(),
            exact=self._probe_exact(),
        )

    def _decode_probe(self, tokens: Sequence[int], start: int, want_last: bool) -> Logits | None:
        """Decode tokens at positions start.. in slot 0; the last row if asked (probes only)."""
        batch = self._batch
        for k, token in enumerate(tokens):
            batch.token[k] = token
            batch.pos[k] = start + k
            batch.n_seq_id[k] = 1
            batch.seq_id[k][0] = 0
            batch.logits[k] = 0
        batch.logits[len(tokens) - 1] = int(want_last)
        batch.n_tokens = len(tokens)
        if llama.llama_decode(self._ctx, batch) != 0:
            raise RuntimeError("llama_decode failed while probing the engine")
        if not want_last:
            return None
        n_vocab = int(llama.llama_vocab_n_tokens(self._vocab))
        ptr = llama.llama_get_logits_ith(self._ctx, len(tokens) - 1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()

    def _probe_layout(self) -> kvstate.KvLayout | None:
        """Learn the KV layout from a real one-token state of slot 0, then clear it."""
        try:
            self._decode_probe([int(llama.llama_vocab_bos(self._vocab))], 0, False)
            return kvstate.parse(self._state_bytes(0)).layout
        except kvstate.StateFormatError as e:
            log.warning("KV checkpoints are off for this model: %s", e)
            return None
        finally:
            self.clear_slot(0)

    def _probe_exact(self) -> bool:
        """Whether a token evaluated alone gets the same logits as inside a prompt chunk.

        Sampling, resumes and restores by re-evaluation are bit-exact only then. It fails
        with llama.cpp's tinyBLAS (GGML_LLAMAFILE) kernels, which serve products of 2+
        columns only, and in the compact modes.
        """
        n_vocab = int(llama.llama_vocab_n_tokens(self._vocab))
        tokens = [int(t) for t in np.random.default_rng(0).integers(0, n_vocab, 45)]
        try:
            # Several lengths: tiled kernels differ from one another only at some sizes.
            for n in (37, 41, 45):
                chunk = self._decode_probe(tokens[:n], 0, True)
                self.clear_slot(0)
                self._decode_probe(tokens[: n - 1], 0, False)
                alone = self._decode_probe(tokens[n - 1 : n], n - 1, True)
                self.clear_slot(0)
                if chunk is None or alone is None or not np.array_equal(chunk, alone):
                    return False
        finally:
            self.clear_slot(0)
        return True

    def _unload(self) -> None:
        if self._batch is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            llama.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            llama.llama_model_free(self._model)
            self._model = None

    # ---- operations for call() (engine thread only) ------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        if not data:
            return []
        cap = len(data) + 8
        buf = (llama.llama_token * cap)()
        n = llama.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama.llama_token * cap)()
            n = llama.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise InvalidRequest("the prompt could not be tokenized")
        return list(buf[:n])

    def piece(self, token: int, special: bool) -> bytes:
        key = (token, special)
        cached = self._pieces.get(key)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = llama.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
            cached = buf.raw[: max(n, 0)]
            self._pieces[key] = cached
        return cached

    def detokenize(self, tokens: Sequence[int], special: bool) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama.llama_vocab_is_eog(self._vocab, token))

    def clear_slot(self, slot: int) -> None:
        """Forget every KV cell of a slot."""
        llama.llama_memory_seq_rm(self._mem, slot, -1, -1)

    def truncate(self, state: SeqState, n_tokens: int) -> None:
        """Keep the first n_tokens tokens of a session's history, and its KV to match."""
        if n_tokens < state.n_kv:
            if state.slot is not None:
                # Removing a suffix of one sequence inside its own stream is safe; only
                # partial copies between streams are not.
                llama.llama_memory_seq_rm(self._mem, state.slot, n_tokens, -1)
            state.n_kv = n_tokens
            state.logits = None
        del state.tokens[n_tokens:]

    def _state_bytes(self, slot: int) -> memoryview:
        size = int(llama.llama_state_seq_get_size(self._ctx, slot))
        # np.empty, not a ctypes array: those are zero-filled, and llama.cpp overwrites it all.
        out = np.empty(size, dtype=np.uint8)
        buf = (ctypes.c_uint8 * size).from_buffer(out.data)
        written = int(llama.llama_state_seq_get_data(self._ctx, buf, size, slot))
        if written != size:
            raise KvstashError(f"llama.cpp wrote {written} of {size} bytes of sequence state")
        return memoryview(out.data)

    def export_kv(self, slot: int, n_kv: int) -> kvstate.KvCells:
        """A slot's KV cells, parsed and checked to hold exactly positions 0..n_kv-1."""
        if self.info is None or self.info.kv_layout is None:
            raise KvstashError("internal: this model's KV state cannot be exported")
        cells = kvstate.parse(self._state_bytes(slot), self.info.kv_layout)
        if cells.n != n_kv:
            raise KvstashError(f"internal: the slot holds {cells.n} cells, expected {n_kv}")
        return cells

    def import_kv(self, state: SeqState, cells: kvstate.KvCells) -> None:
        """Load checked cells into the session's slot; they hold tokens[:cells.n]."""
        slot = state.slot
        if slot is None or self.info is None or cells.layout != self.info.kv_layout:
            raise KvstashError("internal: importing KV that does not fit this context")
        blob = kvstate.assemble(cells)
        try:
            buf = (ctypes.c_uint8 * len(blob)).from_buffer(blob)
        except TypeError:  # a read-only buffer
            buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        read = int(llama.llama_state_seq_set_data(self._ctx, buf, len(blob), slot))
        if read != len(blob):
            self.clear_slot(slot)
            state.n_kv = 0
            raise CorruptCheckpoint(f"llama.cpp took {read} of {len(blob)} bytes of KV state")
        state.n_kv = cells.n

    # ---- generation --------------------------------------------------------------------------

    def _start_job(self, job: Job) -> None:
        state = job.state
        try:
            if state.slot is None:
                raise KvstashError("internal: a generation started on a session without a slot")
            limit = self.config.ctx_per_session
            if len(state.tokens) + len(job.request.prompt) >= limit:
                raise ContextFull(f"the session's context of {limit} tokens is full")
            if not job.request.prompt and state.pending == 0 and state.logits is None:
                if state.n_kv == 0:
                    raise InvalidRequest("the session has nothing to continue from: give a prompt")
                # The last logits row was not kept: evaluate the last token again to get it.
                llama.llama_memory_seq_rm(self._mem, state.slot, state.n_kv - 1, -1)
                state.n_kv -= 1
            state.tokens.extend(job.request.prompt)
        except BaseException as e:
            job.emit(e)
            return
        job._reused = state.n_kv
        self._active.append(job)

    def _step(self) -> None:
        for job in [j for j in self._active if j.cancelled]:
            self._finish(job, "cancelled")
        ready = [j for j in self._active if j.state.pending == 0]
        for job in ready:
            assert job.state.logits is not None
            self._sample(job, job.state.logits)
        decoding = [j for j in self._active if j.state.pending == 1]
        prefilling = [j for j in self._active if j.state.pending > 1]
        if not decoding and not prefilling:
            return
        batch = self._batch
        n = 0
        outputs: list[tuple[Job, int, int]] = []  # job, batch index of its logits, tokens taken

        def add(job: Job, count: int) -> None:
            nonlocal n
            state = job.state
            slot = state.slot
            assert slot is not None
            for k in range(count):
                batch.token[n] = state.tokens[state.n_kv + k]
                batch.pos[n] = state.n_kv + k
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = slot
                batch.logits[n] = 0
                n += 1
            last_of_prompt = state.n_kv + count == len(state.tokens)
            batch.logits[n - 1] = 1 if last_of_prompt else 0
            outputs.append((job, n - 1 if last_of_prompt else -1, count))

        for job in decoding:
            add(job, 1)
        if prefilling:
            budget = self.config.batch_size - n
            share = budget // len(prefilling)
            chunk = min(share, BUSY_PREFILL_CHUNK) if (decoding or len(prefilling) > 1) else share
            chunk = max(chunk, 1)
            for job in prefilling:
                add(job, min(job.state.pending, chunk, self.config.batch_size - n))
        batch.n_tokens = n
        rc = llama.llama_decode(self._ctx, batch)
        if rc != 0:
            log.error("llama_decode failed with %d for a batch of %d tokens", rc, n)
            for job, _, _ in outputs:
                self._fail(job, KvstashError("the engine failed to evaluate the batch"))
            return
        self.stats_evaluated += n
        n_vocab = self.info.n_vocab if self.info else 0
        for job, index, count in outputs:
            state = job.state
            state.n_kv += count
            job._evaluated += count
            if index < 0:
                state.logits = None
                continue
            ptr = llama.llama_get_logits_ith(self._ctx, index)
            row = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()
            state.logits = row
            self._sample(job, row)

    def _sample(self, job: Job, row: Logits) -> None:
        state = job.state
        req = job.request
        token = sample(row, state.tokens, req.params, state.draws)
        state.draws += 1
        state.tokens.append(token)
        job.generated.append(token)
        self.stats_generated += 1
        raw_piece = self.piece(token, True)
        job.raw_text += job._raw_utf8.feed(raw_piece)
        eog = self.is_eog(token)
        if not eog:
            released = job._stop.feed(job._utf8.feed(self.piece(token, False)))
            job.text += released
        else:
            released = ""
        job._pending_ids.append(token)
        if req.logprobs > 0:
            lp, top = top_logprobs(row, token, req.logprobs)
            job._pending_logprobs.append(
                GeneratedToken(
                    sampled=TokenLogprob(token, self._text_of(token), lp),
                    top=tuple(TokenLogprob(t, self._text_of(t), v) for t, v in top),
                )
            )
        reason: str | None = None
        if eog:
            reason = "eos"
        elif job._stop.matched:
            reason = "stop"
        elif req.max_tokens is not None and len(job.generated) >= req.max_tokens:
            reason = "length"
        elif len(state.tokens) >= self.config.ctx_per_session:
            reason = "context_full"
        if reason is not None:
            self._finish(job, reason, released)
        else:
            self._emit_pending(job, released)

    def _text_of(self, token: int) -> str:
        return self.piece(token, True).decode("utf-8", "replace")

    def _emit_pending(self, job: Job, text: str, reason: str | None = None) -> None:
        job.emit(
            Chunk(
                text=text,
                token_ids=tuple(job._pending_ids),
                logprobs=tuple(job._pending_logprobs),
                finish_reason=reason,
                usage=job.usage() if reason else None,
            )
        )
        job._pending_ids = []
        job._pending_logprobs = []

    def _finish(self, job: Job, reason: str, released: str = "") -> None:
        if reason != "stop":
            tail = job._stop.feed(job._utf8.flush()) + job._stop.flush()
            job.text += tail
            released += tail
        job.raw_text += job._raw_utf8.flush()
        if job in self._active:
            self._active.remove(job)
        self._emit_pending(job, released, reason)

    def _fail(self, job: Job, error: BaseException) -> None:
        if job in self._active:
            self._active.remove(job)
        state = job.state
        # Drop whatever this step may have written for the session, keeping the invariant.
        if state.slot is not None:
            llama.llama_memory_seq_rm(self._mem, state.slot, state.n_kv, -1)
        job.emit(error)


_log_callback: Any = None


def route_llama_log() -> None:
    """Send llama.cpp's C log to Python logging (it prints a lot to stderr otherwise).

    llama.cpp's own INFO is chatty model-loading detail, so it lands at DEBUG here.
    """
    global _log_callback
    if _log_callback is not None:
        return
    # ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continue the previous line.
    levels = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
    pending: list[str] = []
    last_level = [logging.DEBUG]

    def on_log(level: int, text: bytes | None, _user: Any) -> None:
        if text is None:
            return
        if level != 5:
            last_level[0] = levels.get(level, logging.DEBUG)
        pending.append(text.decode("utf-8", "replace"))
        if pending[-1].endswith("\n"):
            message = "".join(pending).rstrip()
            pending.clear()
            if message:
                llama_log.log(last_level[0], "%s", message)

    _log_callback = llama.llama_log_callback(on_log)
    llama.llama_log_set(_log_callback, ctypes.c_void_p(0))
