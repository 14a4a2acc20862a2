"""Block stores: where framed KV blocks live, by key. `local` (files) and `memory` (RAM).

A store knows nothing of what a block means; keys are hex digests the daemon computes,
never names a client chose.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Protocol

KEY = re.compile(r"^[0-9a-f]{64}$")


class BlockStore(Protocol):
    """Durable (or not) key -> bytes storage for framed blocks."""

    # True for a store in this process's memory: its blocks were framed (or checked, when
    # imported) here and never left, so a read need not check their checksums again.
    in_process: bool

    def has(self, key: str) -> bool: ...

    def get(self, key: str) -> bytes:
        """The block's bytes; KeyError if absent."""
        ...

    def put(self, key: str, data: bytes) -> int:
        """Store a block unless present; returns the bytes written (0 if it was present)."""
        ...

    def delete(self, key: str) -> None: ...

    def block_keys(self) -> Iterator[str]: ...

    def total_bytes(self) -> int: ...


def check_key(key: str) -> str:
    if not KEY.match(key):
        raise ValueError(f"bad block key {key[:80]!r}")
    return key
