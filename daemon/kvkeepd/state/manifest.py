"""Checkpoint manifests: an immutable record of everything a session needs to continue.

Encoding: b"KVKPMAN1", u32 length + JSON metadata, u32 count + int32 token ids,
u32 count + float32 logits (0 or n_vocab), then HMAC-SHA256 over all of it with the
store's key. `decode` checks the MAC (when a key is given) and every field's type and
range before anything else reads it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvkeepd.errors import CorruptCheckpoint, IncompatibleCheckpoint
from kvkeepd.request_limits import (
    MAX_BLOCK_TOKENS,
    MAX_GRAMMAR_CHARS,
    MAX_LABEL,
    MAX_MESSAGE_CHARS,
    MAX_MESSAGES,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_TOOL_GRAMMAR_CHARS,
    MIN_BLOCK_TOKENS,
)
from kvkeepd.state.conversation import messages_of, messages_value, tools_of, tools_value
from kvkeepd.values.constraints import KINDS, Constraint, GrammarSpec
from kvkeepd.values.messages import CONTEXT_POLICIES, ChatMessage, ContextPolicy, context_policy
from kvkeepd.values.sampling import SAMPLING_FIELDS, Logits, SamplingParams
from kvkeepd.values.toolcall import Tool

MAGIC = b"KVKPMAN1"
# A session's or a checkpoint's id.
_FORKED_FROM = re.compile(r"^[sc]_[0-9a-f]{24}$")
FORMAT = 1
MAC_BYTES = 32
MAX_TOKENS = 1 << 20
# Each sampling field's default says its type: what a manifest's value of it must be.
_SAMPLING_DEFAULTS = SamplingParams()


@dataclass
class Snapshot:
    """A session's complete state at one moment, as stored in a manifest."""

    session_id: str
    persistent: bool
    created_at: float
    tokens: list[int]
    n_kv: int
    logits: Logits | None
    draws: int
    params: SamplingParams
    stop: tuple[str, ...]
    messages: list[ChatMessage]
    fingerprint: str
    kv_layout: str | None
    block_tokens: int
    # Keys of the full-attention KV blocks of tokens[:n_kv] (block_tokens positions each).
    blocks: list[str] = field(default_factory=list)
    # Sliding-window pieces: (key, first position), covering the window of tokens[:n_kv].
    window: list[tuple[str, int]] = field(default_factory=list)
    # The recurrent state after tokens[:n_kv] ("" if the model has none).
    recurrent: str = ""
    # Hex salt of the block keys ("" for the daemon's own; imports get one of their own).
    salt: str = ""
    # The state descends from an import: KV this daemon did not compute. It keeps the
    # import's salt, and the prefix cache neither offers it nor attaches to it.
    imported: bool = False
    # The tenant it belongs to ("" for the anonymous one).
    tenant: str = ""
    label: str = ""
    saved_at: float = 0.0
    # An open constrained output (structured output cut short), or None.
    constraint: Constraint | None = None
    # The tools the session's chat turns may call (absent in manifests older than tools).
    tools: tuple[Tool, ...] = ()
    # Tokens of the system prompt, what a chat turn that does not fit does, and what
    # truncating has dropped so far (absent in manifests older than context policies).
    system_end: int = 0
    context_policy: ContextPolicy = "error"
    truncations: int = 0
    dropped_tokens: int = 0
    # A persistent session's head: the session or checkpoint it was forked from ("": none).
    forked_from: str = ""
    format: int = FORMAT

    def piece_keys(self) -> list[str]:
        """Every piece key the manifest references."""
        return [*self.blocks, *(k for k, _ in self.window), *([self.recurrent] if self.recurrent else [])]


