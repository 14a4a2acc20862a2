"""A tenant's stored responses, listed a page at a time from the catalog.

A tenant that lost its response ids finds them here, and deleting them (Responses.delete)
frees the stored bytes they held against its quota. A page is read by the catalog's index
of the tenant's responses, ordered by creation then id, so it costs the same at 100,000
responses as at ten; its cursor is a response id (the last one of the page before), as in
OpenAI's list endpoints. Nothing of another tenant's is listed, and another tenant's id as
the cursor is NotFound like an unknown id, by the same path (one indexed lookup).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from kvkeepd.errors import InvalidRequest, NotFound
from kvkeepd.sessions.flows.responses import RESPONSE_ID_PREFIX, Responses, checkpoint_of
from kvkeepd.sessions.tenants import Tenant
from kvkeepd.storage.catalog import CheckpointRow
from kvkeepd.storage.checkpoints import CHECKPOINT_ID_PREFIX

#: Responses a page holds at most, and by default (OpenAI's list endpoints' bounds).
MAX_PAGE, PAGE = 100, 20
ORDERS = ("asc", "desc")
# What a record begins with (ResponseRecord.encode): the response it continues.
_PREVIOUS = re.compile(rb'^\{"previous_response_id":"(resp_[0-9a-f]{24})?"')


@dataclass(frozen=True)
class StoredResponse:
    """A stored response as a listing reports it."""

    response_id: str
    previous_response_id: str  # the response it continues ("": a conversation of its own)
    created_at: float
    n_tokens: int  # tokens of the conversation's state it holds
    bytes_written: int  # bytes of blocks its save added to the store
    bytes_referenced: int  # bytes of all the blocks it references, shared ones included
    expires_at: float  # when --response-ttl deletes it at the earliest (0: never)


@dataclass(frozen=True)
class ResponsePage:
    """Responses of one page, and whether more follow it in its order."""

    responses: tuple[StoredResponse, ...]
    has_more: bool


async def list_responses(
    responses: Responses, tenant: Tenant, *, after: str = "", limit: int = PAGE, order: str = "desc"
) -> ResponsePage:
    """Up to `limit` of the tenant's stored responses after the response `after` ("": from
    the first), oldest first ("asc") or newest first ("desc")."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"limit must be in [1, {MAX_PAGE}]")
    if order not in ORDERS:
        raise InvalidRequest("order must be asc or desc")
    cursor = checkpoint_of(after) if after else ""
    catalog = responses.durable.catalog
    found = await asyncio.to_thread(catalog.tenant_responses, tenant.name, cursor, limit + 1, order == "desc")
    if found is None:
        raise NotFound(f"no response {after[:80]!r}")
    ttl = responses.settings.response_ttl
    listed = tuple(_listed(row, head, ttl) for row, head in found[:limit])
    return ResponsePage(listed, has_more=len(found) > limit)


def _listed(row: CheckpointRow, head: bytes, ttl: float) -> StoredResponse:
    previous = _PREVIOUS.match(head)
    return StoredResponse(
        response_id=RESPONSE_ID_PREFIX + row.checkpoint_id.removeprefix(CHECKPOINT_ID_PREFIX),
        previous_response_id=previous.group(1).decode() if previous and previous.group(1) else "",
        created_at=row.created_at,
        n_tokens=row.n_tokens,
        bytes_written=row.bytes_written,
        bytes_referenced=row.bytes_referenced,
        expires_at=row.created_at + ttl if ttl > 0 else 0.0,
    )
