"""The block store suite: the same tests against every backend — memory, local files, S3
(SeaweedFS's ``weed mini``) and Redis (``redis-server``), real servers on loopback.

Each backend gets: put/get/has/present/get_many/delete, a put of a present key changing
nothing, absent keys, keys that are not digests refused, damaged and truncated blocks found
by the checkpoint layer's checks (and removed), concurrent writers and readers. The remote
ones also: a server that does not answer (a dead port, or stopped) fails a write with
StoreUnreachable and a read with StoreReadFailed within the bounded timeout and retries, and
what Redis acknowledged survives its kill -9; at start, an S3 bucket that does not exist
stops the daemon, while a server that does not answer is only logged.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest
import redis
from servers import RedisServer, S3Server, free_port

from kvkeepd.errors import CorruptCheckpoint, StoreReadFailed, StoreUnreachable
from kvkeepd.state import frames as blk
from kvkeepd.storage.blocks.base import BlockStore
from kvkeepd.storage.blocks.local import LocalBlockStore
from kvkeepd.storage.blocks.memory import MemoryBlockStore
from kvkeepd.storage.blocks.redis import PREFIX, RedisBlockStore
from kvkeepd.storage.blocks.s3 import S3BlockStore
from kvkeepd.storage.catalog.sqlite import SqliteCatalog
from kvkeepd.storage.checkpoints import CheckpointStore

BACKENDS = ("memory", "local", "s3", "redis")
REMOTE = ("s3", "redis")
#: A remote request's timeout and retries in these tests: a dead server fails in about a second.
TIMEOUT, RETRIES = 0.5, 1


@dataclasses.dataclass
class Backend:
    """A store under test, and a way to overwrite a block's bytes behind its back."""

    name: str
    store: BlockStore
    tamper: Callable[[str, bytes], None]


def new_key() -> str:
    return secrets.token_hex(32)


def block(payload: bytes, codec: str = "none") -> bytes:
    return blk.frame(payload, codec)


def s3_store(server: S3Server, monkeypatch: pytest.MonkeyPatch, prefix: str) -> S3BlockStore:
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    return S3BlockStore(
        f"s3://{server.bucket}/{prefix}",
        endpoint=server.endpoint_url,
        timeout=TIMEOUT,
        retries=RETRIES,
        known_bytes=lambda: 0,
    )


def redis_store(url: str) -> RedisBlockStore:
    return RedisBlockStore(url, timeout=TIMEOUT, retries=RETRIES, known_bytes=lambda: 0)


@pytest.fixture(params=BACKENDS)
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Backend]:
    name: str = request.param
    if name == "memory":
        memory = MemoryBlockStore()
        yield Backend(name, memory, lambda key, data: memory._blocks.__setitem__(key, data))
    elif name == "local":
        local = LocalBlockStore(tmp_path / "blocks")

        def rewrite(key: str, data: bytes) -> None:
            (tmp_path / "blocks" / key[:2] / key).write_bytes(data)

        yield Backend(name, local, rewrite)
    elif name == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        prefix = f"t-{secrets.token_hex(4)}"
        s3 = s3_store(server, monkeypatch, prefix)
        raw = boto3.client("s3", endpoint_url=server.endpoint_url, region_name=server.region)
        yield Backend(
            name, s3, lambda key, data: raw.put_object(Bucket=server.bucket, Key=f"{prefix}/{key}", Body=data)
        )
        s3.close()
    else:
        url: str = request.getfixturevalue("redis_server")
        kv = redis_store(url)
        raw_redis = redis.Redis.from_url(url)
        yield Backend(name, kv, lambda key, data: raw_redis.set(PREFIX + key, data))
        kv.close()
        raw_redis.close()


def test_put_get_has_delete(backend: Backend) -> None:
    store = backend.store
    key, data = new_key(), block(os.urandom(5000))
    assert not store.has(key)
    assert store.put(key, data) == len(data)
    assert store.has(key)
    assert store.get(key) == data
    assert key in set(store.block_keys())
    store.delete(key)
    assert not store.has(key)
    with pytest.raises(KeyError):
        store.get(key)
    store.delete(key)  # deleting what is absent is no error


def test_a_put_of_a_present_key_changes_nothing(backend: Backend) -> None:
    store = backend.store
    key, first = new_key(), block(b"first" * 100)
    assert store.put(key, first) == len(first)
    assert store.put(key, block(b"other" * 100)) == 0
    assert store.get(key) == first


def test_bulk_reads_leave_absent_keys_out(backend: Backend) -> None:
    store = backend.store
    held = {new_key(): block(os.urandom(2000 + i)) for i in range(40)}
    for key, data in held.items():
        store.put(key, data)
    absent = [new_key() for _ in range(5)]
    asked = [*absent[:2], *held, *absent[2:]]
    assert store.present(asked) == set(held)
    assert store.get_many(asked) == held
    assert store.present([]) == set() and store.get_many([]) == {}


