"""Blocks in Redis (or Valkey): one string per block, `kvkeep:block:KEY`.

A put is `SET ... NX` (a key that is present is left as it is: blocks are immutable), and is
acknowledged durable as far as the server's persistence makes it: with `appendonly yes` and
`appendfsync always` Redis answers a write only once its log is fsynced, so the daemon says at
start when the server is set up otherwise, and when it may evict keys (`maxmemory-policy`
other than `noeviction`: an evicted block would leave a checkpoint without its state).
Bulk reads are one round trip: `EXISTS` pipelined, `MGET` in batches of about 32 MiB.

Every command has a timeout and a bounded number of retries with backoff (all of them are
idempotent, so a retry after a lost reply is harmless); a write that still fails is
StoreUnreachable (UNAVAILABLE), or StoreWriteFailed when the server is out of memory; a read
that fails is StoreReadFailed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvkeepd.errors import StoreWriteFailed
from kvkeepd.storage.blocks.base import check_key, read_failed, write_failed
from kvkeepd.urls import redacted

log = logging.getLogger(__name__)

PREFIX = "kvkeep:block:"
# Blocks per MGET: a 64-token block of SmolLM2 is 1.5 MB, so a batch is about 32 MiB.
_BATCH = 24


class RedisBlockStore:
    remote = True
    in_process = False

    def __init__(self, url: str, *, timeout: float, retries: int, known_bytes: Callable[[], int]) -> None:
        """`url`: redis:// or rediss:// (TLS), with its database number; `known_bytes()`:
        the bytes of blocks the catalog records, which is what `total_bytes` reports."""
        self.url = url
        self._known_bytes = known_bytes
        self._redis = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            health_check_interval=30,
        )

    def probe(self) -> None:
        """Check the server now and warn about settings that lose blocks. A server that does
        not answer is only logged: saves fail with UNAVAILABLE until it does."""
        try:
            persistence = self._redis.info("persistence")
            memory = self._redis.info("memory")
        except redis.RedisError as e:
            log.warning("the block store %s does not answer now (%s): saves fail until it does", self, e)
            return
        if not persistence.get("aof_enabled"):
            log.warning(
                "the block store %s does not log writes (appendonly no): blocks it acknowledged "
                "can be lost when it stops; run it with appendonly yes and appendfsync always",
                self,
            )
        policy = memory.get("maxmemory_policy", "noeviction")
        if policy != "noeviction":
            log.warning(
                "the block store %s may evict keys (maxmemory-policy %s): an evicted block "
                "leaves its checkpoints without their state; use noeviction",
                self,
                policy,
            )

    def __str__(self) -> str:
        return redacted(self.url)

    def has(self, key: str) -> bool:
        return bool(self.present([key]))

    def present(self, keys: Sequence[str]) -> set[str]:
        if not keys:
            return set()
        try:
            with self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(PREFIX + check_key(key))
                found = pipe.execute()
        except redis.RedisError as e:
            raise read_failed(self, e) from None
        return {k for k, n in zip(keys, found, strict=True) if n}

    def get(self, key: str) -> bytes:
        found = self.get_many([key])
        if key not in found:
            raise KeyError(key)
        return found[key]

    def read_into(self, key: str, parts: Sequence[memoryview]) -> bool:
        """A server's reply arrives as bytes: there is no read in place."""
        return False

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        if not keys:
            return out
        try:
            with self._redis.pipeline(transaction=False) as pipe:
                for at in range(0, len(keys), _BATCH):
                    pipe.mget([PREFIX + check_key(k) for k in keys[at : at + _BATCH]])
                batches = pipe.execute()
        except redis.RedisError as e:
            raise read_failed(self, e) from None
        for at, values in zip(range(0, len(keys), _BATCH), batches, strict=True):
            for key, value in zip(keys[at : at + _BATCH], values, strict=True):
                if value is not None:
                    out[key] = bytes(value)
        return out

    def put(self, key: str, data: bytes) -> int:
        try:
            written = self._redis.set(PREFIX + check_key(key), data, nx=True)
        except redis.ResponseError as e:
            if str(e).startswith("OOM"):
                log.error("the block store %s is full: %s", self, e)
                raise StoreWriteFailed("the block store is full; nothing was saved") from None
            raise write_failed(self, e) from None
        except redis.RedisError as e:
            raise write_failed(self, e) from None
        return len(data) if written else 0

    def delete(self, key: str) -> None:
        try:
            self._redis.delete(PREFIX + check_key(key))
        except redis.RedisError as e:
            raise write_failed(self, e) from None

    def block_keys(self) -> Iterator[str]:
        try:
            for name in self._redis.scan_iter(match=PREFIX + "*", count=1000):
                key = name.decode() if isinstance(name, bytes) else str(name)
                yield key[len(PREFIX) :]
        except redis.RedisError as e:
            raise read_failed(self, e) from None

    def total_bytes(self) -> int:
        return self._known_bytes()

    def close(self) -> None:
        self._redis.close()
