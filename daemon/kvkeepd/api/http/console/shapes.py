"""The console's JSON bodies: sessions, their trees, stored responses and the daemon at a
glance, built from what the SessionManager reports (plain dicts, as JSONResponse writes them).

A session's tree is its checkpoints (oldest first, each the state after `n_tokens` of its
history) and its forks: the sessions this daemon holds that were forked from it or from one of
its checkpoints (`forked_from`). Where each state lives is its `location`: a session's is
"slot N", "dock", "ram", "disk", "shared store" (a remote block store) or "history only", and
its tier hot (a slot), warm (a dock or RAM) or cold (stored, or only its history); a
checkpoint's and a stored response's tier is `stored`, their `store` durable (persistent
sessions, responses), shared (the durable store, remote) or ephemeral (kept in RAM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvkeepd.config.settings import Settings
from kvkeepd.sessions.flows.response_list import StoredResponse
from kvkeepd.sessions.ledger import Counters
from kvkeepd.sessions.manager import SessionView
from kvkeepd.sessions.placement import SHARED_STORE
from kvkeepd.sessions.tenants import Tenant
from kvkeepd.storage.catalog import CheckpointRow, ListedSession
from kvkeepd.values.messages import ChatMessage


def session_row(view: SessionView) -> dict[str, Any]:
    """A session this daemon holds, as the list shows it."""
    s = view.session
    return {
        "session_id": s.session_id,
        "persistent": s.persistent,
        "n_tokens": view.n_tokens,
        "tier": view.tier,
        "location": view.location,
        "holder": view.holder,
        "created_at": s.created_at,
        "last_used_at": s.last_used_at,
        "expires_at": view.expires_at,
        "n_checkpoints": view.n_checkpoints,
        "n_messages": len(s.messages),
        "forked_from": s.forked_from,
    }


def listed_row(r: ListedSession, location: str, expires_at: float) -> dict[str, Any]:
    """A persistent session of a shared catalog that this daemon does not hold: its head, in
    the durable store (`location`)."""
    return {
        "session_id": r.session_id,
        "persistent": True,
        "n_tokens": r.n_tokens,
        "tier": "cold",
        "location": location,
        "holder": r.holder,
        "created_at": r.created_at,
        "last_used_at": r.last_used_at,
        "expires_at": expires_at,
        "n_checkpoints": r.n_checkpoints,
        "n_messages": 0,
        "forked_from": "",
    }


def message(m: ChatMessage) -> dict[str, Any]:
    """A recorded message: its role, text, tool calls and where its tokens begin."""
    return {
        "role": m.role,
        "content": m.content,
        "start": m.start,
        "tool_calls": [
            {"call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls
        ],
        "tool_call_id": m.tool_call_id,
    }


def store(persistent: bool, location: str) -> str:
    """The store a checkpoint is kept in: durable, shared (durable and remote) or ephemeral."""
    if not persistent:
        return "ephemeral"
    return "shared" if location == SHARED_STORE else "durable"


def checkpoint(r: CheckpointRow, persistent: bool, location: str) -> dict[str, Any]:
    """A checkpoint node: its label, tokens, bytes written to its store and where it is kept
    (`location`: the store's "disk", "shared store" or "ram")."""
    return {
        "checkpoint_id": r.checkpoint_id,
        "session_id": r.session_id,
        "label": r.label,
        "n_tokens": r.n_tokens,
        "bytes_written": r.bytes_written,
        "bytes_referenced": r.bytes_referenced,
        "created_at": r.created_at,
        "tier": "stored",
        "store": store(persistent, location),
        "location": location,
    }


def tree(
    view: SessionView,
    rows: Sequence[CheckpointRow],
    forks: Sequence[SessionView],
    location: str,
) -> dict[str, Any]:
    """A session's tree: the session (with its conversation), its checkpoints (kept at
    `location`) and its forks."""
    persistent = view.session.persistent
    return {
        "session": session_row(view) | {"messages": [message(m) for m in view.session.messages]},
        "checkpoints": [checkpoint(r, persistent, location) for r in rows],
        "forks": [session_row(f) for f in forks],
    }


def response(r: StoredResponse, location: str) -> dict[str, Any]:
    """A stored response node (a tree of its own: each continues `previous_response_id`),
    kept in the durable store (`location`)."""
    return {
        "response_id": r.response_id,
        "previous_response_id": r.previous_response_id,
        "created_at": r.created_at,
        "n_tokens": r.n_tokens,
        "bytes_written": r.bytes_written,
        "bytes_referenced": r.bytes_referenced,
        "expires_at": r.expires_at,
        "tier": "stored",
        "store": store(True, location),
        "location": location,
    }


def glance(
    settings: Settings,
    model: dict[str, Any],
    mine: Counters,
    daemon: Counters,
    tenant: Tenant,
    console: str,
) -> dict[str, Any]:
    """The daemon at a glance: its model and mode, slots, budgets and what of them is used,
    the caller's quotas and counts, and the counters the metrics export."""
    t = mine.tally
    q = tenant.quota
    return {
        "model": model,
        "console": console,
        "slots": settings.slots,
        "slots_in_use": daemon.slots_in_use,
        "budgets": {
            "ram_bytes": settings.ram_cache,
            "ram_used_bytes": daemon.parked_bytes + daemon.whole_bytes,
            "disk_bytes": settings.disk_budget,
            "disk_used_bytes": daemon.store_bytes,
        },
        "ttl": {
            "idle_seconds": settings.idle_ttl,
            "persistent_seconds": settings.persistent_ttl,
            "response_seconds": settings.response_ttl,
        },
        "tenant": {
            "name": tenant.name,
            "quota": {
                "sessions": q.max_sessions,
                "parked_bytes": q.max_parked_bytes,
                "stored_bytes": q.max_stored_bytes,
            },
            "sessions": {"total": mine.sessions, "hot": mine.hot, "warm": mine.warm, "cold": mine.cold},
        },
        "counters": {
            "tokens_evaluated": t.tokens_evaluated,
            "tokens_generated": t.tokens_generated,
            "tokens_reused": t.tokens_reused,
            "swap_ins": t.swap_ins,
            "swap_in_seconds": t.swap_in_seconds,
        },
    }