@pytest.mark.parametrize("bad", ["../../etc/passwd", "A" * 64, "ab", "0" * 63 + "/", ""])
def test_keys_that_are_not_digests_are_refused(backend: Backend, bad: str) -> None:
    with pytest.raises(ValueError):
        backend.store.put(bad, b"x")
    with pytest.raises(ValueError):
        backend.store.get(bad)


def checkpoints_on(store: BlockStore) -> CheckpointStore:
    """The checkpoint layer over `store`, which checks every block it reads."""
    return CheckpointStore(
        SqliteCatalog(":memory:"),
        store,
        b"k" * 32,
        fingerprint="f",
        layout=None,
        block_tokens=64,
        codec="none",
        n_vocab=8,
    )


# A flipped bit is for the stores whose blocks are checksummed again on read: blocks framed in
# this process's memory (the memory store) are trusted as they are.
DAMAGES = [
    (name, damage)
    for name in BACKENDS
    for damage in ("bit", "truncated", "empty")
    if not (name == "memory" and damage == "bit")
]


@pytest.mark.parametrize(("backend", "damage"), DAMAGES, indirect=["backend"])
def test_a_damaged_block_is_found_and_removed(backend: Backend, damage: str) -> None:
    store = backend.store
    assert not (store.in_process and damage == "bit")
    payload = os.urandom(4096)
    key, framed = new_key(), block(payload)
    store.put(key, framed)
    checkpoints = checkpoints_on(store)
    _, got = checkpoints.reads.block(key, len(payload), store.get)
    assert bytes(got) == payload
    if damage == "bit":
        bad = bytearray(framed)
        bad[-100] ^= 1
        assert zlib.crc32(bytes(bad[blk.FRAME_HEADER :])) != zlib.crc32(payload)
    else:
        bad = bytearray(framed[: len(framed) // 2] if damage == "truncated" else b"")
    backend.tamper(key, bytes(bad))
    with pytest.raises(CorruptCheckpoint):
        checkpoints.reads.block(key, len(payload), store.get)
    assert not store.has(key)  # removed: the next checkpoint of those tokens writes it again


def test_concurrent_writers_and_readers(backend: Backend) -> None:
    store = backend.store
    shared = {new_key(): block(os.urandom(3000 + i)) for i in range(8)}
    errors: list[BaseException] = []
    read_back: list[dict[str, bytes]] = []

    def work(i: int) -> None:
        try:
            own = {new_key(): block(os.urandom(1000 + i)) for _ in range(4)}
            for key, data in [*shared.items(), *own.items()]:
                store.put(key, data)
            read_back.append(store.get_many([*shared, *own]))
            assert read_back[-1] == {**shared, **own}
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert len(read_back) == 8
    assert store.get_many(list(shared)) == shared


# ---- remote stores: servers that do not answer --------------------------------------------


def dead_store(name: str, monkeypatch: pytest.MonkeyPatch) -> BlockStore:
    """A store whose server's port nothing listens on."""
    port = free_port()
    if name == "s3":
        server = S3Server(f"http://127.0.0.1:{port}", "kvkeep-test", "key", "secret")
        return s3_store(server, monkeypatch, "dead")
    return redis_store(f"redis://127.0.0.1:{port}/0")


@pytest.mark.parametrize("name", REMOTE)
def test_a_dead_server_fails_writes_and_reads_clearly_and_soon(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = dead_store(name, monkeypatch)
    started = time.monotonic()
    with pytest.raises(StoreUnreachable):
        store.put(new_key(), b"x" * 100)
    with pytest.raises(StoreReadFailed):
        store.get(new_key())
    with pytest.raises(StoreReadFailed):
        store.get_many([new_key(), new_key()])
    with pytest.raises(StoreReadFailed):
        store.present([new_key()])
    with pytest.raises(StoreUnreachable):
        store.delete(new_key())
    # Five operations, each bounded by (retries + 1) attempts of at most the timeout, plus backoff.
    assert time.monotonic() - started < 5 * (RETRIES + 1) * (TIMEOUT + 1.0)


def test_redis_stopped_and_started_again(start_redis: Callable[[], RedisServer]) -> None:
    server = start_redis()
    store = redis_store(server.url)
    kept = {new_key(): block(os.urandom(10_000)) for _ in range(3)}
    for key, data in kept.items():
        assert store.put(key, data) == len(data)
    server.kill()  # kill -9: what it acknowledged is on disk (appendfsync always)
    with pytest.raises(StoreUnreachable):
        store.put(new_key(), b"y")
    server.start()
    assert store.get_many(list(kept)) == kept  # the same client reconnects by itself
    key = new_key()
    assert store.put(key, b"z") == 1
    store.close()


def test_s3_at_start_a_missing_bucket_stops_the_daemon_and_a_dead_server_does_not(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = dataclasses.replace(s3_server, bucket=f"no-such-{secrets.token_hex(4)}")
    with pytest.raises(OSError, match="does not exist"):
        s3_store(missing, monkeypatch, "x").probe()
    dead_store("s3", monkeypatch).probe()  # only logged: saves fail until it answers
    dead_store("redis", monkeypatch).probe()
