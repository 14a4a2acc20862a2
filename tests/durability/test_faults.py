"""Faults injected, nothing lost: a full disk (the state directory on a small tmpfs) and
fsync failing with EIO, during autosaves (a turn's journal record, or its new head),
checkpoints, spills and imports.

Each time: the request fails with RESOURCE_EXHAUSTED, the daemon keeps serving, the last
good checkpoint restores and continues exactly, no temporary file is left, every block file
belongs to a committed checkpoint (the blocks of a commit that failed are reclaimed at once,
not at the next start), and once the disk has room again the same requests succeed. A turn
whose autosave failed is undone, so sending it again does not repeat it in the history; so
are a restore and a rewind whose new head cannot be saved, and a conversation sent whole
that parts from the history: the session then serves exactly what it served before (its
history, and its next tokens and log-probabilities), and its durable head is the old one.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from checkpoint_helpers import GREEDY, SAMPLED, block_files, gen, ids, long_text, own_daemon
from daemons import InProcessDaemon
from faults import FailingFsync

import kvkeep
from kvkeepd import files
from kvkeepd.storage import journal

DISK = 24 << 20
# Turns of 70 tokens save a head (their blocks), not only a journal record.
HEAD_INTERVAL = 64


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs: a disk that really fills up."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mnt)], check=False)
    if done.returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path, keep: int) -> Path:
    """Take all of the disk's free space but `keep` bytes."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    filler = disk / "filler"
    with filler.open("wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(free - keep, 1))
    return filler


def orphans(d: InProcessDaemon) -> list[str]:
    """Block files no catalog row knows, and unfinished writes."""
    state = d.settings.state_dir
    db = sqlite3.connect(state / "catalog.db")
    try:
        known = {r[0] for r in db.execute("SELECT block FROM blocks")}
    finally:
        db.close()
    tmp = [p.name for p in (state / "blocks" / "tmp").iterdir()]
    return tmp + [k for k in block_files(state) if k not in known]


@pytest.fixture
def on_small_disk(small_disk: Path) -> Iterator[tuple[InProcessDaemon, kvkeep.Client, Path]]:
    with (
        own_daemon(small_disk / "state", head_interval=HEAD_INTERVAL) as d,
        kvkeep.Client(d.address, timeout=120) as client,
    ):
        yield d, client, small_disk


def test_a_full_disk_fails_autosaves_and_checkpoints_and_loses_nothing(
    on_small_disk: tuple[InProcessDaemon, kvkeep.Client, Path],
) -> None:
    d, client, disk = on_small_disk
    s = client.create_session(persistent=True, sampling=GREEDY)
    s.complete(long_text(20), max_tokens=1)  # ~370 tokens: 8.5 MB of blocks
    good = s.checkpoint("good")
    expected = ids(gen(s.fork(), n=70))
    n_before = s.info().n_tokens
    # Room for one new block (1.5 MB), not for the two the next autosave writes.
    filler = fill(disk, keep=2_000_000)

    with pytest.raises(kvkeep.BusyError, match="state store is failing"):
        gen(s, n=70)  # its autosave needs a new block: no room
    assert s.info().n_tokens == n_before  # the turn was undone
    filler.unlink()
    filler = fill(disk, keep=0)
    with pytest.raises(kvkeep.BusyError, match="state store is failing"):
        gen(s, n=2)  # its journal record: no room for it either
    assert s.info().n_tokens == n_before
    with pytest.raises(kvkeep.BusyError, match="state store is failing"):
        client.create_session(persistent=True, sampling=GREEDY).complete(
            long_text(20, topic="orchard"), max_tokens=1
        )
    assert orphans(d) == []
    assert client.info().slots >= 1

    filler.unlink()  # room again: no restart needed
    assert ids(gen(s, n=70)) == expected  # the same turn, sent again, is the same
    s.restore(good.checkpoint_id)
    assert ids(gen(s, n=70)) == expected
    assert orphans(d) == []


def durable_head(d: InProcessDaemon, session_id: str) -> str:
    """The session's head as the catalog has it."""
    db = sqlite3.connect(d.settings.state_dir / "catalog.db")
    try:
        return str(db.execute("SELECT head FROM sessions WHERE session_id = ?", (session_id,)).fetchone()[0])
    finally:
        db.close()


GO_ON = " Once upon a time, in a village by the sea, there lived a"


def served(s: kvkeep.Session) -> tuple[Any, ...]:
    """What a session serves, as its info says."""
    info = s.info()
    return info.n_tokens, info.messages, info.sampling, info.head_checkpoint_id, info.n_checkpoints


def test_a_restore_or_rewind_whose_head_cannot_be_saved_is_undone_exactly(
    on_small_disk: tuple[InProcessDaemon, kvkeep.Client, Path],
) -> None:
    d, client, disk = on_small_disk
    s = client.create_session(persistent=True, sampling=SAMPLED)
    s.chat(long_text(6), max_tokens=4)
    own = s.checkpoint("own")
    s.chat("And then?", max_tokens=6)
    other = s.fork(persistent=True)
    other.chat("Something else.", max_tokens=4)
    theirs = other.checkpoint("theirs")  # not s's own: restoring it loads its state
    before, head = served(s), durable_head(d, s.session_id)
    # Sampled: the sampler's position must be put back too. From the middle of a sentence,
    # which the model does not end at once.
    expected = gen(s.fork(), GO_ON, n=12)

    # The restores and the rewind change the session in memory, then fail to save its new
    # head: the catalog's database cannot grow on the full disk.
    filler = fill(disk, keep=0)
    for change in (
        lambda: s.restore(own.checkpoint_id),  # its cells cut in place
        lambda: s.restore(theirs.checkpoint_id),  # another state loaded
        lambda: s.rewind(own.n_tokens),
    ):
        with pytest.raises(kvkeep.BusyError, match="the session is as it was before this request"):
            change()
        assert served(s) == before
        assert durable_head(d, s.session_id) == head
        assert gen(s.fork(), GO_ON, n=12) == expected
    filler.unlink()
    assert gen(s, GO_ON, n=12) == expected
    assert s.restore(theirs.checkpoint_id).n_tokens == theirs.n_tokens
    assert durable_head(d, s.session_id) != head
    assert orphans(d) == []


def test_a_full_disk_fails_an_import_and_leaves_nothing(
    on_small_disk: tuple[InProcessDaemon, kvkeep.Client, Path], tmp_path: Path
) -> None:
    d, client, disk = on_small_disk
    s = client.create_session(persistent=True, sampling=GREEDY)
    s.complete(long_text(20), max_tokens=1)
    good = s.checkpoint("good")
    expected = ids(gen(s.fork(), n=6))
    export = tmp_path / "good.kvs"
    client.export_checkpoint(good.checkpoint_id, export)
    before = set(block_files(d.settings.state_dir))
    # Room for the export's spool and one block, not for all its blocks under their own salt.
    filler = fill(disk, keep=export.stat().st_size + 2_000_000)
    with pytest.raises(kvkeep.BusyError):
        client.import_checkpoint(export)
    assert set(block_files(d.settings.state_dir)) == before
    assert orphans(d) == []
    assert [p for p in d.settings.state_dir.iterdir() if p.name.startswith("tmp")] == []
    filler.unlink()
    imported = client.import_checkpoint(export)
    assert ids(gen(client.fork_session(checkpoint_id=imported.checkpoint_id), n=6)) == expected


def test_a_full_disk_drops_a_spill_and_the_session_evaluates_again(small_disk: Path) -> None:
    with (
        own_daemon(small_disk / "state", slots=1, ram_cache=1_000_000) as d,
        kvkeep.Client(d.address, timeout=120) as client,
    ):
        a = client.create_session(sampling=GREEDY)
        a.complete(long_text(20), max_tokens=1)
        expected = ids(gen(a.fork(), n=6))
        filler = fill(small_disk, keep=256 << 10)
        b = client.create_session(sampling=GREEDY)
        b.complete("Another one takes the only slot.", max_tokens=2)  # a is evicted: no room anywhere
        assert ids(gen(a, n=6)) == expected  # its history is evaluated again, exactly
        assert [p for p in (d.settings.state_dir / "spill").rglob("*") if p.is_file()] == []
        filler.unlink()


def test_fsync_failing_with_eio_fails_the_checkpoint_and_loses_nothing(
    start_daemon: Callable[..., InProcessDaemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    faulty = FailingFsync()
    monkeypatch.setattr(files, "os", faulty)  # the block store writes through files.write_new
    monkeypatch.setattr(journal, "os", faulty)
    d = start_daemon(ctx_per_session=1024, head_interval=HEAD_INTERVAL)
    with kvkeep.Client(d.address, timeout=120) as client:
        s = client.create_session(persistent=True, sampling=GREEDY)
        s.complete(long_text(10), max_tokens=1)
        good = s.checkpoint("good")
        expected = ids(gen(s.fork(), n=70))
        faulty.failing = True
        with pytest.raises(kvkeep.BusyError, match="state store is failing"):
            gen(s, n=70)  # a new head
        with pytest.raises(kvkeep.BusyError, match="state store is failing"):
            gen(s, n=2)  # a journal record
        faulty.failing = False
        assert faulty.failed >= 2
        assert orphans(d) == []
        assert ids(gen(s, n=70)) == expected
        assert s.checkpoint("after").n_tokens == good.n_tokens + 70
        s.restore(good.checkpoint_id)
        assert ids(gen(s, n=70)) == expected


def test_a_conversation_that_parts_from_the_history_and_cannot_be_saved_is_undone_exactly(
    start_daemon: Callable[..., InProcessDaemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    faulty = FailingFsync()
    monkeypatch.setattr(journal, "os", faulty)
    d = start_daemon()
    with kvkeep.Client(d.address, timeout=120) as client:
        s = client.create_session("You answer in a few words.", persistent=True, sampling=SAMPLED)
        s.chat("Name a bird.", max_tokens=4)
        s.chat("And a tree?", max_tokens=4)
        before = served(s)
        expected = gen(s.fork(), long_text(2), n=12)
        # Another conversation: the session keeps what matches (its system prompt) and cuts
        # the rest, then cannot make the turn durable (its journal record is not synced).
        faulty.failing = True
        with pytest.raises(kvkeep.BusyError, match="the session is as it was before this request"):
            s.chat([kvkeep.Message("user", "Name a fish.")], whole=True, max_tokens=4)
        faulty.failing = False
        assert served(s) == before
        assert gen(s.fork(), long_text(2), n=12) == expected
        assert gen(s, long_text(2), n=12) == expected
