"""Ephemeral checkpoints' whole states, kept in the RAM budget's free room (sessions/whole_states.py).

- the cache itself: least recently used states go first, one larger than its room is not
  kept, a session's states leave with it, a state counts the memory it holds;
- in a daemon: a checkpoint's state is kept when taken, and a restore and a fork load it
  (counted, in /metrics too) and continue exactly as the source did; closing the session or deleting the
  checkpoint gives the memory back; a persistent checkpoint's state is not kept, and its
  restore assembles the blocks it reads while the head is synced (Residency.assemble_parked);
- a parked session that needs the room takes it from the kept states, instead of being
  spilled to disk.
"""

from __future__ import annotations

from collections.abc import Callable

from checkpoint_helpers import SAMPLED, gen, long_text
from daemons import InProcessDaemon
from scraping import scrape

import kvkeep
from kvkeepd.heap import allocated, state_buffer
from kvkeepd.sessions.memory.residency import Residency
from kvkeepd.sessions.placement import Parked
from kvkeepd.sessions.whole_states import StateCache
from kvkeepd.state.cells import SeqKv
from kvkeepd.state.layout import StateLayout

PROMPT = long_text(20, "orchard")


def blob(size: int) -> SeqKv:
    return SeqKv(StateLayout(()), 1, (), bytes(size))


def test_the_least_recently_used_states_go_first() -> None:
    cache = StateCache()
    assert cache.put("c1", "s1", blob(100), room=250)
    assert cache.put("c2", "s2", blob(100), room=250)
    assert cache.get("c1") is not None  # c2 is now the least recently used
    assert cache.put("c3", "s1", blob(100), room=250)
    assert cache.get("c2") is None
    assert (cache.nbytes, len(cache), cache.hits) == (200, 2, 1)
    assert not cache.put("c4", "s3", blob(300), room=250)  # larger than its room: not kept
    assert not cache.put("c5", "s3", SeqKv(StateLayout(()), 1, ()), room=250)  # no blob
    cache.drop_session("s1")
    assert (cache.nbytes, len(cache)) == (0, 0)
    cache.put("c6", "s4", blob(100), room=250)
    cache.shrink(99)
    assert (cache.nbytes, len(cache)) == (0, 0)


def residency(d: InProcessDaemon) -> Residency:
    assert d.daemon is not None and d.daemon.manager is not None
    return d.daemon.manager.residency


def test_a_state_rounded_up_counts_what_it_holds() -> None:
    """A state exported every turn is allocated in 16 MiB steps (heap.state_buffer); the
    cache counts the memory held, not the state's length."""
    rounded = state_buffer((16 << 20) + 1, rounded=True)
    exact = state_buffer((16 << 20) + 1)
    assert len(rounded) == len(exact) == (16 << 20) + 1
    assert allocated(memoryview(rounded.data)) == 32 << 20
    assert allocated(memoryview(exact.data)) == (16 << 20) + 1
    cache = StateCache()
    kv = SeqKv(StateLayout(()), 1, (), memoryview(rounded.data))
    assert not cache.put("c1", "s1", kv, room=(16 << 20) + 1)
    assert cache.put("c1", "s1", kv, room=32 << 20) and cache.nbytes == 32 << 20
    cache.drop("c1")
    assert cache.nbytes == 0


def test_a_restore_and_a_fork_load_the_kept_state_exactly(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    d = start_daemon(slots=2, ctx_per_session=1024, metrics_address="127.0.0.1:0")
    assert d.daemon is not None
    wholes = residency(d).wholes
    with kvkeep.Client(d.address, timeout=60) as client:
        source = client.create_session(sampling=SAMPLED)
        gen(source, PROMPT, 4)
        ck = source.checkpoint("kept")
        kept = wholes.nbytes
        assert kept > 0 and len(wholes) == 1
        expected = gen(source, "", 16)
        other = client.create_session(sampling=SAMPLED)
        gen(other, "Something else entirely:", 4)
        hits = wholes.hits
        other.restore(ck.checkpoint_id)
        assert gen(other, "", 16) == expected
        fork = client.fork_session(checkpoint_id=ck.checkpoint_id)
        assert gen(fork, "", 16) == expected
        assert wholes.hits - hits == 2
        samples = scrape(d.daemon.metrics_port)
        assert samples["kvkeep_whole_state_bytes"] == kept
        assert samples["kvkeep_whole_state_loads_total"] == wholes.hits
        # A persistent checkpoint is the disk tier's: read from its blocks, and assembled
        # into one blob while the restored head is synced.
        durable = client.create_session(sampling=SAMPLED, persistent=True)
        gen(durable, PROMPT, 4)
        dck = durable.checkpoint()
        assert wholes.nbytes == kept
        later = client.create_session(sampling=SAMPLED, persistent=True)
        gen(later, "Something else entirely:", 4)
        later.restore(dck.checkpoint_id)
        assert d.run(_parked_as_one_blob(d, later.session_id))
        assert gen(later, "", 16) == expected
        for s in (durable, later):
            s.close()
        second = source.checkpoint("second")
        assert len(wholes) == 2
        client.delete_checkpoint(second.checkpoint_id)
        assert (len(wholes), wholes.nbytes) == (1, kept)
        source.close()  # its checkpoints go, and their states with them
        assert (len(wholes), wholes.nbytes) == (0, 0)
        for s in (other, fork):
            s.close()


async def _parked_as_one_blob(d: InProcessDaemon, session_id: str) -> bool:
    assert d.daemon is not None and d.daemon.manager is not None
    manager = d.daemon.manager
    where = manager.residency.where(manager.sessions[session_id])
    return isinstance(where, Parked) and where.kv.raw is not None


def test_a_parked_session_takes_the_room_of_kept_states(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    # Measured first: what one checkpoint keeps in RAM (blocks, manifest) and its state.
    probe = start_daemon(slots=1, ctx_per_session=1024)
    with kvkeep.Client(probe.address, timeout=60) as client:
        s = client.create_session(sampling=SAMPLED)
        gen(s, PROMPT, 4)
        s.checkpoint()
        stored, whole = residency(probe).ram_bytes(), residency(probe).wholes.nbytes
    probe.stop()
    # Room for the checkpoint's blocks and its whole state, but not for those and a parked
    # state of the same size as well.
    d = start_daemon(slots=1, ctx_per_session=1024, ram_cache=stored + whole + whole // 2)
    res = residency(d)
    with kvkeep.Client(d.address, timeout=60) as client:
        a = client.create_session(sampling=SAMPLED)
        gen(a, PROMPT, 4)
        a.checkpoint()
        assert res.wholes.nbytes == whole
        b = client.create_session(sampling=SAMPLED)
        gen(b, "Another story:", 4)  # takes the only slot: a is parked
        assert a.info().residency == "warm", "a parked session was spilled while kept states held its room"
        assert res.ram_bytes() + res.wholes.nbytes <= d.settings.ram_cache
        assert res.wholes.nbytes == 0
