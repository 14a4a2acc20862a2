"""A tenant's stored-bytes quota holds whatever saves race for it.

What a tenant stores is the distinct blocks its durable checkpoints reference (each once,
however many share it) plus each checkpoint's manifest and stored response record. Every
durable save reserves what it may add before it writes anything, atomically with every other
save on any daemon of its catalog; a save refused leaves nothing behind.

- The catalogs (sqlite and Redis): a reservation counts what the tenant stores, the saves
  under way and the save's own size (blocks the tenant already references are free, known
  blocks count at their recorded size); a commit turns it into what was stored; one let go
  frees its room; on Redis one that lapsed cannot be committed.
- One daemon, HTTP: a stored response larger than the quota is refused with the quota's
  429 and leaves no blocks, rows or response id; six stored responses sent at once from
  threads stay under the quota; a refused continuation leaves its conversation as it was.
- One daemon, gRPC: persistent sessions' heads and imports racing for one quota.
- Two daemons sharing a Redis catalog and store: six stored responses at once, split
  between them, stay under the one quota.
- Clients that leave streams at random points: every reservation ends, committed or let go.
"""

from __future__ import annotations

import io
import json
import random
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from auth import TOKENS, write_auth
from checkpoint_helpers import GREEDY, export_bytes, long_text
from daemons import InProcessDaemon, model_path
from servers import RedisServer

import kvkeep
from kvkeepd.errors import StaleClaim
from kvkeepd.storage.catalog import Catalog, CheckpointRow
from kvkeepd.storage.catalog.sqlite import SqliteCatalog

ANONYMOUS = ""
INPUT = (
    "Tell me about the harbour's ledgers: ships, tides, storms and cargo, what each records, who "
    "keeps them and how they are read. Say also where the ledgers are stored in winter, who may "
    "read them, and what happens to a ledger when its ship is lost at sea."
)


# ---- the catalogs ------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "redis"])
def catalog(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Catalog]:
    made: Catalog
    if request.param == "sqlite":
        made = SqliteCatalog(tmp_path / "catalog.db")
    else:
        from kvkeepd.storage.catalog.redis import RedisCatalog

        url = request.getfixturevalue("redis_server")
        made = RedisCatalog(f"{url}?prefix=quota-{secrets.token_hex(6)}")
    yield made
    made.close()


def key(n: int) -> str:
    return f"{n:064x}"


def row(tenant: str, kind: str = "explicit") -> CheckpointRow:
    return CheckpointRow(
        checkpoint_id="c_" + secrets.token_hex(12),
        session_id="s_" + secrets.token_hex(12),
        label="",
        kind=kind,
        n_tokens=64,
        bytes_written=0,
        bytes_referenced=0,
        created_at=1.0,
        tenant=tenant,
    )


def test_a_reservation_counts_what_the_save_adds(catalog: Catalog) -> None:
    catalog.add_checkpoint(row("t"), b"m" * 10, [(key(1), 100), (key(2), 50)], now=1.0)
    catalog.add_checkpoint(row("u"), b"n", [(key(5), 30)], now=1.0)
    assert catalog.stored_bytes("t") == 160 and catalog.stored_bytes("u") == 31

    # key 1 is the tenant's already (free); key 3 is unknown (its bound counts).
    first = catalog.reserve_stored("t", [(key(1), 999), (key(3), 40)], 5, limit=210)
    assert first.reservation_id and (first.held, first.needed) == (160, 45)
    # The room the first holds is taken: 160 + 45 + 10 > 210.
    refused = catalog.reserve_stored("t", [(key(4), 10)], 0, limit=210)
    assert (refused.reservation_id, refused.held, refused.needed) == ("", 205, 10)
    # Another tenant's block counts at its recorded size (30), not the bound given.
    assert catalog.reserve_stored("t", [(key(5), 999)], 0, limit=234).reservation_id == ""
    other = catalog.reserve_stored("t", [(key(5), 999)], 0, limit=235)
    assert other.needed == 30
    catalog.release_stored("t", other.reservation_id)
    # Another tenant's room is its own.
    assert catalog.reserve_stored("u", [(key(4), 10)], 0, limit=41).reservation_id

    # The commit turns the reservation into what it stored (5 bytes of manifest, 40 of block).
    catalog.add_checkpoint(
        row("t"), b"12345", [(key(1), 100), (key(3), 40)], now=2.0, reservation=first.reservation_id
    )
    assert catalog.stored_bytes("t") == 205
    last = catalog.reserve_stored("t", [(key(4), 5)], 0, limit=210)
    assert last.reservation_id and last.held == 205
    catalog.release_stored("t", last.reservation_id)
    catalog.release_stored("t", last.reservation_id)  # once gone, no error
    assert catalog.reserve_stored("t", [(key(4), 5)], 0, limit=210).held == 205