def encode(s: Snapshot, key: bytes) -> bytes:
    meta = {
        "format": s.format,
        "session_id": s.session_id,
        "persistent": s.persistent,
        "created_at": s.created_at,
        "saved_at": s.saved_at,
        "label": s.label,
        "n_kv": s.n_kv,
        "draws": s.draws,
        "params": {name: getattr(s.params, name) for name in SAMPLING_FIELDS},
        "stop": list(s.stop),
        "messages": messages_value(s.messages),
        "tools": tools_value(s.tools),
        "fingerprint": s.fingerprint,
        "kv_layout": s.kv_layout,
        "block_tokens": s.block_tokens,
        "blocks": s.blocks,
        "window": [[k, p] for k, p in s.window],
        "recurrent": s.recurrent,
        "salt": s.salt,
        "imported": s.imported,
        "tenant": s.tenant,
        "system_end": s.system_end,
        "context_policy": s.context_policy,
        "truncations": s.truncations,
        "dropped_tokens": s.dropped_tokens,
        "constraint": None if s.constraint is None else _constraint_value(s.constraint),
        "forked_from": s.forked_from,
    }
    head = json.dumps(meta, separators=(",", ":")).encode()
    tokens = np.asarray(s.tokens, dtype="<i4").tobytes()
    logits = b"" if s.logits is None else np.asarray(s.logits, dtype="<f4").tobytes()
    body = b"".join(
        [
            MAGIC,
            struct.pack("<I", len(head)),
            head,
            struct.pack("<I", len(s.tokens)),
            tokens,
            struct.pack("<I", len(logits) // 4),
            logits,
        ]
    )
    return body + mac(key, body)


def mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def decode(data: bytes, key: bytes | None, n_vocab: int) -> Snapshot:
    """Parse and check a manifest. With key=None the MAC is not checked (imports)."""
    if len(data) < len(MAGIC) + 12 + MAC_BYTES or data[: len(MAGIC)] != MAGIC:
        if data[:7] == MAGIC[:7]:
            raise IncompatibleCheckpoint("the checkpoint has another manifest format version")
        raise CorruptCheckpoint("the manifest is not a kvkeep manifest")
    body, tag = data[:-MAC_BYTES], data[-MAC_BYTES:]
    if key is not None and not hmac.compare_digest(mac(key, body), tag):
        raise CorruptCheckpoint("the manifest fails its integrity check (HMAC)")
    at = len(MAGIC)

    def take(n: int) -> bytes:
        nonlocal at
        if n < 0 or at + n > len(body):
            raise CorruptCheckpoint("the manifest is truncated")
        out = body[at : at + n]
        at += n
        return out

    def u32() -> int:
        return int(struct.unpack("<I", take(4))[0])

    try:
        meta = json.loads(take(u32()))
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: deep nesting
        raise CorruptCheckpoint("the manifest metadata is not valid JSON") from None
    n_tokens = u32()
    if n_tokens > MAX_TOKENS:
        raise CorruptCheckpoint("the manifest holds too many tokens")
    tokens = np.frombuffer(take(4 * n_tokens), dtype="<i4")
    n_logits = u32()
    logits = np.frombuffer(take(4 * n_logits), dtype="<f4").astype(np.float32) if n_logits else None
    if at != len(body):
        raise CorruptCheckpoint("the manifest has trailing bytes")
    if not isinstance(meta, dict):
        raise CorruptCheckpoint("the manifest metadata is not an object")
    try:
        # JSON may escape a lone surrogate; such a string could never be stored or sent.
        json.dumps(meta, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise CorruptCheckpoint("the manifest metadata holds text that is not UTF-8") from None
    return _snapshot(meta, tokens, logits, n_vocab)


def _get(meta: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = meta.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptCheckpoint(f"the manifest field {name!r} is missing or has the wrong type")
    return value


def _sampling_field(p: dict[str, Any], name: str) -> float | int:
    """A sampling field as the manifest holds it: a float field is taken written as an integer
    too (JSON does not tell 1 from 1.0 in every writer), an integer field only as an integer."""
    if isinstance(getattr(_SAMPLING_DEFAULTS, name), float):
        return float(_get(p, name, (int, float)))
    return int(_get(p, name, int))


def _snapshot(
    meta: dict[str, Any], tokens: np.ndarray[Any, Any], logits: Logits | None, n_vocab: int
) -> Snapshot:
    fmt = _get(meta, "format", int)
    if fmt != FORMAT:
        raise IncompatibleCheckpoint(f"the checkpoint has format version {fmt}; this daemon reads {FORMAT}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= n_vocab):
        raise CorruptCheckpoint("the checkpoint holds token ids outside the vocabulary")
    if logits is not None and (logits.shape[0] != n_vocab or not np.all(np.isfinite(logits))):
        raise CorruptCheckpoint("the checkpoint's logits do not fit the model")
    n_kv = _get(meta, "n_kv", int)
    if not 0 <= n_kv <= tokens.size:
        raise CorruptCheckpoint("the checkpoint's KV length exceeds its history")
    p = _get(meta, "params", dict)
    try:
        # Any: `_sampling_field` checks each field's type, which mypy cannot tie to its name.
        fields: dict[str, Any] = {name: _sampling_field(p, name) for name in SAMPLING_FIELDS}
        params = SamplingParams(**fields).validate()
    except CorruptCheckpoint:
        raise
    except Exception as e:
        raise CorruptCheckpoint(f"the checkpoint's sampling parameters are invalid: {e}") from None
    messages = messages_of(meta.get("messages"))
    stop = _get(meta, "stop", list)
    if not all(isinstance(x, str) for x in stop):
        raise CorruptCheckpoint("the checkpoint's stop strings are not strings")
    blocks = _get(meta, "blocks", list)
    if not all(_is_key(b) for b in blocks):
        raise CorruptCheckpoint("the checkpoint's block keys are malformed")
    window = meta.get("window", [])
    if not isinstance(window, list) or not all(
        isinstance(w, list) and len(w) == 2 and _is_key(w[0]) and type(w[1]) is int and w[1] >= 0
        for w in window
    ):
        raise CorruptCheckpoint("the checkpoint's window pieces are malformed")
    recurrent = meta.get("recurrent", "")
    salt = meta.get("salt", "")
    if not isinstance(recurrent, str) or (recurrent and not _is_key(recurrent)):
        raise CorruptCheckpoint("the checkpoint's recurrent state key is malformed")
    if (
        not isinstance(salt, str)
        or len(salt) > 128
        or len(salt) % 2
        or any(c not in "0123456789abcdef" for c in salt)
    ):
        raise CorruptCheckpoint("the checkpoint's salt is malformed")
    imported = meta.get("imported", False)
    if not isinstance(imported, bool):
        raise CorruptCheckpoint("the checkpoint's import mark is malformed")
    tenant = meta.get("tenant", "")
    if not isinstance(tenant, str) or len(tenant) > 128:
        raise CorruptCheckpoint("the checkpoint's tenant is malformed")
    layout = meta.get("kv_layout")
    if layout is not None and not isinstance(layout, str):
        raise CorruptCheckpoint("the checkpoint's KV layout is malformed")
    created = _timestamp(meta, "created_at")
    saved = _timestamp(meta, "saved_at")
    if not (math.isfinite(created) and math.isfinite(saved)):
        raise CorruptCheckpoint("the checkpoint's timestamps are not finite")
    block_tokens = _get(meta, "block_tokens", int)
    if not 1 <= block_tokens <= 4096:
        raise CorruptCheckpoint("the checkpoint's block size is out of range")
    constraint = _constraint(meta.get("constraint"), tokens.size)
    forked_from = meta.get("forked_from", "")  # absent in manifests older than it
    if not isinstance(forked_from, str) or (forked_from and not _FORKED_FROM.match(forked_from)):
        raise CorruptCheckpoint("the checkpoint's fork source is malformed")
    system_end, policy, truncations, dropped = _context(meta, tokens.size)
    if "system_end" not in meta and messages and messages[0].role == "system" and messages[0].start == 0:
        # Older manifests: the system prompt is what precedes the next message.
        system_end = max(0, min(messages[1].start if len(messages) > 1 else tokens.size, tokens.size))
    return Snapshot(
        session_id=_get(meta, "session_id", str),
        persistent=_get(meta, "persistent", bool),
        created_at=created,
        saved_at=saved,
        label=_get(meta, "label", str),
        tokens=[int(t) for t in tokens],
        n_kv=n_kv,
        logits=logits,
        draws=_get(meta, "draws", int),
        params=params,
        stop=tuple(stop),
        messages=messages,
        fingerprint=_get(meta, "fingerprint", str),
        kv_layout=layout,
        block_tokens=block_tokens,
        blocks=blocks,
        window=[(str(k), int(p)) for k, p in window],
        recurrent=recurrent,
        salt=salt,
        imported=imported,
        tenant=tenant,
        constraint=constraint,
        tools=tools_of(meta.get("tools", [])),
        system_end=system_end,
        context_policy=policy,
        truncations=truncations,
        dropped_tokens=dropped,
        forked_from=forked_from,
    )


def _context(meta: dict[str, Any], n_tokens: int) -> tuple[int, ContextPolicy, int, int]:
    """The system prompt's end, the context policy and the truncation counts (defaults in
    manifests older than context policies)."""
    system_end = meta.get("system_end", 0)
    policy = meta.get("context_policy", "error")
    truncations = meta.get("truncations", 0)
    dropped = meta.get("dropped_tokens", 0)
    if type(system_end) is not int or not 0 <= system_end <= n_tokens:
        raise CorruptCheckpoint("the checkpoint's system prompt end is outside its history")
    if policy not in CONTEXT_POLICIES:
        raise CorruptCheckpoint("the checkpoint's context policy is unknown")
    policy = context_policy(policy)
    if any(type(n) is not int or not 0 <= n < 1 << 62 for n in (truncations, dropped)):
        raise CorruptCheckpoint("the checkpoint's truncation counts are malformed")
    return system_end, policy, truncations, dropped


def _constraint_value(c: Constraint) -> dict[str, Any]:
    value: dict[str, Any] = {"kind": c.spec.kind, "text": c.spec.text, "start": c.start}
    if c.call_ids:
        value["call_ids"] = c.call_ids
    return value


def _constraint(value: object, n_tokens: int) -> Constraint | None:
    """An open constraint's record (absent in manifests older than structured output).
    Whether its text compiles, and the history since `start` matches it, is checked when a
    request continues it."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CorruptCheckpoint("the checkpoint's constraint is malformed")
    kind, text, start = value.get("kind"), value.get("text"), value.get("start")
    call_ids = value.get("call_ids", "")
    limit = MAX_TOOL_GRAMMAR_CHARS if kind == "tools" else MAX_GRAMMAR_CHARS
    if (
        kind not in KINDS
        or not isinstance(text, str)
        or not 0 < len(text) <= limit
        or type(start) is not int
        or not 0 <= start <= n_tokens
        or not isinstance(call_ids, str)
        or len(call_ids) > 64
    ):
        raise CorruptCheckpoint("the checkpoint's constraint is malformed")
    return Constraint(GrammarSpec(kind, text), start, call_ids)


def _timestamp(meta: dict[str, Any], name: str) -> float:
    try:
        return float(_get(meta, name, (int, float)))
    except OverflowError:  # a JSON integer beyond float range
        raise CorruptCheckpoint(f"the manifest field {name!r} is out of range") from None


def _is_key(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def check_limits(s: Snapshot, n_ctx: int) -> None:
    """Everything an RPC could not have made is refused (imports: another daemon's manifest
    is checked as strictly as an RPC argument). CorruptCheckpoint names the field."""
    problems = []
    if len(s.tokens) > n_ctx:
        problems.append(f"{len(s.tokens)} tokens, beyond the context of {n_ctx}")
    if not 0 <= s.draws < 1 << 62:  # not bounded by the history: rewinds keep the count
        problems.append("a draw count out of range")
    if not MIN_BLOCK_TOKENS <= s.block_tokens <= MAX_BLOCK_TOKENS:
        problems.append(f"a block size outside [{MIN_BLOCK_TOKENS}, {MAX_BLOCK_TOKENS}]")
    if len(s.stop) > MAX_STOP_STRINGS or any(not x or len(x) > MAX_STOP_LENGTH for x in s.stop):
        problems.append("stop strings beyond the RPC limits")
    if len(s.label) > MAX_LABEL:
        problems.append("a label beyond the RPC limit")
    if len(s.messages) > MAX_MESSAGES or any(len(m.content) > MAX_MESSAGE_CHARS for m in s.messages):
        problems.append("messages beyond the RPC limits")
    if any(not 0 <= m.start <= len(s.tokens) for m in s.messages):
        problems.append("a message outside the history")
    if problems:
        raise CorruptCheckpoint("the checkpoint holds " + "; ".join(problems))
