"""The block store's interface: what every backend (`local`, `memory`, `redis`, `s3`)
provides, and the form of a key."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from typing import Protocol

from kvkeepd.errors import StoreReadFailed, StoreUnreachable

log = logging.getLogger(__name__)

KEY = re.compile(r"^[0-9a-f]{64}$")


class BlockStore(Protocol):
    """Durable (or not) key -> bytes storage for framed blocks."""

    # True for a store in this process's memory: its blocks were framed (or checked, when
    # imported) here and never left, so a read need not check their checksums again.
    in_process: bool
    #: Whether the blocks live on a server (listing them is expensive; they outlive this
    #: machine's disk). Remote stores' failures are StoreUnreachable / StoreReadFailed.
    remote: bool

    def has(self, key: str) -> bool: ...

    def present(self, keys: Sequence[str]) -> set[str]:
        """Which of these keys the store holds (one batch: a round trip, not one per key)."""
        ...

    def get(self, key: str) -> bytes:
        """The block's bytes; KeyError if absent."""
        ...

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The blocks of these keys that the store holds (absent ones left out), fetched
        concurrently or pipelined."""
        ...

    def read_into(self, key: str, parts: Sequence[memoryview]) -> bool:
        """Read the block straight into `parts`, one after another, when it holds exactly
        their bytes (a file store; a read that skips the copy from a `get`'s bytes). False,
        nothing promised of `parts`, where the block is of another size or the store cannot
        read in place; KeyError if absent."""
        ...

    def put(self, key: str, data: bytes) -> int:
        """Store a block unless present; returns the bytes written (0 if it was present).
        Once it returns, the block is durable."""
        ...

    def delete(self, key: str) -> None: ...

    def block_keys(self) -> Iterator[str]:
        """Every key held (a listing: for a remote store, as slow as the store is big)."""
        ...

    def total_bytes(self) -> int:
        """Bytes of the blocks held (a remote store: as its catalog records them)."""
        ...


def check_key(key: str) -> str:
    if not KEY.match(key):
        raise ValueError(f"bad block key {key[:80]!r}")
    return key


def read_failed(store: object, e: Exception) -> StoreReadFailed:
    """The error a remote store raises for a read that failed past its retries. The cause
    (which names the server and what it answered) goes to the daemon's log, not to the
    client."""
    log.error("cannot read the block store %s: %s", store, e)
    return StoreReadFailed("the block store cannot be read (see the daemon's log)")


def write_failed(store: object, e: Exception) -> StoreUnreachable:
    """The error a remote store raises for a write that failed past its retries, logged as
    `read_failed` is."""
    log.error("cannot write to the block store %s: %s", store, e)
    return StoreUnreachable(
        "the block store did not take the write (see the daemon's log); nothing was saved"
    )
