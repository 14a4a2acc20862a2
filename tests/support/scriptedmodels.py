"""A tiny generated model whose weights are chosen so that it calls a tool, then answers.

This is not a language model: nothing is trained and it understands nothing. Its weights are
set by hand so that, whatever the task, its next token is decided by the token before it (a
table of preferences, as in a bigram model) and by two facts about its context:

- tools were offered (the template's ``<tools>`` is in the prompt): its reply opens a call;
- a tool's result is in the context (``<tool_response>``): its reply is ``Done.``

Inside a call the door's grammar holds the structure (the call's JSON, the tool's schema) and
the preferences pick the content: the first tool named ``exec_command`` (Codex CLI's) or
``Bash`` (Claude Code's) that is offered, and a first argument, a command string, of
``echo kvkeep-ok``::

    <tool_call>
    {"name": "exec_command", "arguments": {"cmd": "echo kvkeep-ok"}}
    </tool_call><|im_end|>

That is what agent clients need to run a whole tool round trip against the HTTP door: a
call the client can run harmlessly, then a text reply that ends the task. The logit gaps
between a preferred token and any other are large (dozens of units), so the same reply comes
at temperature 1 as greedily.

How the qwen3 graph of llama.cpp is made to do it (one layer, width 64, f32 weights):

- the token embedding is a constant dimension (1 for every token) plus, for each token the
  preferences name, a dimension of its own; the feed-forward block is zero;
- the output head reads those dimensions: its column for a token's dimension holds the
  logits of the tokens preferred after it (the final RMS norm scales all of a row alike, so
  the order of the preferences is kept);
- attention head 0 has a constant query (from the constant dimension) and a key only at
  ``<tool_response>``, both on the slowest rotary pair, which turns by less than a billionth
  of a radian per position: it finds a result anywhere in the context and writes a "result seen"
  dimension, whose output column lowers ``<tool_call>``; head 1 does the same for ``<tools>``
  and raises ``<tool_call>``.

The tokenizer is the default model's with the hermes template of tests/support/toolmodels.py;
``<tool_response>`` and ``<tools>`` are renamed control-free tokens (user-defined) so that the
template's markers are one token each.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import testmodels
import toolmodels

__all__ = ["ANSWER", "COMMAND", "path"]

#: The command the model's call runs.
COMMAND = "echo kvkeep-ok"
#: What it answers once a tool's result is in its context.
ANSWER = "Done."

# Bumped whenever the weights written here change (the tag follows the tokenizer's edit).
VERSION = 1
_N_EMBD = 64
_HEAD_DIM = 64
_N_HEAD = 2
# The size of a token's own dimension and of the two flags, against the constant 1.
_ONE_HOT = 4.0
# The slowest rotary pair (NEOX layout: dimensions i and i + HEAD_DIM/2), turning by
# base^(-(HEAD_DIM-2)/HEAD_DIM) per position: 2e-10 radian with this base.
_ROPE_BASE = 1e10
_SLOW = _HEAD_DIM // 2 - 1
# QK-norm weights: a query and a key that meet score 8 * 4 * 8 * 4 / 8 = 128, against 0.
_QK_NORM = 4.0
_USER_DEFINED = gguf.TokenType.USER_DEFINED
_MORE_TOKENS = {
    10: ("<tool_response>", _USER_DEFINED),
    11: ("</tool_response>", _USER_DEFINED),
    12: ("<tools>", _USER_DEFINED),
    13: ("</tools>", _USER_DEFINED),
}
_EOS = "<|im_end|>"
# After each token, the tokens preferred next, best first: where the grammar leaves a
# choice, the best one it allows is taken. The logits are 60, 52, 44... (the rest 0).
_PREFERENCES: dict[str, list[str]] = {
    # The end of the generation prompt: an answer, unless tools were offered (the flags); the
    # others are the forced newlines of a call.
    "\n": ["Done", '{"', "</tool_call>"],
    "<tool_call>": ["\n"],
    '{"': ["name"],
    "name": ['":'],
    '":': [' "', ' {"'],
    # The tool's name (only names are allowed there), or the command (any string is).
    ' "': ["echo", "exec", "B", "arguments"],
    "exec": ["_"],
    "_": ["command"],
    "B": ["ash"],
    "ash": ['",'],
    "command": ['",', '":'],
    '",': [' "'],
    "arguments": ['":'],
    ' {"': ["cmd", "command"],
    "cmd": ['":'],
    "echo": [" "],
    " ": ["kv"],
    "kv": ["keep"],
    "keep": ["-"],
    "-": ["ok"],
    "ok": ['"'],
    '"': ["}}", "}"],
    "}}": ["\n"],
    "}": ["}", "\n"],
    "</tool_call>": [_EOS],
    "Done": ["."],
    ".": [_EOS],
}
_TOP, _STEP = 60.0, 8.0
# The flags' weight on <tool_call>: tools offered beat the answer; a result seen beats both.
_TOOLS_OFFERED = 100.0
_RESULT_SEEN = -200.0


def path() -> Path:
    """The GGUF of the scripted model (built once, cached with the other test models)."""
    edit, tag = toolmodels.retokenizer("hermes", _MORE_TOKENS)
    return testmodels.cached(f"qwen3-scripted-{tag}-v{VERSION}.gguf", lambda tmp: _write(tmp, edit), None)


@functools.cache
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character a vocabulary entry writes for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _write(dst: Path, edit: toolmodels.TokenizerEdit) -> None:
    entries = edit(list(testmodels.tokenizer_entries()))
    vocab = next(kv.value for kv in entries if kv.key == "tokenizer.ggml.tokens")
    ids = {t: i for i, t in enumerate(vocab)}

    def token(text: str) -> int:
        if text in (_EOS, "<tool_call>", "</tool_call>", "<tool_response>", "<tools>"):
            return ids[text.encode()]
        return ids["".join(_byte_chars()[b] for b in text.encode()).encode()]

    named = sorted({token(t) for t in _PREFERENCES} | {token("<tool_response>"), token("<tools>")})
    # Dimension 0: constant; 1, 2: the flags (result seen, tools offered); then one per token.
    result_dim, tools_dim = 1, 2
    dim = {t: 3 + k for k, t in enumerate(named)}
    assert 3 + len(named) <= _N_EMBD
    n_vocab = len(vocab)

    embd = np.zeros((n_vocab, _N_EMBD), np.float32)
    embd[:, 0] = 1.0
    for t, d in dim.items():
        embd[t, d] = _ONE_HOT

    # Logits are scaled by the final norm: 8 / |x| per unit of x. The smallest scale a
    # named token sees is with both flags on; the logits above are at least that.
    unit = _ONE_HOT * np.sqrt(_N_EMBD) / np.sqrt(1 + 3 * _ONE_HOT**2)
    out = np.zeros((n_vocab, _N_EMBD), np.float32)
    for before, after in _PREFERENCES.items():
        for rank, text in enumerate(after):
            out[token(text), dim[token(before)]] = (_TOP - _STEP * rank) / unit
    call = token("<tool_call>")
    out[call, result_dim] = _RESULT_SEEN / unit
    out[call, tools_dim] = _TOOLS_OFFERED / unit

    # Attention: head h's query is the constant dimension, its key the marker's dimension,
    # its value that dimension too, written back to its flag. The norm of a marker's
    # embedding makes its own dimension 4 * 8 / sqrt(17) after attn_norm: scaled back to 4.
    q = np.zeros((_N_HEAD * _HEAD_DIM, _N_EMBD), np.float32)
    k = np.zeros((_N_HEAD * _HEAD_DIM, _N_EMBD), np.float32)
    v = np.zeros((_N_HEAD * _HEAD_DIM, _N_EMBD), np.float32)
    o = np.zeros((_N_EMBD, _N_HEAD * _HEAD_DIM), np.float32)
    normed = _ONE_HOT * np.sqrt(_N_EMBD) / np.sqrt(1 + _ONE_HOT**2)
    for h, (marker, flag) in enumerate((("<tool_response>", result_dim), ("<tools>", tools_dim))):
        row = h * _HEAD_DIM + _SLOW
        q[row, 0] = 1.0
        k[row, dim[token(marker)]] = 1.0
        v[h * _HEAD_DIM, dim[token(marker)]] = 1.0
        o[flag, h * _HEAD_DIM] = _ONE_HOT / normed

    ones = np.ones(_N_EMBD, np.float32)
    tensors: list[tuple[str, testmodels.Array, gguf.GGMLQuantizationType | None]] = [
        ("token_embd.weight", embd, None),
        ("output_norm.weight", ones, None),
        ("output.weight", out, None),
        ("blk.0.attn_norm.weight", ones, None),
        ("blk.0.attn_q.weight", q, None),
        ("blk.0.attn_k.weight", k, None),
        ("blk.0.attn_v.weight", v, None),
        ("blk.0.attn_output.weight", o, None),
        ("blk.0.attn_q_norm.weight", np.full(_HEAD_DIM, _QK_NORM, np.float32), None),
        ("blk.0.attn_k_norm.weight", np.full(_HEAD_DIM, _QK_NORM, np.float32), None),
        ("blk.0.ffn_norm.weight", ones, None),
        # A feed-forward block of zeros (the graph has one): it adds nothing.
        ("blk.0.ffn_gate.weight", np.zeros((1, _N_EMBD), np.float32), None),
        ("blk.0.ffn_up.weight", np.zeros((1, _N_EMBD), np.float32), None),
        ("blk.0.ffn_down.weight", np.zeros((_N_EMBD, 1), np.float32), None),
    ]
    hparams: dict[str, int | float | list[int]] = {
        "vocab_size": n_vocab,
        "context_length": 65536,
        "embedding_length": _N_EMBD,
        "block_count": 1,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "feed_forward_length": 1,
        "attention.head_count": _N_HEAD,
        "attention.head_count_kv": _N_HEAD,
        "attention.key_length": _HEAD_DIM,
        "attention.value_length": _HEAD_DIM,
        "rope.dimension_count": _HEAD_DIM,
        "rope.freq_base": _ROPE_BASE,
    }
    testmodels.write_gguf(
        dst, "qwen3", f"kvkeep scripted tool-calling model v{VERSION}", hparams, tensors, entries
    )
