"""Server-sent events, as every API of the HTTP door streams them."""

from __future__ import annotations

import json
from typing import Any

# A stream's response headers besides its media type: no cache holds an event back.
STREAM_HEADERS = {"cache-control": "no-cache"}


def sse(data: dict[str, Any] | str, event: str = "") -> bytes:
    """One server-sent event: `data` as JSON (or the text given), named `event` where given."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {text}\n\n".encode()
