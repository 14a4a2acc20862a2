"""Daemons whose persistent sessions keep their blocks on a real server: S3 (``weed mini``)
and Redis (``redis-server``), on loopback; the catalog stays the local sqlite one.

- A persistent session saved, restarted and continued gives exactly the tokens (and
  log-probabilities) of one uninterrupted run, and so does its checkpoint restored after
  the restart; its blocks are on the server, none in the state directory.
- The server stopped: a checkpoint and a turn of a persistent session fail with UNAVAILABLE
  (``store-unreachable``), the turn is undone, no catalog entry points at a block the server
  lacks, the daemon keeps serving (an ephemeral session generates); once the server is back,
  the same requests succeed and the earlier checkpoint continues exactly.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from checkpoint_helpers import PROMPT, SAMPLED, gen, own_daemon
from daemons import check_serving
from servers import RedisServer, S3Server, WeedMini

import kvstash
from kvstashd.store import BlockStore
from kvstashd.store.redis import RedisBlockStore
from kvstashd.store.s3 import S3BlockStore

#: Remote requests in these tests: a stopped server fails a request in about a second.
REMOTE = {"store_timeout": 0.5, "store_retries": 1}


def catalog_blocks(state_dir: Path) -> set[str]:
    """Every block a committed checkpoint references."""
    db = sqlite3.connect(state_dir / "catalog.db")
    try:
        return {r[0] for r in db.execute("SELECT DISTINCT block FROM refs")}
    finally:
        db.close()


def store_of(url: str, endpoint: str = "") -> BlockStore:
    """A client of the same store the daemon writes, for the test to look into."""
    if url.startswith("s3://"):
        return S3BlockStore(url, endpoint=endpoint, timeout=5, retries=1, known_bytes=lambda: 0)
    return RedisBlockStore(url, timeout=5, retries=1, known_bytes=lambda: 0)


@pytest.fixture(params=["s3", "redis"])
def remote(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """The settings of a daemon whose durable store is the shared S3 or Redis server."""
    if request.param == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        return {"store": f"s3://{server.bucket}/{tmp_path.name}", "s3_endpoint": server.endpoint_url}
    url: str = request.getfixturevalue("redis_server")
    return {"store": url}


def reference(client: kvstash.Client, n: int) -> list[tuple[int, float]]:
    """n tokens of PROMPT in one uninterrupted call (an ephemeral session)."""
    s = client.create_session(sampling=SAMPLED)
    try:
        return gen(s, PROMPT, n)
    finally:
        s.close()


def test_a_persistent_session_restarts_and_continues_exactly(tmp_path: Path, remote: dict[str, Any]) -> None:
    state = tmp_path / "state"
    with own_daemon(state, **remote, **REMOTE) as d, kvstash.Client(d.address, timeout=120) as client:
        ref = reference(client, 48)
        s = client.create_session(sampling=SAMPLED, persistent=True)
        assert gen(s, PROMPT, 16) == ref[:16]
        ck = s.checkpoint("half")
        assert gen(s, "", 16) == ref[16:32]
        n_tokens = s.info().n_tokens

    assert not (state / "blocks").exists(), "the blocks are on the server, not in the state directory"
    referenced = catalog_blocks(state)
    assert referenced
    assert store_of(remote["store"], remote.get("s3_endpoint", "")).present(sorted(referenced)) == referenced

    with own_daemon(state, **remote, **REMOTE) as d, kvstash.Client(d.address, timeout=120) as client:
        resumed = client.session(s.session_id)
        assert resumed.info().n_tokens == n_tokens
        assert gen(resumed, "", 16) == ref[32:]
        assert resumed.restore(ck.checkpoint_id).n_tokens == ck.n_tokens
        assert gen(resumed, "", 32) == ref[16:]


@pytest.fixture(params=["s3", "redis"])
def own_server(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    start_redis: Callable[[], RedisServer],
) -> Iterator[tuple[dict[str, Any], Callable[[], None], Callable[[], None]]]:
    """A server of the test's own: (daemon settings, stop it, start it again)."""
    if request.param == "redis":
        redis = start_redis()
        yield {"store": redis.url}, redis.kill, redis.start
        return
    weed = WeedMini(tmp_path / "weed").start()
    for name, value in weed.server.env.items():
        monkeypatch.setenv(name, value)
    try:
        yield (
            {"store": f"s3://{weed.bucket}/blocks", "s3_endpoint": weed.server.endpoint_url},
            weed.stop,
            weed.start,
        )
    finally:
        weed.stop()


def test_a_stopped_server_fails_saves_with_unavailable_and_loses_nothing(
    tmp_path: Path, own_server: tuple[dict[str, Any], Callable[[], None], Callable[[], None]]
) -> None:
    settings, stop, start = own_server
    state = tmp_path / "state"
    with own_daemon(state, **settings, **REMOTE) as d, kvstash.Client(d.address, timeout=120) as client:
        ref = reference(client, 40)
        s = client.create_session(sampling=SAMPLED, persistent=True)
        assert gen(s, PROMPT, 8) == ref[:8]
        good = s.checkpoint("good")
        assert gen(s, "", 8) == ref[8:16]
        n_tokens = s.info().n_tokens
        checkpoints = {c.checkpoint_id for c in s.checkpoints()}

        stop()
        with pytest.raises(kvstash.StoreUnreachableError):
            s.checkpoint("while-down")
        with pytest.raises(kvstash.StoreUnreachableError) as turn:
            gen(s, "", 8)
        assert turn.value.code == "UNAVAILABLE"
        assert s.info().n_tokens == n_tokens  # the turn was undone
        assert {c.checkpoint_id for c in s.checkpoints()} == checkpoints
        check_serving(client)  # ephemeral sessions do not need the store

        start()
        assert store_of(settings["store"], settings.get("s3_endpoint", "")).present(
            sorted(catalog_blocks(state))
        ) == catalog_blocks(state), "a catalog entry points at a block the server lacks"
        # The same turn, sent again, is saved (its draws come after the undone turn's: the
        # sampler's counter goes on, so it is compared through the checkpoint below).
        gen(s, "", 8)
        assert s.checkpoint("again").n_tokens == n_tokens + 8
        assert s.restore(good.checkpoint_id).n_tokens == good.n_tokens
        assert gen(s, "", 32) == ref[8:]
