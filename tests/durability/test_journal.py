"""The turn journal: persistent turns made durable by one fsync'd append, shared by turns
that end together, with KV blocks saved later.

- the journal file on its own (real files, threads, the real disk budget): appends of one
  pass of the event loop share one ``fdatasync``; a torn tail or a damaged record is
  dropped at start, and what precedes it is kept; covered records leave the file (emptied,
  or rewritten with the live ones), a closed session's at once; its bytes are counted in
  the disk budget, and an append beyond it is refused with nothing written;
- a daemon: acknowledged turns survive ``kill -9`` and continue bit-exactly, evaluating
  again only the tokens since the last head, and a record torn by a kill costs only its
  turn; a graceful stop empties the journal; concurrent turns share syncs; a turn that
  would leave more than ``--head-interval`` tokens to evaluate again saves a head, and
  the journal empties; a close removes its record (the crash loop of test_crash.py kills
  during one-token turns too).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from checkpoint_helpers import SAMPLED, SPAWN_ARGS, gen, long_text
from daemons import DaemonProcess, InProcessDaemon, wait_until

import kvkeep
from kvkeepd.errors import Busy
from kvkeepd.storage import journal as jr
from kvkeepd.storage.budget import DiskBudget

# ---- the journal file ------------------------------------------------------------------------


def run(coro_fn: Callable[[], object]) -> None:
    asyncio.run(coro_fn())  # type: ignore[arg-type]


def test_appends_of_one_pass_share_one_sync_and_each_is_read_back(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    journal = jr.FileJournal(path)

    async def main() -> None:
        await asyncio.gather(*(journal.append(f"s{i}", f"turn {i}".encode()) for i in range(16)))
        await journal.append("s3", b"turn 3, again")

    run(main)
    assert (journal.records, journal.syncs) == (17, 2)
    journal.close()
    again = jr.FileJournal(path)
    got = again.recovered()
    again.close()
    assert got == {**{f"s{i}": f"turn {i}".encode() for i in range(16)}, "s3": b"turn 3, again"}


@pytest.mark.parametrize("damage", ["torn", "flipped", "garbage"])
def test_a_damaged_tail_is_dropped_and_what_precedes_it_kept(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "journal"
    journal = jr.FileJournal(path)

    async def main() -> None:
        await journal.append("a", b"first of a")
        await journal.append("b", b"first of b")
        await journal.append("a", b"second of a")

    run(main)
    journal.close()
    data = path.read_bytes()
    last = len(jr.frame("a", b"second of a"))
    if damage == "torn":  # a write cut short by a kill
        path.write_bytes(data[:-5])
    elif damage == "flipped":  # a bit of the last record's body
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 0x10]) + data[-2:])
    else:  # bytes after the last record that are no record
        path.write_bytes(data + b"\x00" * 7 + os.urandom(40))
    reopened = jr.FileJournal(path)
    want = (
        {"a": b"first of a", "b": b"first of b"}
        if damage != "garbage"
        else {"a": b"second of a", "b": b"first of b"}
    )
    assert reopened.recovered() == want
    intact = len(data) - (last if damage != "garbage" else 0)
    assert path.stat().st_size == intact == reopened.file_bytes()

    async def more() -> None:
        await reopened.append("c", b"after the damage")

    run(more)
    reopened.close()
    assert jr.FileJournal(path).recovered() == {**want, "c": b"after the damage"}


def test_a_damaged_record_in_the_middle_ends_what_is_read(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    journal = jr.FileJournal(path)

    async def main() -> None:
        for key in "abc":
            await journal.append(key, f"record {key}".encode())

    run(main)
    journal.close()
    data = bytearray(path.read_bytes())
    first = len(jr.frame("a", b"record a"))
    data[first + 12] ^= 0x01  # inside b's frame: its checksum fails
    path.write_bytes(bytes(data))
    reopened = jr.FileJournal(path)
    assert reopened.recovered() == {"a": b"record a"}
    reopened.close()


def test_covered_records_leave_the_file(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    journal = jr.FileJournal(path)
    secret = b"the conversation of a closed session"
    big = os.urandom(300_000)

    async def main() -> None:
        await journal.append("a", b"a's turn")
        await journal.append("gone", secret)
        journal.forget("gone", erase=True)  # a close: its text leaves the file now
        await journal.append("a", b"a's next turn")
        assert secret not in path.read_bytes()
        for i in range(12):  # records no longer needed pile up, then the file is rewritten
            await journal.append("b", big + bytes([i]))
        assert path.stat().st_size <= jr.COMPACT_FLOOR + len(jr.frame("b", big)) + 100
        journal.forget("a")
        journal.forget("b")
        await journal.append("c", b"c")
        journal.forget("c")
        await journal.append("d", b"d")  # in order after the forget
        journal.forget("d")
        await asyncio.sleep(0)

    run(main)
    journal.close()
    assert path.stat().st_size == 0 == journal.file_bytes()


def test_the_journal_counts_in_the_disk_budget(tmp_path: Path) -> None:
    journal = jr.FileJournal(tmp_path / "journal")
    budget = DiskBudget(4096, (journal.file_bytes,), lambda _target: 0)
    journal.budget = budget

    async def main() -> None:
        await journal.append("a", b"x" * 1000)
        assert budget.used() == journal.file_bytes() == len(jr.frame("a", b"x" * 1000))
        with pytest.raises(Busy):
            await journal.append("b", b"y" * 4000)
        assert journal.file_bytes() == len(jr.frame("a", b"x" * 1000))

    run(main)
    journal.close()
    assert jr.FileJournal(tmp_path / "journal").recovered() == {"a": b"x" * 1000}


# ---- a daemon ----------------------------------------------------------------------------------


def journal_bytes(state_dir: Path) -> int:
    return (state_dir / "journal").stat().st_size


def test_acknowledged_turns_survive_kill_9_and_a_torn_record_costs_only_its_turn(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    proc = spawn_daemon(*SPAWN_ARGS, "--slots", "2", "--head-interval", "32")
    with kvkeep.Client(proc.address, timeout=60) as client:
        s = client.create_session("You are terse.", sampling=SAMPLED, persistent=True)
        created = s.info().head_checkpoint_id
        gen(s, long_text(3, "journal"), 4)  # over 32 tokens: this turn saves a head
        head = s.info().head_checkpoint_id
        assert head != created
        at_head = s.info().n_tokens
        for _ in range(3):
            gen(s, " And then", 3)
        n = s.info().n_tokens
        # What an uninterrupted run gives next: an ephemeral fork, generating now.
        fork = client.fork_session(s.session_id)
        expected = gen(fork, " Next", 6)
        fork.close()
    assert journal_bytes(proc.state_dir) > 0
    proc.kill()
    proc.start()
    with kvkeep.Client(proc.address, timeout=60) as client:
        again = client.session(s.session_id)
        info = again.info()
        assert (info.n_tokens, info.head_checkpoint_id) == (n, head)  # the turns, on the old head
        done = again.complete(" Next", max_tokens=6, logprobs=1)
        assert [(t.sampled.token_id, t.sampled.logprob) for t in done.logprobs] == expected
        # Evaluated again: the tokens since the head (the head's own last token was pending
        # too), then the prompt, as any turn evaluates it.
        assert n - at_head < 20 < at_head
        assert done.usage.evaluated_tokens <= (n - at_head + 1) + 2
        # A record torn by the kill costs only its turn: the one before it is kept.
        n_first = again.info().n_tokens
        expected = gen(client.fork_session(s.session_id), "", 4)
        gen(again, "", 2)
    proc.kill()
    path = proc.state_dir / "journal"
    path.write_bytes(path.read_bytes()[:-9])
    proc.start()
    with kvkeep.Client(proc.address, timeout=60) as client:
        again = client.session(s.session_id)
        assert again.info().n_tokens == n_first
        assert gen(again, "", 4) == expected
    assert "not an intact record" in proc.log()
    assert journal_bytes(proc.state_dir) > 0
    assert proc.terminate() == 0  # a graceful stop saves the head: no record is needed
    assert journal_bytes(proc.state_dir) == 0


def test_concurrent_turns_are_each_journaled(start_daemon: Callable[..., InProcessDaemon]) -> None:
    d = start_daemon(slots=4, head_interval=100000)
    assert d.daemon is not None and d.daemon.manager is not None
    journal = d.daemon.manager.stores.journal
    with kvkeep.Client(d.address) as client:
        sessions = [client.create_session(sampling=SAMPLED, persistent=True) for _ in range(4)]
        for s in sessions:
            s.complete("Tell me about the sea", max_tokens=2)
        before = (journal.records, journal.syncs)
        errors: list[BaseException] = []
        # Each round's turns are sent together, so they share engine steps and end together.
        together = threading.Barrier(len(sessions), timeout=60)

        def turns(s: kvkeep.Session) -> None:
            try:
                for _ in range(6):
                    together.wait()
                    s.complete(" and", max_tokens=4)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=turns, args=(s,)) for s in sessions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        records, syncs = journal.records - before[0], journal.syncs - before[1]
    assert records == 24
    # Turns share a sync only when one ends while another's sync runs, which depends on how
    # fast the disk syncs; that appends sent together share one is tested above.
    assert syncs <= records, f"{records} turns took {syncs} syncs"
    print(f"{records} concurrent turns, {syncs} syncs")


def test_the_head_moves_every_interval_and_a_close_empties_the_journal(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    d = start_daemon(slots=2, head_interval=16)
    assert d.daemon is not None and d.daemon.manager is not None
    stores = d.daemon.manager.stores
    state_dir = d.settings.state_dir
    with kvkeep.Client(d.address) as client:
        s = client.create_session(sampling=SAMPLED, persistent=True)
        gen(s, "Count the waves", 4)  # under 16 tokens beyond the head (of nothing): journaled
        head = s.info().head_checkpoint_id
        assert journal_bytes(state_dir) > 0
        gen(s, "", 12)  # over 16 beyond the head: this turn saves a new one
        assert s.info().head_checkpoint_id != head
        wait_until(lambda: journal_bytes(state_dir) == 0, 10, "the journal empties")
        gen(s, "", 2)
        other = client.create_session(sampling=SAMPLED, persistent=True)
        gen(other, "Another one", 2)
        size = journal_bytes(state_dir)
        assert stores.journal.file_bytes() == size
        assert stores.disk.used() >= size
        s.close()
        wait_until(lambda: journal_bytes(state_dir) < size, 10, "the closed session's record leaves")
        assert journal_bytes(state_dir) > 0
        other.close()
        wait_until(lambda: journal_bytes(state_dir) == 0, 10, "the journal empties")