def test_a_lapsed_reservation_is_not_committed(redis_server: str) -> None:
    from kvkeepd.storage.catalog.redis import RedisCatalog

    catalog = RedisCatalog(f"{redis_server}?prefix=quota-{secrets.token_hex(6)}", grace=0.5)
    try:
        late = catalog.reserve_stored("t", [(key(1), 100)], 0, limit=150)
        assert late.reservation_id
        assert not catalog.reserve_stored("t", [(key(2), 100)], 0, limit=150).reservation_id
        time.sleep(1.0)
        # Lapsed: its room is free again, and its save's commit is refused.
        assert catalog.reserve_stored("t", [(key(2), 100)], 0, limit=150).held == 0
        r = row("t")
        with pytest.raises(StaleClaim):
            catalog.add_checkpoint(r, b"m", [(key(1), 100)], now=2.0, reservation=late.reservation_id)
        assert catalog.get(r.checkpoint_id) is None
    finally:
        catalog.close()


# ---- daemons -----------------------------------------------------------------------------------


def http(d: InProcessDaemon) -> str:
    assert d.daemon is not None
    return f"http://127.0.0.1:{d.daemon.http_port}/v1"


def body(n: int, **extra: Any) -> dict[str, Any]:
    """A stored response's request; `n` makes its conversation (and so its blocks) its own."""
    return {
        "model": model_path().stem,
        "instructions": f"You are archivist number {n} of the harbour town.",
        "input": INPUT,
        "max_output_tokens": 8,
        "temperature": 0,
        **extra,
    }


def respond(
    d: InProcessDaemon, n: int, headers: dict[str, str] | None = None, **extra: Any
) -> httpx.Response:
    return httpx.post(f"{http(d)}/responses", json=body(n, **extra), headers=headers, timeout=300)


def catalog_of(d: InProcessDaemon) -> Catalog:
    assert d.daemon is not None and d.daemon.manager is not None
    return d.daemon.manager.stores.durable.catalog


def stored(d: InProcessDaemon, tenant: str = ANONYMOUS) -> int:
    return catalog_of(d).stored_bytes(tenant)


def nothing_left_behind(d: InProcessDaemon, quota: int, tenant: str = ANONYMOUS) -> None:
    """Every block in the store is one the catalog records, each referenced by a committed
    checkpoint (refused saves wrote none), and no reservation is held: the whole room left
    under the quota can be reserved."""
    assert d.daemon is not None and d.daemon.manager is not None
    d.run(d.daemon.manager.settle(), timeout=120)
    durable = d.daemon.manager.stores.durable
    catalog = durable.catalog
    assert set(durable.store.block_keys()) == catalog.known_blocks()
    assert catalog.unreferenced() == []
    room = catalog.reserve_stored(tenant, [], quota - catalog.stored_bytes(tenant), quota)
    assert room.reservation_id, f"reservations are held: {room}"
    catalog.release_stored(tenant, room.reservation_id)


def at_once(n: int, call: Callable[[int], Any]) -> list[Any]:
    """`call(i)` for i in range(n), from n threads at once; each result or exception."""

    def attempt(i: int) -> Any:
        try:
            return call(i)
        except Exception as e:
            return e

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(attempt, range(n)))


def text(r: httpx.Response) -> str:
    return "".join(part["text"] for item in r.json()["output"] for part in item["content"])


def refused_for_quota(r: httpx.Response) -> bool:
    return r.status_code == 429 and "quota" in r.json()["error"]["message"]


