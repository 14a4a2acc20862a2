"""Block stores: where framed KV blocks live, by key. `local` (files), `memory` (RAM), and
the remote ones, `s3` (any S3-compatible object store) and `redis` (Redis or Valkey).

A store knows nothing of what a block means; keys are hex digests the daemon computes,
never names a client chose. Blocks are content-addressed and immutable: a put of a key
that is present changes nothing. A remote store is reached over the network, so what it
answers in bulk (`present`, `get_many`) is asked for in one round trip or in parallel, and
what would list it (`block_keys`) is never asked for on a hot path or at start.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

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


def redacted(url: str) -> str:
    """A URL with its password replaced by `***` (for logs and --print-config)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    auth, _, host = rest.rpartition("@")
    user, colon, _ = auth.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}"


def open_durable(
    spec: str,
    root: Path,
    *,
    s3_endpoint: str,
    timeout: float,
    retries: int,
    known_bytes: Callable[[], int],
) -> BlockStore:
    """The durable block store `--store` names: `local` (files under `root`),
    `s3://BUCKET/PREFIX` or `redis://...` (`known_bytes`: what the catalog records of it, the
    budget's count for a store that is not listed). OSError when its extra is not installed."""
    if spec == "local":
        from kvkeepd.storage.blocks.local import LocalBlockStore

        return LocalBlockStore(root)
    if spec.startswith("s3://"):
        try:
            from kvkeepd.storage.blocks.s3 import S3BlockStore
        except ImportError as e:
            raise OSError(
                f"--store {spec} needs the S3 extra ({e.name} is missing): pip install 'kvkeep[s3]'"
            ) from None
        s3 = S3BlockStore(
            spec, endpoint=s3_endpoint, timeout=timeout, retries=retries, known_bytes=known_bytes
        )
        s3.probe()
        return s3
    from kvkeepd.storage.blocks.redis import RedisBlockStore  # redis-py is one of the daemon's own

    kv = RedisBlockStore(spec, timeout=timeout, retries=retries, known_bytes=known_bytes)
    kv.probe()
    return kv
