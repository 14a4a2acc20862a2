"""SessionInfo (GetSession, ListSessions) says where a state lives, when it expires, its origin.

- `location` follows its state: history only before its first turn, `slot 0` while it holds
  the only slot, `ram` once another session takes the slot, `disk` when there is no RAM for it
  (a persistent session's head, an ephemeral session's spill) and after a restart, and
  `shared store` for a persistent session whose daemon keeps its blocks in Redis (an ephemeral
  session's spill stays on local disk);
- `expires_at` is its last use plus `--idle-ttl` (ephemeral) or `--persistent-ttl`
  (persistent), 0 when that TTL is 0;
- `forked_from` names the checkpoint or session a fork came from, "" for any other session.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from daemons import GREEDY, InProcessDaemon

import kvkeep


def where(client: kvkeep.Client) -> dict[str, str]:
    """Each listed session's location, by id."""
    return {s.session_id: s.location for s in client.list_sessions()}


def test_location_expiry_and_origin_follow_the_session(start_daemon: Callable[..., InProcessDaemon]) -> None:
    d = start_daemon(slots=1, idle_ttl=600.0, persistent_ttl=7200.0)
    with kvkeep.Client(d.address, timeout=60) as client:
        kept = client.create_session("Be brief.", sampling=GREEDY, persistent=True)
        assert (kept.info().location, kept.info().residency) == ("history only", "cold")
        kept.chat("Name a fruit.", max_tokens=4)
        assert (kept.info().location, kept.info().residency) == ("slot 0", "hot")
        loose = client.create_session(sampling=GREEDY)
        loose.complete("Bees build", max_tokens=2)  # takes the only slot
        assert where(client) == {kept.session_id: "ram", loose.session_id: "slot 0"}
        assert kept.info().residency == "warm"

        listed = {s.session_id: s for s in client.list_sessions()}
        assert listed[kept.session_id].expires_at == pytest.approx(
            listed[kept.session_id].last_used_at + 7200
        )
        assert listed[loose.session_id].expires_at == pytest.approx(
            listed[loose.session_id].last_used_at + 600
        )

        mark = kept.checkpoint("one turn")
        from_mark = kept.fork(mark.checkpoint_id)
        from_now = kept.fork()
        assert from_mark.info().forked_from == mark.checkpoint_id
        assert {s.session_id: s.forked_from for s in client.list_sessions()} == {
            kept.session_id: "",
            loose.session_id: "",
            from_mark.session_id: mark.checkpoint_id,
            from_now.session_id: kept.session_id,
        }
        for s in (kept, loose, from_mark, from_now):
            s.close()

    never = start_daemon(idle_ttl=0.0)
    with kvkeep.Client(never.address, timeout=60) as client:
        s = client.create_session()
        assert s.info().expires_at == 0
        s.close()


@pytest.mark.parametrize("store", ["local", "redis"])
def test_without_ram_a_swapped_out_state_is_on_disk_or_in_the_shared_store(
    tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    url = "local" if store == "local" else request.getfixturevalue("redis_server")
    remote = "shared store" if store == "redis" else "disk"

    def start() -> InProcessDaemon:
        return InProcessDaemon.with_settings(tmp_path, slots=1, ram_cache=0, store=url)

    d = start()
    try:
        with kvkeep.Client(d.address, timeout=60) as client:
            kept = client.create_session("Be brief.", sampling=GREEDY, persistent=True)
            kept.chat("Name a fruit.", max_tokens=4)
            loose = client.create_session(sampling=GREEDY)
            loose.complete("Bees build", max_tokens=2)  # takes the only slot: kept's head is stored
            assert where(client) == {kept.session_id: remote, loose.session_id: "slot 0"}
            kept.chat("And a colour?", max_tokens=4)  # loose spills to the local disk
            assert where(client) == {kept.session_id: "slot 0", loose.session_id: "disk"}
            assert kept.info().residency == "hot" and loose.info().residency == "cold"
    finally:
        d.stop()
    d = start()
    try:
        with kvkeep.Client(d.address, timeout=60) as client:
            # After a restart: the persistent session is its stored head; the ephemeral one is gone.
            assert where(client) == {kept.session_id: remote}
            client.session(kept.session_id).close()
    finally:
        d.stop()