def test_a_response_larger_than_the_quota_is_refused_and_leaves_nothing(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    quota = 400_000
    d = start_daemon(http_address="127.0.0.1:0", tenant_quota=f"stored_bytes={quota}")
    r = respond(d, 1)
    assert refused_for_quota(r), (r.status_code, r.text)
    # Streamed, its id is sent before the save: it names nothing afterwards.
    with httpx.stream("POST", f"{http(d)}/responses", json=body(2, stream=True), timeout=300) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    response_id = events[0]["response"]["id"]
    failed = events[-1]
    assert failed["type"] == "response.failed" and "quota" in failed["response"]["error"]["message"]
    assert httpx.get(f"{http(d)}/responses/{response_id}", timeout=30).status_code == 404
    assert stored(d) == 0 and catalog_of(d).known_blocks() == set()
    nothing_left_behind(d, quota)


def test_stored_responses_sent_at_once_stay_under_the_quota(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    quota = 4_000_000
    d = start_daemon(http_address="127.0.0.1:0", tenant_quota=f"stored_bytes={quota}", slots=6)
    results = at_once(6, lambda i: respond(d, i))
    codes = sorted(r.status_code for r in results)
    assert codes[0] == 200 and all(refused_for_quota(r) for r in results if r.status_code != 200), codes
    assert 0 < stored(d) <= quota, f"{stored(d)} bytes held: {stored(d) / quota:.2f}x the quota"
    kept = [r.json()["id"] for r in results if r.status_code == 200]
    for response_id in kept:
        assert httpx.get(f"{http(d)}/responses/{response_id}", timeout=30).status_code == 200
    assert len(catalog_of(d).old_responses(float("inf"), 100)) == len(kept)
    nothing_left_behind(d, quota)


def test_a_refused_continuation_leaves_its_conversation_as_it_was(
    start_daemon: Callable[..., InProcessDaemon], tmp_path: Path
) -> None:
    auth = tmp_path / "auth.toml"
    big = {"alice": {"max_stored_bytes": 50_000_000}}
    d = start_daemon(http_address="127.0.0.1:0", auth_file=write_auth(auth, TOKENS, big))
    assert d.daemon is not None
    alice = {"authorization": f"Bearer {TOKENS['alice']}"}
    first = respond(d, 1, alice)
    assert first.status_code == 200
    held, blocks = stored(d, "alice"), catalog_of(d).known_blocks()
    # Room for a little more, not for the next turn's blocks.
    write_auth(auth, TOKENS, {"alice": {"max_stored_bytes": held + 1000}})
    d.run(d.daemon.reload_tenants())
    turn = {"previous_response_id": first.json()["id"], "input": "And in summer?"}
    refused = respond(d, 1, alice, **turn)
    assert refused_for_quota(refused), (refused.status_code, refused.text)
    assert stored(d, "alice") == held and catalog_of(d).known_blocks() == blocks
    unstored = respond(d, 1, alice, store=False, **turn)
    assert unstored.status_code == 200
    write_auth(auth, TOKENS, big)
    d.run(d.daemon.reload_tenants())
    again = respond(d, 1, alice, **turn)
    assert again.status_code == 200
    # The conversation continued from the first response, as if the refused turn never was.
    assert text(again) == text(unstored) != ""
    assert again.json()["usage"]["input_tokens"] == unstored.json()["usage"]["input_tokens"]


def test_heads_and_imports_racing_stay_under_the_quota(
    start_daemon: Callable[..., InProcessDaemon], tmp_path: Path
) -> None:
    quota = 6_000_000
    d = start_daemon(tenant_quota=f"stored_bytes={quota}", slots=6, head_interval=1)
    with kvkeep.Client(d.address, timeout=300) as c:
        source = c.create_session(sampling=GREEDY)
        source.complete(long_text(8, "ledger"), max_tokens=1)  # ephemeral: stores nothing
        data = export_bytes(c, source.checkpoint("to import").checkpoint_id, tmp_path / "x.kvst")
        assert stored(d) == 0

        def act(i: int) -> Any:
            if i % 2:
                return c.import_checkpoint(io.BytesIO(data))
            s = c.create_session(sampling=GREEDY, persistent=True)  # a head of no blocks
            try:
                return s.complete(long_text(8, f"ship {i}"), max_tokens=2)
            except kvkeep.BusyError:
                assert s.info().n_tokens == 0  # the turn was undone: nothing was kept
                raise

        results = at_once(6, act)
        errors = [r for r in results if isinstance(r, Exception)]
        assert errors and len(errors) < 6, results
        assert all(isinstance(e, kvkeep.BusyError) and "quota" in str(e) for e in errors), errors
        assert stored(d) <= quota, f"{stored(d)} bytes held: {stored(d) / quota:.2f}x the quota"
        imported = [r for r in results if isinstance(r, kvkeep.CheckpointInfo)]
        listed = [ck for ck in c.list_checkpoints() if ck.label == "to import" and not ck.session_id]
        assert len(listed) == len(imported)
    nothing_left_behind(d, quota)


def test_each_save_of_a_persistent_session_counts_its_own_size(
    start_daemon: Callable[..., InProcessDaemon], tmp_path: Path
) -> None:
    auth = tmp_path / "auth.toml"
    d = start_daemon(auth_file=write_auth(auth, TOKENS), head_interval=1)
    assert d.daemon is not None
    with kvkeep.Client(d.address, timeout=120, token=TOKENS["alice"]) as c:
        s = c.create_session(sampling=GREEDY, persistent=True)
        s.complete(long_text(4, "tide"), max_tokens=2)
        held, n_tokens = stored(d, "alice"), s.info().n_tokens
        # Under the quota still, but without room for a manifest more.
        write_auth(auth, TOKENS, {"alice": {"max_stored_bytes": held + 100}})
        d.run(d.daemon.reload_tenants())
        for call in (
            s.checkpoint,
            lambda: s.fork(persistent=True),
            lambda: s.complete(" more", max_tokens=2),
        ):
            with pytest.raises(kvkeep.BusyError, match="quota"):
                call()
        assert s.info().n_tokens == n_tokens and c.list_checkpoints(s.session_id) == []
        assert [x.session_id for x in c.list_sessions()] == [s.session_id]
        assert stored(d, "alice") == held
        s.fork()  # an ephemeral fork stores nothing


def test_daemons_sharing_a_catalog_share_the_quota(
    start_redis: Callable[[], RedisServer], start_daemon: Callable[..., InProcessDaemon]
) -> None:
    # (The daemons stop before their Redis: fixtures end in the reverse order.)
    quota = 4_000_000
    redis = start_redis()
    shared = {
        "catalog": f"{redis.url}?prefix=quota",
        "store": redis.url,
        "store_key": secrets.token_hex(32),
        "http_address": "127.0.0.1:0",
        "tenant_quota": f"stored_bytes={quota}",
        "slots": 3,
    }
    a, b = start_daemon(daemon_name="a", **shared), start_daemon(daemon_name="b", **shared)
    results = at_once(6, lambda i: respond((a, b)[i % 2], i))
    codes = sorted(r.status_code for r in results)
    assert codes[0] == 200 and all(refused_for_quota(r) for r in results if r.status_code != 200), codes
    assert 0 < stored(a) <= quota, f"{stored(a)} bytes held: {stored(a) / quota:.2f}x the quota"
    for d in (a, b):
        nothing_left_behind(d, quota)


def test_clients_that_leave_mid_response_leave_no_reservation(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    quota = 8_000_000
    d = start_daemon(http_address="127.0.0.1:0", tenant_quota=f"stored_bytes={quota}", slots=6)
    rng = random.Random(secrets.randbits(32))

    def leave_early(i: int) -> int:
        """Read a random number of the stream's lines (maybe all), then leave."""
        keep = rng.randrange(0, 40)
        with httpx.stream("POST", f"{http(d)}/responses", json=body(i, stream=True), timeout=300) as s:
            for n, _ in enumerate(s.iter_lines()):
                if n >= keep:
                    break
        return keep

    for _ in range(2):
        at_once(6, leave_early)
    assert stored(d) <= quota, f"{stored(d)} bytes held: {stored(d) / quota:.2f}x the quota"
    for checkpoint_id in catalog_of(d).old_responses(float("inf"), 100):
        response_id = "resp_" + checkpoint_id.removeprefix("c_")
        assert httpx.get(f"{http(d)}/responses/{response_id}", timeout=30).status_code == 200
    nothing_left_behind(d, quota)
