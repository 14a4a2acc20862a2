"""The console's JSON bodies: sessions, their trees, stored responses and the daemon at a
glance, built from what the SessionManager reports (plain dicts, as JSONResponse writes them).

A session's tree is its checkpoints (oldest first, each the state after `n_tokens` of its
history) and its forks: the sessions this daemon holds that were forked from it or from one of
its checkpoints (`forked_from`). Where each state lives is its tier: a session's is hot (a
slot), warm (a dock or RAM) or cold (stored, or only its history); a checkpoint's and a stored
response's is `stored`, in the durable store (persistent sessions, responses) or the
ephemeral one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvkeepd.config.settings import Settings
from kvkeepd.sessions.flows.response_list import StoredResponse
from kvkeepd.sessions.ledger import Counters
from kvkeepd.sessions.manager import SessionView
from kvkeepd.sessions.tenants import Tenant
from kvkeepd.storage.catalog import CheckpointRow, ListedSession
from kvkeepd.values.messages import ChatMessage


def expires_at(persistent: bool, last_used_at: float, settings: Settings) -> float:
    """When an idle session is closed (ephemeral) or deleted (persistent) at the earliest; 0:
    never."""
    ttl = settings.persistent_ttl if persistent else settings.idle_ttl
    return last_used_at + ttl if ttl > 0 else 0.0


def session_row(view: SessionView, settings: Settings) -> dict[str, Any]:
    """A session this daemon holds, as the list shows it."""
    s = view.session
    return {
        "session_id": s.session_id,
        "persistent": s.persistent,
        "n_tokens": view.n_tokens,
        "tier": view.tier,
        "holder": view.holder,
        "created_at": s.created_at,
        "last_used_at": s.last_used_at,
        "expires_at": expires_at(s.persistent, s.last_used_at, settings),
        "n_checkpoints": view.n_checkpoints,
        "n_messages": len(s.messages),
        "forked_from": s.forked_from,
    }


def listed_row(r: ListedSession, settings: Settings) -> dict[str, Any]:
    """A persistent session of a shared catalog that this daemon does not hold: its head."""
    return {
        "session_id": r.session_id,
        "persistent": True,
        "n_tokens": r.n_tokens,
        "tier": "cold",
        "holder": r.holder,
        "created_at": r.created_at,
        "last_used_at": r.last_used_at,
        "expires_at": expires_at(True, r.last_used_at, settings),
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


def checkpoint(r: CheckpointRow, persistent: bool) -> dict[str, Any]:
    """A checkpoint node: its label, tokens, bytes on disk and where it is kept."""
    return {
        "checkpoint_id": r.checkpoint_id,
        "session_id": r.session_id,
        "label": r.label,
        "n_tokens": r.n_tokens,
        "bytes_written": r.bytes_written,
        "bytes_referenced": r.bytes_referenced,
        "created_at": r.created_at,
        "tier": "stored",
        "store": "durable" if persistent else "ephemeral",
    }


def tree(
    view: SessionView,
    rows: Sequence[CheckpointRow],
    forks: Sequence[SessionView],
    settings: Settings,
) -> dict[str, Any]:
    """A session's tree: the session (with its conversation), its checkpoints and its forks."""
    persistent = view.session.persistent
    return {
        "session": session_row(view, settings) | {"messages": [message(m) for m in view.session.messages]},
        "checkpoints": [checkpoint(r, persistent) for r in rows],
        "forks": [session_row(f, settings) for f in forks],
    }


def response(r: StoredResponse) -> dict[str, Any]:
    """A stored response node (a tree of its own: each continues `previous_response_id`)."""
    return {
        "response_id": r.response_id,
        "previous_response_id": r.previous_response_id,
        "created_at": r.created_at,
        "n_tokens": r.n_tokens,
        "bytes_written": r.bytes_written,
        "bytes_referenced": r.bytes_referenced,
        "expires_at": r.expires_at,
        "tier": "stored",
        "store": "durable",
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
