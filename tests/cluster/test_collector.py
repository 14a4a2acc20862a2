"""Nothing left behind in a shared store: two daemons on one Redis catalog and one Redis
block store (servers of this test's own), the collector on with a short grace period.

A daemon killed in the middle of a save (its puts done, its commit held up) leaves blocks
no checkpoint knows; they are gone once the grace period is over, while both daemons save
concurrently (a head every turn, and checkpoints), and no block that a committed checkpoint
references is ever missing. Blocks the deployment never claimed (another's, sharing the
server) are never touched.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable

import redis
from daemons import DaemonProcess, wait_until
from servers import RedisServer

import kvkeep

GRACE = 4.0
SAMPLING = kvkeep.SamplingParams(seed=5)
STORY = "The ferry left the harbour at dawn, and the gulls followed it out past the breakwater. " * 10
BLOCK_PREFIX = "kvkeep:block:"
PARALLEL_PUTS = 4  # a daemon's remote puts in flight at once (storage/checkpoints.py)


def puts_waiting(store: redis.Redis) -> int:
    """Connections whose command is a put of a block (held back by CLIENT PAUSE)."""
    return sum(1 for c in store.client_list() if c.get("cmd") == "set")


def store_keys(store: redis.Redis) -> set[str]:
    return {k.decode()[len(BLOCK_PREFIX) :] for k in store.scan_iter(match=BLOCK_PREFIX + "*", count=1000)}


def known_keys(catalog: redis.Redis, prefix: str) -> set[str]:
    return {k.decode() for k in catalog.hkeys(f"{prefix}:blocks")}


def referenced_keys(catalog: redis.Redis, prefix: str) -> set[str]:
    refs = list(catalog.scan_iter(match=f"{prefix}:refs:*", count=1000))
    return {k.decode() for k in catalog.sunion(refs)} if refs else set()


def test_orphans_of_a_killed_save_are_collected_while_two_daemons_save_and_nothing_committed_is_lost(
    start_redis: Callable[[], RedisServer], spawn_daemon: Callable[..., DaemonProcess]
) -> None:
    catalog_server, store_server = start_redis(), start_redis()
    prefix = f"collect-{secrets.token_hex(4)}"
    args = (
        "--catalog", f"{catalog_server.url}?prefix={prefix}",
        "--store", store_server.url,
        "--orphan-grace", str(GRACE),
        "--sweep-interval", "0.2",
        "--lease-seconds", "1.5",
        "--head-interval", "1",  # a head (a save) every turn
    )  # fmt: skip
    env = {"KVKEEP_STORE_KEY": secrets.token_hex(32)}
    a, b = (spawn_daemon(*args, env=env) for _ in range(2))
    catalog = redis.Redis.from_url(catalog_server.url)
    store = redis.Redis.from_url(store_server.url)
    # Another deployment's blocks on the same server: never claimed here, never collected.
    foreign = {secrets.token_hex(32) for _ in range(3)}
    for k in foreign:
        store.set(BLOCK_PREFIX + k, b"theirs")

    # A is killed in the middle of a save, its blocks put and its commit not made: the store
    # holds writes back until the save has claimed its blocks, then the catalog holds its
    # writes back (the commit) while the puts go through, and A is killed. (A server drops
    # what a client that left had sent it while paused.)
    with kvkeep.Client(a.address, timeout=60, retry=None) as ca:
        s = ca.create_session(persistent=True, sampling=SAMPLING)
        before = store.dbsize()
        claims = catalog.zcard(f"{prefix}:claims")
        store.execute_command("CLIENT", "PAUSE", "30000", "WRITE")
        try:
            turn = threading.Thread(target=_quietly, args=(lambda: s.complete(STORY * 3, max_tokens=1),))
            turn.start()
            wait_until(
                lambda: catalog.zcard(f"{prefix}:claims") > claims, 60, "the save's claim", interval=0.005
            )
            catalog.execute_command("CLIENT", "PAUSE", "30000", "WRITE")
        finally:
            store.execute_command("CLIENT", "UNPAUSE")
        try:
            wait_until(lambda: store.dbsize() > before, 10, "the save's puts")
            time.sleep(0.3)  # all of them
            a.kill()
        finally:
            catalog.execute_command("CLIENT", "UNPAUSE")
        turn.join(30)
    # What the kill left (looked at before the grace period is over: then the collector takes it).
    orphans = store_keys(store) - known_keys(catalog, prefix) - foreign
    assert orphans

    # Both daemons save at once while the collector runs (on whichever holds its duty).
    a.start()
    errors: list[BaseException] = []
    sessions: dict[str, tuple[kvkeep.Session, kvkeep.CheckpointInfo]] = {}

    def work(daemon: DaemonProcess, name: str) -> None:
        try:
            with kvkeep.Client(daemon.address, timeout=60) as client:
                session = client.create_session(persistent=True, sampling=SAMPLING)
                session.complete(STORY, max_tokens=1)
                mark = session.checkpoint("after the story")
                for i in range(6):
                    session.complete(f" Then, on day {i}, the wind turned.", max_tokens=4)
                    if i % 2:
                        session.checkpoint(f"day {i}")
                sessions[name] = (session, mark)
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=work, args=(d, n)) for d, n in ((a, "a"), (b, "b"))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(180)
    assert not errors, errors
    # Nothing a committed checkpoint references is missing, the orphans are gone (those
    # whose tokens a later save wrote again are that save's now), and the blocks this
    # deployment never claimed are still there.
    assert referenced_keys(catalog, prefix) <= store_keys(store)
    wait_until(
        lambda: store_keys(store) - known_keys(catalog, prefix) == foreign,
        3 * GRACE + 10,
        "the collector to take the orphans",
        interval=0.1,
    )
    assert not orphans & store_keys(store) - known_keys(catalog, prefix)
    assert referenced_keys(catalog, prefix) <= store_keys(store)
    assert "collected" in a.log() + b.log()

    # And the state is whole: each session restores its first checkpoint from the store and
    # goes on as it did the first time.
    for name, daemon in (("a", a), ("b", b)):
        session, mark = sessions[name]
        with kvkeep.Client(daemon.address, timeout=60) as client:
            again = kvkeep.Session(client, session.session_id)
            again.restore(mark.checkpoint_id)
            first = again.complete(" Then, on day 0, the wind turned.", max_tokens=4)
            again.restore(mark.checkpoint_id)
            assert (
                again.complete(" Then, on day 0, the wind turned.", max_tokens=4).token_ids == first.token_ids
            )


def _quietly(call: Callable[[], object]) -> None:
    with contextlib.suppress(kvkeep.KvkeepError):  # its daemon is killed under it
        call()
