"""LlamaContext: the llama.cpp model and context, and the only module that imports llama_cpp.

Every method runs on the engine thread. By default the context runs one KV stream per slot
(`kv_unified=false`), f16 K/V and flash attention only with batch-invariant kernels (or none):
the "exact" mode, in which a sequence's logits do not depend on what else shares the batch,
on prefill chunking, or on which slot holds it (the start-up probe checks it). llama.cpp's
own flash attention (`--flash-attn`, and always with quantized K/V) or one shared KV buffer
is the "compact" mode: faster or smaller, with logits that depend on the batch's shape.
`swa_full` keeps every position of a sliding-window cache in its own cell (nothing is
overwritten), which is what makes the cell layout of an uninterrupted run and of an import
the same (see state/cells.py). The context has a KV stream per slot, and with a KV budget
docks beside them (see streams.py).
"""

from __future__ import annotations

import ctypes
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp as llama
import llguidance
import numpy as np
from llguidance.llamacpp import lltokenizer_from_vocab

from kvkeepd.engine import backend, streams
from kvkeepd.engine.context_config import ContextConfig, kernel_environment
from kvkeepd.errors import InvalidRequest, KvkeepError
from kvkeepd.heap import state_buffer
from kvkeepd.state import cells as kvstate
from kvkeepd.state import layout as kvlayout
from kvkeepd.values.sampling import Logits

log = logging.getLogger(__name__)

KV_TYPE_IDS = {"f16": llama.GGML_TYPE_F16, "q8_0": llama.GGML_TYPE_Q8_0, "q4_0": llama.GGML_TYPE_Q4_0}
_PARTIAL = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: the recurrent part of a hybrid's state
# Rows of logits one batch may ask for, at least (see LlamaContext.__init__).
MIN_OUTPUTS = 64
# Sliding-window caches whose window is not "the last n_swa positions" (chunked attention).
_OTHER_WINDOWS = {"llama4"}


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model and context."""

    description: str
    architecture: str
    n_vocab: int
    n_ctx_train: int
    n_ctx_seq: int
    n_layer: int
    n_swa: int
    chat_template: str | None
    bos_token: int
    eos_token: int
    add_bos: bool
    # What memory the model has: kv, iswa, hybrid, hybrid-iswa, recurrent, or "unknown".
    memory: str
    # None when this model's sequence state is not one state/cells.py can parse: sessions then
    # checkpoint their token history only and restore by evaluating it again.
    layout: kvlayout.StateLayout | None
    layout_note: str
    # The exact mode: configured so, and the start-up probe found that a token's logits do
    # not depend on how its sequence was batched (see batch_dependence). False in compact mode.
    exact: bool
    # The longest text of one token, in bytes: a prompt of more than prompt_limit times this
    # many bytes has too many tokens, whatever they are (checked before tokenizing).
    max_token_bytes: int = 1
    # Why the mode is not exact: the start-up probe's finding, or the settings ("": exact).
    exact_note: str = ""
    # Flash attention is on: compact mode's, or exact mode's batch-invariant kind.
    flash_attention: bool = False
    # Why exact mode evaluates without flash attention where it was to try it ("" otherwise).
    flash_note: str = ""


class ModelLoadError(OSError):
    """llama.cpp refused the model file: one line for the operator, as a file's failures are."""


@dataclass(frozen=True)
class BatchItem:
    """One token of a batch: which slot, what token at which position, whether to keep logits."""

    slot: int
    token: int
    pos: int
    logits: bool


