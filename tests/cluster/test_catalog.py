"""The catalog, the same tests against each backend: the embedded sqlite one and Redis (a real
redis-server on loopback, each test under a key prefix of its own). Leases and fencing, which
only a shared catalog enforces, and outages of the server are tested against Redis."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from servers import RedisServer

from kvkeepd.config.resolution import resolve
from kvkeepd.config.settings import ConfigError, Settings
from kvkeepd.errors import CatalogUnavailable, SessionElsewhere
from kvkeepd.storage.catalog import Catalog, CheckpointRow, ListedSession, SessionRow
from kvkeepd.storage.catalog.sqlite import SqliteCatalog
from kvkeepd.urls import catalog_url, redacted

TTL_MS = 400


def redis_catalog(url: str, prefix: str | None = None) -> Catalog:
    from kvkeepd.storage.catalog.redis import RedisCatalog

    return RedisCatalog(f"{url}?prefix={prefix or 'test-' + secrets.token_hex(6)}")


@pytest.fixture(params=["sqlite", "redis"])
def catalog(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Catalog]:
    made: Catalog
    if request.param == "sqlite":
        made = SqliteCatalog(tmp_path / "catalog.db")
    else:
        made = redis_catalog(request.getfixturevalue("redis_server"))
    yield made
    made.close()


def sid() -> str:
    return "s_" + secrets.token_hex(12)


def row(session_id: str, kind: str = "explicit", tenant: str = "", at: float = 1.0) -> CheckpointRow:
    return CheckpointRow(
        checkpoint_id="c_" + secrets.token_hex(12),
        session_id=session_id,
        label=f"label {kind}",
        kind=kind,
        n_tokens=128,
        bytes_written=1000,
        bytes_referenced=2000,
        created_at=at,
        tenant=tenant,
    )


def key(n: int) -> str:
    return f"{n:064x}"


def test_a_checkpoint_is_read_back_as_committed(catalog: Catalog) -> None:
    s = sid()
    r = row(s, tenant="acme", at=12.5)
    catalog.add_checkpoint(r, b"\x00manifest\xff", [(key(1), 10), (key(2), 20)], now=5.0)
    found = catalog.get(r.checkpoint_id)
    assert found == (r, b"\x00manifest\xff")
    assert catalog.get("c_" + "0" * 24) is None
    assert catalog.checkpoints(s) == [r]
    assert catalog.tenant_checkpoints("acme") == [r]
    assert catalog.tenant_checkpoints("other") == []
    assert catalog.counts([s]) == {s: 1}
    assert catalog.counts([s, sid(), s]) == {s: 1} and catalog.counts([]) == {}
    assert catalog.present([key(1), key(2), key(3)]) == {key(1), key(2)}
    assert catalog.block_size(key(2)) == 20 and catalog.block_size(key(3)) is None
    # Its blocks and its manifest.
    assert catalog.stored_bytes("acme") == 30 + 10 and catalog.stored_bytes("other") == 0
    assert catalog.sessions() == [] and catalog.session(s) is None  # no head: not a session


def test_a_head_replaces_the_previous_one(catalog: Catalog) -> None:
    s = sid()
    first = row(s, kind="head", at=3.0)
    assert catalog.add_checkpoint(first, b"one", [(key(1), 10)], now=1.0, head_of=s) is None
    assert catalog.sessions() == [(s, 3.0, first.checkpoint_id)]
    second = row(s, kind="head", at=4.0)
    assert catalog.add_checkpoint(second, b"two", [(key(2), 10)], now=2.0, head_of=s) == first.checkpoint_id
    assert catalog.get(first.checkpoint_id) is None
    assert catalog.session(s) == SessionRow(3.0, second.checkpoint_id, "")  # created_at stays
    assert catalog.checkpoints(s) == [] and catalog.checkpoints(s, include_heads=True) == [second]
    # The old head's block is no longer referenced; the new one's is.
    assert catalog.unreferenced() == [(key(1), 10)]


def test_deletes_clear_heads_references_and_sessions(catalog: Catalog) -> None:
    s = sid()
    head = row(s, kind="head")
    catalog.add_checkpoint(head, b"h", [(key(1), 10)], now=1.0, head_of=s)
    explicit = row(s, at=2.0)
    catalog.add_checkpoint(explicit, b"e", [(key(1), 10), (key(2), 5)], now=2.0)
    assert catalog.delete(explicit.checkpoint_id) is True
    assert catalog.delete(explicit.checkpoint_id) is False
    assert catalog.counts([s]) == {}
    assert catalog.unreferenced() == [(key(2), 5)]
    assert catalog.delete(head.checkpoint_id) is True
    assert catalog.session(s) == SessionRow(1.0, None, "")  # the session stays, headless
    other = row(s, kind="head", at=3.0)
    catalog.add_checkpoint(other, b"h2", [(key(3), 7)], now=3.0, head_of=s)
    catalog.add_checkpoint(row(s, at=4.0), b"e2", [(key(3), 7)], now=4.0)
    catalog.delete_session(s)
    assert catalog.sessions() == [] and catalog.checkpoints(s, include_heads=True) == []
    assert catalog.counts([s]) == {}
    assert sorted(catalog.unreferenced()) == [(key(1), 10), (key(2), 5), (key(3), 7)]


def test_a_stored_response_commits_with_its_checkpoint_and_goes_with_it(catalog: Catalog) -> None:
    s = sid()
    old, new = row(s, "response", "acme", at=10.0), row(s, "response", "acme", at=20.0)
    catalog.add_checkpoint(old, b"m1", [(key(1), 10)], now=10.0, response=b'{"r": 1}')
    catalog.add_checkpoint(new, b"m2", [(key(1), 10), (key(2), 20)], now=20.0, response=b'{"r": 2}')
    plain = row(s, "explicit", "acme", at=5.0)
    catalog.add_checkpoint(plain, b"m3", [], now=5.0)
    assert catalog.response(new.checkpoint_id) == (new, b'{"r": 2}')
    assert catalog.response(plain.checkpoint_id) is None and catalog.get(plain.checkpoint_id) is not None
    assert catalog.old_responses(15.0, 10) == [old.checkpoint_id]
    assert catalog.old_responses(25.0, 10) == [old.checkpoint_id, new.checkpoint_id]
    assert catalog.old_responses(25.0, 1) == [old.checkpoint_id]
    assert catalog.delete(old.checkpoint_id)
    assert catalog.response(old.checkpoint_id) is None
    assert catalog.old_responses(25.0, 10) == [new.checkpoint_id]
    # Its blocks: the one only it referenced is unreferenced now, the shared one is not.
    assert catalog.forget_blocks([key(1), key(2)]) == []
    catalog.delete(new.checkpoint_id)
    assert sorted(catalog.forget_blocks([key(1), key(2)])) == [key(1), key(2)]
    assert catalog.old_responses(25.0, 10) == []


def test_only_unreferenced_blocks_are_forgotten_least_recently_used_first(catalog: Catalog) -> None:
    s = sid()
    old, kept = row(s, at=1.0), row(s, at=2.0)
    catalog.add_checkpoint(old, b"a", [(key(1), 10), (key(2), 20)], now=1.0)
    catalog.add_checkpoint(kept, b"b", [(key(2), 20), (key(3), 30)], now=2.0)
    catalog.delete(old.checkpoint_id)
    assert catalog.unreferenced() == [(key(1), 10)]
    catalog.touch([key(1)], now=9.0)
    catalog.delete(kept.checkpoint_id)
    assert [k for k, _ in catalog.unreferenced()] == [key(2), key(3), key(1)]
    assert catalog.known_blocks() == {key(1), key(2), key(3)}
    again = row(s, at=3.0)
    catalog.add_checkpoint(again, b"c", [(key(3), 30)], now=3.0)  # referenced again
    assert catalog.forget_blocks([key(1), key(3)]) == [key(1)]
    assert catalog.known_blocks() == {key(2), key(3)}


def test_stored_bytes_count_each_block_once_per_tenant(catalog: Catalog) -> None:
    a, b = sid(), sid()
    catalog.add_checkpoint(row(a, tenant="t1"), b"x", [(key(1), 100), (key(2), 50)], now=1.0)
    catalog.add_checkpoint(row(a, kind="head", tenant="t1"), b"y", [(key(1), 100)], now=1.0, head_of=a)
    catalog.add_checkpoint(row(b, tenant="t2"), b"z", [(key(1), 100)], now=1.0, response=b"rec")
    # Blocks once each, then every checkpoint's own manifest and record.
    assert catalog.stored_bytes("t1") == 150 + 2
    assert catalog.stored_bytes("t2") == 100 + 1 + 3


def _session(catalog: Catalog, tenant: str, at: float, explicit: int = 0) -> ListedSession:
    """A persistent session with a head saved at `at` (and explicit checkpoints), as listed."""
    s = sid()
    head = row(s, kind="head", tenant=tenant, at=at)
    catalog.add_checkpoint(head, b"h", [(key(1), 10)], now=at, head_of=s)
    for _ in range(explicit):
        catalog.add_checkpoint(row(s, tenant=tenant, at=at), b"e", [(key(2), 5)], now=at)
    return ListedSession(s, at, at, head.checkpoint_id, head.n_tokens, explicit)


def test_a_tenant_lists_its_own_sessions_most_recently_used_first(catalog: Catalog) -> None:
    older = _session(catalog, "t1", 1.0)
    newer = _session(catalog, "t1", 3.0, explicit=2)
    theirs = _session(catalog, "t2", 2.0)
    assert catalog.tenant_sessions("t1", 10) == [newer, older]
    assert catalog.tenant_sessions("t1", 1) == [newer]
    assert catalog.tenant_sessions("t2", 10) == [theirs]
    assert catalog.tenant_sessions("nobody", 10) == []
    catalog.delete_session(older.session_id)
    assert catalog.tenant_sessions("t1", 10) == [newer]


def test_on_one_daemon_every_lease_is_granted(tmp_path: Path) -> None:
    catalog = SqliteCatalog(tmp_path / "catalog.db")
    assert catalog.take_lease(sid(), "a", TTL_MS).token > 0
    assert catalog.renew_leases("a", {sid(): 1}, TTL_MS) == (set(), set())
    assert not catalog.shared


# ---- Redis only: prefixes, leases and fencing, idempotent retries, outages --------------------


def test_prefixes_keep_deployments_apart(redis_server: str) -> None:
    one, two = redis_catalog(redis_server), redis_catalog(redis_server)
    s = sid()
    one.add_checkpoint(row(s, kind="head"), b"m", [(key(1), 1)], now=1.0, head_of=s)
    one.add_checkpoint(row(s), b"e", [(key(1), 1)], now=1.0)
    assert len(one.sessions()) == 1 and one.counts([s]) == {s: 1}
    assert two.sessions() == [] and two.known_blocks() == set() and two.counts([s]) == {}


def test_a_retried_commit_counts_once(redis_server: str) -> None:
    catalog = redis_catalog(redis_server)
    s = sid()
    r = row(s)
    catalog.add_checkpoint(r, b"m", [(key(1), 1)], now=1.0)
    catalog.add_checkpoint(r, b"m", [(key(1), 1)], now=1.0)  # as after a timeout, retried
    assert catalog.counts([s]) == {s: 1}
    catalog.delete(r.checkpoint_id)
    assert catalog.counts([s]) == {} and catalog.unreferenced() == [(key(1), 1)]


def test_a_lease_has_one_holder_and_a_lapsed_holder_is_fenced(redis_server: str) -> None:
    prefix = "test-" + secrets.token_hex(6)
    a, b = redis_catalog(redis_server, prefix), redis_catalog(redis_server, prefix)
    s = sid()
    lease_a = a.take_lease(s, "daemon-a", TTL_MS)
    assert lease_a.token > 0
    head = row(s, kind="head")
    a.add_checkpoint(head, b"a1", [(key(1), 1)], now=1.0, head_of=s, fence=lease_a.token)
    refused = b.take_lease(s, "daemon-b", TTL_MS)
    assert refused.token == 0 and 0 < refused.wait_ms <= TTL_MS
    # The holder renews, and learns that another daemon asks for the session.
    assert a.renew_leases("daemon-a", {s: lease_a.token}, TTL_MS) == (set(), {s})
    assert a.take_lease(s, "daemon-a", TTL_MS).token == lease_a.token  # its own, extended
    time.sleep(TTL_MS / 1000 + 0.2)  # a stops renewing: its lease lapses
    lease_b = b.take_lease(s, "daemon-b", TTL_MS)
    assert lease_b.token > lease_a.token
    moved = row(s, kind="head", at=2.0)
    b.add_checkpoint(moved, b"b1", [(key(2), 1)], now=2.0, head_of=s, fence=lease_b.token)
    # a wakes up: its write of the head is refused, and changes nothing.
    late = row(s, kind="head", at=3.0)
    with pytest.raises(SessionElsewhere):
        a.add_checkpoint(late, b"a2", [(key(3), 1)], now=3.0, head_of=s, fence=lease_a.token)
    assert a.get(late.checkpoint_id) is None and a.block_size(key(3)) is None
    assert b.session(s) == SessionRow(1.0, moved.checkpoint_id, "")
    with pytest.raises(SessionElsewhere):
        a.delete_session(s, fence=lease_a.token)
    assert a.renew_leases("daemon-a", {s: lease_a.token}, TTL_MS) == ({s}, set())
    a.release_lease(s, "daemon-a", lease_a.token)  # not a's: nothing happens
    assert a.take_lease(s, "daemon-c", TTL_MS).token == 0
    b.release_lease(s, "daemon-b", lease_b.token)
    assert a.take_lease(s, "daemon-c", TTL_MS).token > lease_b.token
    b.delete_session(s, fence=lease_b.token + 1)  # the newest token may delete it
    assert b.session(s) is None


def test_turn_records_are_fenced_grouped_listed_and_covered_by_the_next_head(redis_server: str) -> None:
    import asyncio

    from kvkeepd.storage.shared_journal import SharedJournal

    prefix = "test-" + secrets.token_hex(6)
    a, b = redis_catalog(redis_server, prefix), redis_catalog(redis_server, prefix)
    sessions = [sid() for _ in range(8)]
    tokens = {}
    for s in sessions:
        tokens[s] = a.take_lease(s, "daemon-a#1", TTL_MS * 10).token
        a.add_checkpoint(row(s, kind="head", tenant="t"), b"m", [], now=1.0, head_of=s, fence=tokens[s])
    journal = SharedJournal(a, clock=lambda: 5.0)  # type: ignore[arg-type]

    async def turns() -> None:
        # Appends made together go in one script: one round trip, one fsync on the server.
        await asyncio.gather(
            *(journal.append(s, s.encode(), fence=tokens[s], n_tokens=200) for s in sessions)
        )
        with pytest.raises(SessionElsewhere):  # another token writes nothing
            await journal.append(sessions[0], b"stale", fence=tokens[sessions[0]] + 1)
        with pytest.raises(SessionElsewhere):  # nor does a session the catalog does not have
            await journal.append(sid(), b"gone", fence=0)

    asyncio.run(turns())
    assert (journal.records, journal.syncs) == (8, 3)
    assert all(b.turn(s) == s.encode() for s in sessions)  # what another daemon reads
    listed = {r.session_id: r for r in b.tenant_sessions("t", 10)}
    assert {(r.n_tokens, r.last_used_at, r.holder) for r in listed.values()} == {(200, 5.0, "daemon-a")}
    # A head covers the record: it goes in the same script as the head moves.
    first = sessions[0]
    a.add_checkpoint(
        row(first, kind="head", tenant="t"), b"m2", [], now=6.0, head_of=first, fence=tokens[first]
    )
    assert b.turn(first) is None and b.turn(sessions[1]) == sessions[1].encode()
    a.delete_session(sessions[1], fence=tokens[sessions[1]])  # and a close deletes it
    assert b.turn(sessions[1]) is None


def test_the_collector_takes_only_claimed_blocks_no_save_committed_in_time(redis_server: str) -> None:
    from kvkeepd.errors import StaleClaim
    from kvkeepd.storage.catalog.redis import RedisCatalog

    grace = 0.5
    catalog = RedisCatalog(f"{redis_server}?prefix=test-{secrets.token_hex(6)}", grace=grace)
    kept, cut, cached = key(1), key(2), key(3)
    # A save claims its blocks, and commits only one of them (the other's put was cut short).
    claim = catalog.claim_blocks([kept, cut])
    assert claim.sizes == {} and not claim.busy and claim.at > 0
    committed = row(sid())
    catalog.add_checkpoint(committed, b"m", [(kept, 10)], now=1.0, claimed_at=claim.at)
    assert catalog.doomed_blocks(10) == []  # within the grace period: every claim holds
    time.sleep(grace + 0.1)
    assert catalog.doomed_blocks(10) == [cut]  # claimed long ago, known to no checkpoint
    assert catalog.doomed_blocks(10) == []  # taken once
    # While it is being deleted, a save's claim on it waits; once deleted, it goes through.
    assert catalog.claim_blocks([cut, kept]).busy == {cut}
    catalog.deleted_blocks([cut])
    again = catalog.claim_blocks([cut, kept])
    assert not again.busy and again.sizes == {kept: 10}

    # A budget sweep forgets an unreferenced block only once no save has claimed it lately.
    catalog.add_checkpoint(
        row(sid()), b"m", [(cached, 20)], now=1.0, claimed_at=catalog.claim_blocks([cached]).at
    )
    for r in catalog.checkpoints(committed.session_id):
        catalog.delete(r.checkpoint_id)
    assert catalog.forget_blocks([kept]) == []  # claimed just now (`again`): kept
    time.sleep(grace + 0.1)
    assert catalog.forget_blocks([kept]) == [kept]
    assert catalog.claim_blocks([kept]).busy == {kept}  # being deleted
    catalog.deleted_blocks([kept])
    assert catalog.forget_blocks([cached]) == []  # referenced

    # A save that took longer than the grace period is refused: its blocks may be gone.
    late = catalog.claim_blocks([key(4)])
    time.sleep(grace + 0.1)
    with pytest.raises(StaleClaim):
        catalog.add_checkpoint(row(sid()), b"m", [(key(4), 5)], now=2.0, claimed_at=late.at)
    assert catalog.block_size(key(4)) is None


def test_an_unreachable_server_is_unavailable_until_it_is_back(
    start_redis: Callable[[], RedisServer],
) -> None:
    server = start_redis()
    catalog = redis_catalog(server.url)
    s = sid()
    head = row(s, kind="head")
    catalog.add_checkpoint(head, b"m", [(key(1), 1)], now=1.0, head_of=s)
    server.stop()
    with pytest.raises(CatalogUnavailable, match="cannot be reached"):
        catalog.sessions()
    with pytest.raises(CatalogUnavailable):
        catalog.add_checkpoint(row(s, kind="head", at=2.0), b"n", [], now=2.0, head_of=s)
    server.start()  # same port, same append-only file
    assert catalog.session(s) == SessionRow(1.0, head.checkpoint_id, "")


def test_a_server_that_is_not_there_stops_the_catalog_at_once(tmp_path: Path) -> None:
    from servers import free_port

    with pytest.raises(CatalogUnavailable):
        redis_catalog(f"redis://127.0.0.1:{free_port()}/0")


# ---- the setting ------------------------------------------------------------------------------


def test_the_catalog_setting_takes_redis_urls_and_keeps_passwords_out_of_sight() -> None:
    assert catalog_url("redis://127.0.0.1:6379/2?prefix=blue") == ("redis://127.0.0.1:6379/2", "blue")
    assert catalog_url("rediss://h:1/0")[1] == "kvkeep"
    assert redacted("redis://:hunter2@h:6379/0") == "redis://:***@h:6379/0"
    with pytest.raises(ConfigError, match=r"catalog.*redis://"):
        Settings(catalog="postgres://h/db").validate()
    with pytest.raises(ConfigError, match="prefix"):
        Settings(catalog="redis://h:1/0?prefix=a:b").validate()
    shown = resolve({"catalog": "redis://user:hunter2@h:6379/0?prefix=x"}, {}).describe()
    assert "hunter2" not in shown and 'catalog = "redis://user:***@h:6379/0?prefix=x"' in shown


def test_a_daemon_with_another_store_key_is_refused_at_start(redis_server: str, tmp_path: Path) -> None:
    from kvkeepd.storage.statedir import StateDir
    from kvkeepd.storage.stores import durable_catalog

    settings = Settings(catalog=f"{redis_server}?prefix=test-{secrets.token_hex(6)}")
    state = StateDir.take(tmp_path / "state")
    try:
        durable_catalog(settings, state, b"k" * 32).close()
        durable_catalog(settings, state, b"k" * 32).close()  # the deployment's key: accepted
        with pytest.raises(OSError, match=r"another store key.*give this daemon the deployment's key"):
            durable_catalog(settings, state, b"x" * 32)
    finally:
        state.release()


# The sqlite catalog keeps block recency (touch, as a restore does) in RAM and writes it
# with the next transaction.


def _add(catalog: Catalog, checkpoint_id: str, blocks: list[str], now: float) -> None:
    row = CheckpointRow(checkpoint_id, "s_1", "", "explicit", 64, 0, 0, now)
    catalog.add_checkpoint(row, b"manifest", [(k, 100) for k in blocks], now)


def test_sqlite_touched_blocks_are_dropped_last(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    catalog = SqliteCatalog(path)
    _add(catalog, "c_1", ["a" * 64, "b" * 64], now=1.0)
    _add(catalog, "c_2", ["c" * 64], now=2.0)
    catalog.touch(["a" * 64], 3.0)  # as a restore does
    assert catalog.delete("c_1") and catalog.delete("c_2")
    order = [key[0] for key, _ in catalog.unreferenced()]
    assert order == ["b", "c", "a"]
    catalog.close()
    # The recency went to disk with the deletes' transaction: a restart keeps the order.
    again = SqliteCatalog(path)
    assert [key[0] for key, _ in again.unreferenced()] == order
    again.forget_blocks(["b" * 64, "c" * 64])
    assert [key for key, _ in again.unreferenced()] == ["a" * 64]
    again.close()


def test_sqlite_recency_is_written_before_the_order_is_read(tmp_path: Path) -> None:
    catalog = SqliteCatalog(tmp_path / "catalog.db")
    _add(catalog, "c_1", ["a" * 64, "b" * 64], now=1.0)
    assert catalog.delete("c_1")
    catalog.touch(["a" * 64], 5.0)  # no write transaction follows
    assert [key[0] for key, _ in catalog.unreferenced()] == ["b", "a"]
    catalog.close()


def test_idle_sessions_nobody_holds_expire_once_and_stay_gone(redis_server: str) -> None:
    prefix = "test-" + secrets.token_hex(6)
    a, b = redis_catalog(redis_server, prefix), redis_catalog(redis_server, prefix)
    free = _session(a, "t1", 1.0, explicit=1)
    held = _session(a, "t1", 1.0)
    recent = _session(a, "t2", 100.0)
    lapsed = _session(a, "t2", 1.0)
    assert a.take_lease(held.session_id, "daemon-a", 60_000).token > 0
    old_token = a.take_lease(lapsed.session_id, "daemon-x", TTL_MS).token
    time.sleep(TTL_MS / 1000 + 0.2)  # daemon-x stops renewing: its lease lapses
    assert sorted(b.expire_sessions(50.0, 10)) == sorted([free.session_id, lapsed.session_id])
    assert a.expire_sessions(50.0, 10) == []  # once, whichever daemon asks
    assert b.session(free.session_id) is None and b.checkpoints(free.session_id, include_heads=True) == []
    assert b.session(held.session_id) is not None and b.session(recent.session_id) is not None
    assert b.tenant_sessions("t1", 10) == [held] and b.tenant_sessions("t2", 10) == [recent]
    assert sorted(k for k, _ in b.unreferenced()) == [key(2)]  # the held ones still use key(1)
    # The lapsed holder wakes up: it cannot bring its session back.
    with pytest.raises(SessionElsewhere):
        a.add_checkpoint(
            row(lapsed.session_id, kind="head", tenant="t2", at=200.0),
            b"late",
            [(key(3), 1)],
            now=200.0,
            head_of=lapsed.session_id,
            fence=old_token,
        )
    assert b.session(lapsed.session_id) is None
    # At most `limit` per call.
    for _ in range(3):
        _session(a, "t3", 2.0)
    assert len(b.expire_sessions(50.0, 2)) == 2 and len(b.expire_sessions(50.0, 2)) == 1


def test_sessions_of_a_catalog_written_before_its_indexes_are_indexed_at_open(redis_server: str) -> None:
    import redis

    prefix = "test-" + secrets.token_hex(6)
    old = redis_catalog(redis_server, prefix)
    listed = _session(old, "t1", 1.0)
    raw = redis.Redis.from_url(redis_server)
    # As a catalog written by a daemon without the session indexes left it.
    raw.delete(f"{prefix}:index-version", f"{prefix}:sessions-used", f"{prefix}:tenant-sessions:t1")
    assert old.tenant_sessions("t1", 10) == []
    opened = redis_catalog(redis_server, prefix)
    assert opened.tenant_sessions("t1", 10) == [listed]
    # A session deleted by such a daemon afterwards leaves its index entries: neither counts.
    gone = _session(opened, "t1", 2.0)
    raw.delete(f"{prefix}:session:{gone.session_id}")
    assert opened.tenant_sessions("t1", 10) == [listed]
    assert opened.expire_sessions(50.0, 10) == [listed.session_id]
    assert raw.zcard(f"{prefix}:sessions-used") == 0


def test_kept_prefixes_expire_by_their_own_time_to_live(catalog: Catalog) -> None:
    short = replace(row("", "prefix", "acme", at=10.0), label="300")
    long = replace(row("", "prefix", "acme", at=5.0), label="3600")
    catalog.add_checkpoint(short, b"p1", [(key(1), 10)], now=10.0)
    catalog.add_checkpoint(long, b"p2", [(key(1), 10)], now=5.0)
    catalog.add_checkpoint(row(sid(), at=0.0), b"e", [], now=0.0)  # other kinds never expire here
    assert catalog.expired_prefixes(300.0, 10) == []
    assert catalog.expired_prefixes(320.0, 10) == [short.checkpoint_id]
    assert catalog.expired_prefixes(4000.0, 10) == [short.checkpoint_id, long.checkpoint_id]
    assert catalog.delete(short.checkpoint_id)
    assert catalog.expired_prefixes(4000.0, 10) == [long.checkpoint_id]
