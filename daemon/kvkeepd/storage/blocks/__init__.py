"""Block stores: where framed KV blocks live, by key. `local` (files), `memory` (RAM), and
the remote ones, `s3` (any S3-compatible object store) and `redis` (Redis or Valkey).

A store knows nothing of what a block means; keys are hex digests the daemon computes,
never names a client chose. Blocks are content-addressed and immutable: a put of a key
that is present changes nothing. A remote store is reached over the network, so what it
answers in bulk (`present`, `get_many`) is asked for in one round trip or in parallel, and
what would list it (`block_keys`) is never asked for on a hot path or at start.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvkeepd.storage.blocks.base import BlockStore


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