class LlamaContext:
    """A loaded model and its multi-sequence context."""

    def __init__(self, cfg: ContextConfig, halt: backend.Halt | None = None) -> None:
        self.cfg = cfg
        self._halt = halt
        backend.route_llama_log()
        kernel_environment(cfg)
        llama.llama_backend_init()
        self.devices = backend.devices()
        backend.check_offload(cfg.gpu_layers, self.devices)
        mparams = llama.llama_model_default_params()
        mparams.n_gpu_layers = 2**31 - 1 if cfg.gpu_layers < 0 else cfg.gpu_layers
        if cfg.exact:
            # Kernels chosen by batch size make a token evaluated alone differ from the same
            # token inside a prompt chunk: the CPU's repacked weights (gemv for one column,
            # gemm for more) and ggml's tiled K-quant matmul (8 rows and up). Exact mode
            # takes the one kernel every batch shape shares; prefill speed did not change
            # measurably here (Gemma 3 270M Q4_K_M, 1,024 tokens: 4.2-4.4 s either way).
            mparams.use_extra_bufts = False
        if halt is not None:
            halt.watch_load(mparams)
        self._model = llama.llama_model_load_from_file(str(cfg.model_path).encode(), mparams)
        if not self._model:
            # llama.cpp says why only in its own log (shown at --log-level debug).
            raise ModelLoadError(
                f"llama.cpp could not load the model {cfg.model_path}: a damaged file, or an "
                "architecture this llama.cpp does not know (--log-level debug shows its reasons)"
            )
        model = self._model
        try:
            self.streams = streams.plan(
                cfg.slots,
                cfg.ctx_per_session * streams.row_bytes(self._shape(), cfg.kv_type),
                cfg.kv_budget,
                unified=cfg.kv_unified,
                recurrent=bool(llama.llama_model_is_recurrent(model) or llama.llama_model_is_hybrid(model)),
            )
        except KvkeepError:
            llama.llama_model_free(self._model)
            raise
        cparams = llama.llama_context_default_params()
        cparams.n_ctx = self.streams.total * cfg.ctx_per_session
        cparams.n_batch = cfg.batch_size
        cparams.n_ubatch = cfg.batch_size
        cparams.n_seq_max = self.streams.total
        # llama.cpp reserves its compute buffer for this many rows of logits per batch (n_batch
        # by default: 84 MiB more than this for SmolLM2's 49k vocabulary, 240 MiB for a 128k
        # one) and aborts on a batch that asks more (decode refuses it first). The engine asks
        # one row per sequence in a step, the start-up probe a dozen.
        self.outputs_max = max(self.streams.total, MIN_OUTPUTS)
        cparams.n_outputs_max = self.outputs_max
        cparams.n_threads = cfg.threads
        cparams.n_threads_batch = cfg.threads
        cparams.kv_unified = cfg.kv_unified
        cparams.swa_full = True
        # Flash attention makes logits depend on the batch's shape (its kernels differ for one
        # query, for 64 and more, and for one sequence or several) unless its batch-invariant
        # kernels are switched on (kernel_environment); quantized K/V requires it.
        enabled, disabled = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED, llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.flash_attn_type = enabled if cfg.flash_attention else disabled
        cparams.type_k = KV_TYPE_IDS[cfg.kv_type]
        cparams.type_v = KV_TYPE_IDS[cfg.kv_type]
        cparams.no_perf = True
        self._ctx = llama.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            llama.llama_model_free(self._model)
            raise RuntimeError("llama.cpp could not create the context")
        if halt is not None:
            halt.watch(self._ctx)
        self._vocab = llama.llama_model_get_vocab(self._model)
        self._mem = llama.llama_get_memory(self._ctx)
        self._batch = llama.llama_batch_init(cfg.batch_size, 0, 1)
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._eog: dict[int, bool] = {}
        # Streams with a whole-stream copy pending (see move): llama.cpp makes it at the
        # start of the next decode.
        self._pending: set[int] = set()
        self.n_vocab = int(llama.llama_vocab_n_tokens(self._vocab))
        n_ctx_seq = int(llama.llama_n_ctx_seq(self._ctx))
        if n_ctx_seq < cfg.ctx_per_session:
            self.close()
            raise RuntimeError(f"llama.cpp gave {n_ctx_seq} cells per session, not {cfg.ctx_per_session}")
        # Measured again now that the weights and the KV take their memory.
        self.devices = backend.devices()

    def close(self) -> None:
        if self._batch is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            llama.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            llama.llama_model_free(self._model)
            self._model = None

    # ---- facts ------------------------------------------------------------------------------

    def info(self) -> ModelInfo:
        """Facts about the model; probes the state layout in slot 0."""
        model = self._model
        template = llama.llama_model_chat_template(model, None)
        desc = ctypes.create_string_buffer(256)
        llama.llama_model_desc(model, desc, 256)
        arch = self._meta("general.architecture")
        layout, note = self.probe_layout(arch)
        return ModelInfo(
            description=desc.value.decode("utf-8", "replace"),
            architecture=arch,
            n_vocab=self.n_vocab,
            n_ctx_train=int(llama.llama_model_n_ctx_train(model)),
            n_ctx_seq=self.cfg.ctx_per_session,
            n_layer=int(llama.llama_model_n_layer(model)),
            n_swa=int(llama.llama_model_n_swa(model)),
            chat_template=template.decode("utf-8") if template else None,
            bos_token=int(llama.llama_vocab_bos(self._vocab)),
            eos_token=int(llama.llama_vocab_eos(self._vocab)),
            add_bos=bool(llama.llama_vocab_get_add_bos(self._vocab)),
            memory=layout.kind if layout is not None else self._memory_guess(),
            layout=layout,
            layout_note=note,
            # What the settings ask for; the engine's start-up probe decides (probes.exact).
            exact=self.cfg.exact,
            flash_attention=self.cfg.flash_attention,
            max_token_bytes=max(1, *(len(self.piece(t, True)) for t in range(self.n_vocab))),
        )

    def _shape(self) -> streams.ModelShape:
        """The model's K/V shape; head sizes from the GGUF's key/value lengths where given."""
        model = self._model
        arch = self._meta("general.architecture")
        n_head = max(int(llama.llama_model_n_head(model)), 1)
        head = int(llama.llama_model_n_embd(model)) // n_head

        def length(key: str) -> int:
            value = self._meta(f"{arch}.attention.{key}")
            return int(value) if value.isdigit() else head

        return streams.ModelShape(
            n_layer=int(llama.llama_model_n_layer(model)),
            n_head_kv=int(llama.llama_model_n_head_kv(model)),
            head_k=length("key_length"),
            head_v=length("value_length"),
        )

    def _meta(self, key: str) -> str:
        buf = ctypes.create_string_buffer(256)
        n = llama.llama_model_meta_val_str(self._model, key.encode(), buf, 256)
        return buf.value.decode("utf-8", "replace") if n >= 0 else ""

    def _memory_guess(self) -> str:
        if llama.llama_model_is_recurrent(self._model):
            return "recurrent"
        if llama.llama_model_is_hybrid(self._model):
            return "hybrid"
        return "unknown"

    def probe_layout(self, arch: str) -> tuple[kvlayout.StateLayout | None, str]:
        """Learn the state layout from a real one-token state of slot 0, then clear it."""
        n_swa = int(llama.llama_model_n_swa(self._model))
        if arch in _OTHER_WINDOWS:
            return None, f"checkpoints keep token history only: {arch}'s chunked attention window"
        try:
            self.decode([BatchItem(0, int(llama.llama_vocab_bos(self._vocab)), 0, False)])
            layout = kvstate.discover(
                self.state_bytes(0),
                recurrent=bool(llama.llama_model_is_recurrent(self._model)),
                hybrid=bool(llama.llama_model_is_hybrid(self._model)),
                window=n_swa,
            )
        except kvlayout.StateFormatError as e:
            log.warning("KV checkpoints are off for this model: %s", e)
            return None, f"checkpoints keep token history only: {e}"
        finally:
            self.clear(0)
        return layout, "checkpoints carry the model's computed state"

    # ---- tokens -----------------------------------------------------------------------------

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
        # Cached: asked once per generated token on the engine thread, where every ctypes
        # call lets the asyncio thread take the GIL (and hold it) in the middle of a step.
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = bool(llama.llama_vocab_is_eog(self._vocab, token))
        return eog

    def special_tokens(self) -> tuple[dict[str, int], list[str]]:
        """The tokens a grammar names as special tokens (llguidance's rule: control tokens, and
        user-defined ones written as <...>), by their text; and the texts of the control
        tokens, which tokenizing template text turns into them."""
        specials: dict[str, int] = {}
        control: list[str] = []
        for token in range(self.n_vocab):
            attr = llama.llama_vocab_get_attr(self._vocab, token)
            is_control = bool(attr & llama.LLAMA_TOKEN_ATTR_CONTROL)
            if not is_control and not attr & llama.LLAMA_TOKEN_ATTR_USER_DEFINED:
                continue
            text = self.piece(token, True).decode("utf-8", "replace")
            if is_control or (text.startswith("<") and text.endswith(">")):
                specials.setdefault(text, token)
            if is_control:
                control.append(text)
        return specials, control

    def grammar_tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance sees it: control tokens marked (grammars cannot
        produce them unless they name them), every end-of-generation token allowed to end a
        grammar's output. Takes a few hundred milliseconds."""
        eog = [t for t in range(self.n_vocab) if self.is_eog(t)]
        # llguidance's adapter reads token attributes through a deprecated alias that warns
        # once per token.
        with warnings.catch_warnings(action="ignore", category=DeprecationWarning):
            return lltokenizer_from_vocab(self._vocab, eos_token=eog)

    # ---- evaluation -------------------------------------------------------------------------

    def decode(self, items: Sequence[BatchItem]) -> list[Logits]:
        """Evaluate one batch; the logits rows of the items that asked for them (at most
        `outputs_max`), in order."""
        n_out = sum(1 for item in items if item.logits)
        if n_out > self.outputs_max:
            raise KvkeepError(f"a batch asked for {n_out} rows of logits, more than {self.outputs_max}")
        batch = self._batch
        for k, item in enumerate(items):
            batch.token[k] = item.token
            batch.pos[k] = item.pos
            batch.n_seq_id[k] = 1
            batch.seq_id[k][0] = item.slot
            batch.logits[k] = int(item.logits)
        batch.n_tokens = len(items)
        if self._halt is not None:
            self._halt.check()
        rc = llama.llama_decode(self._ctx, batch)
        if rc != 0:
            raise KvkeepError(f"llama_decode failed with {rc} for a batch of {len(items)} tokens")
        self._pending.clear()  # a decode makes the pending copies first
        if not n_out:
            return []
        # The rows asked for lie together, in batch order: one call for all of them. Each
        # row is copied on its own, so a row kept with a session holds no other row's memory.
        out = np.ctypeslib.as_array(llama.llama_get_logits(self._ctx), shape=(n_out, self.n_vocab))
        return [row.copy() for row in out]

    # ---- sequences --------------------------------------------------------------------------

    def wipe(self) -> None:
        """Empty every slot and zero the memory's buffers, which maps their pages: the first
        state loaded into a slot then costs what later ones do."""
        llama.llama_memory_clear(self._mem, True)

    def move(self, src: int, dst: int) -> None:
        """Move a sequence's cells from stream `src` to the empty stream `dst`: its metadata
        now, the whole stream's data by a copy in the KV's own memory (device to device on a
        GPU) that llama.cpp makes at the start of the next decode (see _flush)."""
        if self.streams.scratch is None:
            raise KvkeepError("internal: streams move only where there are docks")
        llama.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        llama.llama_memory_seq_rm(self._mem, src, -1, -1)
        self._pending.update((src, dst))

    def _flush(self, seq: int) -> None:
        """Make the pending copies before `seq`'s data is read or written from the host (a
        copy made later would read or overwrite it): one token decoded in the scratch stream,
        which llama.cpp starts by making them."""
        scratch = self.streams.scratch
        if seq not in self._pending or scratch is None:
            return
        self.decode([BatchItem(scratch, int(llama.llama_vocab_bos(self._vocab)), 0, False)])
        self.clear(scratch)

    def clear(self, slot: int) -> None:
        """Forget every cell of a slot."""
        llama.llama_memory_seq_rm(self._mem, slot, -1, -1)

    def remove_from(self, slot: int, pos: int) -> bool:
        """Forget a slot's cells from `pos` on; False where the memory cannot (recurrent)."""
        return bool(llama.llama_memory_seq_rm(self._mem, slot, pos, -1))

    def positions(self, slot: int) -> tuple[int, int]:
        """(lowest, highest) position a slot holds; (-1, -1) when it is empty."""
        return (
            int(llama.llama_memory_seq_pos_min(self._mem, slot)),
            int(llama.llama_memory_seq_pos_max(self._mem, slot)),
        )

    def state_bytes(self, slot: int, *, partial: bool = False, rounded: bool = False) -> memoryview:
        """A slot's sequence state as llama.cpp writes it (partial: the recurrent part only;
        rounded: see heap.state_buffer)."""
        self._flush(slot)
        flags = _PARTIAL if partial else 0
        size = int(llama.llama_state_seq_get_size_ext(self._ctx, slot, flags))
        # Not a ctypes array: those are zero-filled, and llama.cpp overwrites it all.
        out = state_buffer(size, rounded=rounded)
        buf = (ctypes.c_uint8 * size).from_buffer(out.data)
        written = int(llama.llama_state_seq_get_data_ext(self._ctx, buf, size, slot, flags))
        if written != size:
            raise KvkeepError(f"llama.cpp wrote {written} of {size} bytes of sequence state")
        return memoryview(out.data)

    def set_state(self, slot: int, blob: bytes | bytearray | memoryview, *, partial: bool = False) -> bool:
        """Load a checked blob into a slot; True when llama.cpp took all of it."""
        self._flush(slot)
        try:
            buf = (ctypes.c_uint8 * len(blob)).from_buffer(blob)
        except TypeError:  # a read-only buffer
            buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        flags = _PARTIAL if partial else 0
        read = int(llama.llama_state_seq_set_data_ext(self._ctx, buf, len(blob), slot, flags))
        return read == len(blob)
