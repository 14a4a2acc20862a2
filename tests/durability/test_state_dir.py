"""The state directory is one daemon's alone and private: a second daemon on it refuses to
start and touches nothing; what a daemon creates there is 0700/0600; the spill area does not
outlive a graceful stop; a link planted there is never followed (a daemon refuses to start on
one, and one planted after start is not written through)."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemons import GREEDY, PROBE_CACHE, DaemonProcess, InProcessDaemon, check_serving, model_path, wait_until

import kvkeep
from kvkeepd.files import StateDirError
from kvkeepd.storage.blocks.local import LocalBlockStore
from kvkeepd.storage.statedir import MARK, MARK_TEXT

STORY = "Once upon a time, in a small village by the sea, there lived"


def contents(path: Path) -> dict[str, str]:
    """Every file under path (relative name -> SHA-256 of its bytes)."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def fill(client: kvkeep.Client) -> tuple[kvkeep.Session, kvkeep.CheckpointInfo, kvkeep.Session]:
    """On a daemon with one slot and no RAM cache: a persistent session with a checkpoint
    (blocks), and an ephemeral session spilled to disk by another one taking the slot."""
    persistent = client.create_session(sampling=GREEDY, persistent=True)
    persistent.complete(STORY, max_tokens=4)
    checkpoint = persistent.checkpoint(label="kept")
    spilled = client.create_session(sampling=GREEDY)
    spilled.complete(STORY + " a fisherman", max_tokens=4)
    other = client.create_session(sampling=GREEDY)
    other.complete("Hello", max_tokens=2)  # takes the slot: `spilled` goes to disk
    assert spilled.info().residency == "cold"
    other.close()
    return persistent, checkpoint, spilled


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, under which files are world-readable unless made otherwise."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_a_second_daemon_on_the_same_state_dir_refuses_to_start(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    first = spawn_daemon("--slots", "1", "--ram-cache", "0")
    with kvkeep.Client(first.address, timeout=60) as client:
        persistent, checkpoint, spilled = fill(client)
        blocks = contents(first.state_dir / "blocks")
        spill = contents(first.state_dir / "spill")
        assert blocks and spill
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvkeepd",
                "--model",
                str(model_path()),
                "--address",
                "127.0.0.1:0",
                "--http",
                "off",
                "--state-dir",
                str(first.state_dir),
                "--threads",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode != 0
        assert second.stdout == ""
        assert second.stderr.splitlines() == [
            f"error: the state directory {first.state_dir} is in use by another kvkeep daemon "
            f"(pid {first.pid}); each daemon needs its own --state-dir"
        ]
        # Nothing of the first daemon's was wiped or removed as an orphan, and it serves on.
        assert contents(first.state_dir / "blocks") == blocks
        assert contents(first.state_dir / "spill") == spill
        assert spilled.complete(" Then", max_tokens=4).finish_reason == "length"
        assert spilled.info().n_tokens > 0
        assert persistent.restore(checkpoint.checkpoint_id).n_tokens == checkpoint.n_tokens
        check_serving(client)
    assert first.terminate() == 0


def test_what_a_daemon_creates_is_private(tmp_path: Path, umask_022: None) -> None:
    state_dir = tmp_path / "new" / "state"
    d = InProcessDaemon.with_settings(state_dir, slots=1, ram_cache=0)
    try:
        with kvkeep.Client(d.address, timeout=60) as client:
            fill(client)
        made = [state_dir, *state_dir.rglob("*")]
        names = {str(p.relative_to(state_dir)) for p in made}
        # The catalog and its WAL files, blocks, spill, key, fingerprint cache and lock.
        catalog = {"catalog.db", "catalog.db-wal", "catalog.db-shm"}
        assert catalog | {"store.key", "fingerprints.json", "lock"} <= names
        assert any(p.is_file() for p in (state_dir / "blocks").rglob("*"))
        assert any(p.is_file() for p in (state_dir / "spill").rglob("*"))
        for p in [state_dir.parent, *made]:
            mode = stat.S_IMODE(p.stat().st_mode)
            assert mode == (0o700 if p.is_dir() else 0o600), f"{p} is {mode:04o}"
    finally:
        d.stop()


def test_an_open_state_dir_is_made_private(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    state_dir.chmod(0o755)
    d = InProcessDaemon.with_settings(state_dir)
    try:
        assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    finally:
        d.stop()


def test_the_spill_area_is_wiped_at_a_graceful_stop(tmp_path: Path) -> None:
    d = InProcessDaemon.with_settings(tmp_path / "state", slots=1, ram_cache=0)
    try:
        with kvkeep.Client(d.address, timeout=60) as client:
            fill(client)
        assert any(p.is_file() for p in (tmp_path / "state" / "spill").rglob("*"))
    finally:
        d.stop()
    assert not (tmp_path / "state" / "spill").exists()
    # ...and the lock is free again: the next daemon starts on it.
    InProcessDaemon.with_settings(tmp_path / "state").stop()


# What a link planted in the state directory points to: not the daemon's, and 32 bytes (what
# a store key is, so that a daemon that followed the link would take it for one and start).
PRECIOUS = b"somebody else's file, untouched\n"
LINK = " (the daemon follows no links in its state directory)"


def snapshot(path: Path) -> list[tuple[str, int, bytes | None]]:
    """The file, or the directory and everything under it: names, modes and contents."""
    return [
        (str(p.relative_to(path)), p.lstat().st_mode, p.read_bytes() if p.is_file() else None)
        for p in [path, *sorted(path.rglob("*"))]
    ]


def elsewhere(tmp_path: Path, directory: bool) -> Path:
    """A file (0644) or a directory (0755, holding one) outside the state directory."""
    target = tmp_path / "elsewhere"
    if directory:
        target.mkdir()
        (target / "kept").write_bytes(PRECIOUS)
        target.chmod(0o755)
    else:
        target.write_bytes(PRECIOUS)
        target.chmod(0o644)
    return target


def refusal(state_dir: Path) -> list[str]:
    """The lines a daemon started on `state_dir` writes to stderr as it refuses to start (one
    that starts serving instead fails the test)."""
    ready = state_dir.parent / "ready"
    command = [
        sys.executable,
        "-m",
        "kvkeepd",
        "--model",
        str(model_path()),
        "--address",
        "127.0.0.1:0",
        "--http",
        "off",
        "--state-dir",
        str(state_dir),
        "--threads",
        "1",
        "--probe-cache",
        str(PROBE_CACHE),
        "--ready-file",
        str(ready),
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            wait_until(lambda: proc.poll() is not None or ready.exists(), 120, "the daemon to exit")
        finally:
            if proc.poll() is None:
                proc.kill()
        out, err = proc.communicate(timeout=30)
    assert not ready.exists(), f"a daemon started on {state_dir}:\n{err}"
    assert proc.returncode != 0
    assert out == ""
    return err.splitlines()


@pytest.mark.parametrize(
    ("entry", "directory"),
    [
        ("lock", False),
        ("journal", False),
        ("store.key", False),
        ("catalog.db", False),
        ("blocks", True),
        ("blocks/ab", True),
        ("spill", True),
    ],
)
def test_a_link_planted_in_the_state_dir_refuses_the_start(
    tmp_path: Path, entry: str, directory: bool
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    if "/" in entry:
        (state_dir / "blocks").mkdir(mode=0o700)
    target = elsewhere(tmp_path, directory)
    before = snapshot(target)
    link = state_dir / entry
    link.symlink_to(target)
    kind = "a directory" if directory else "a file"
    assert refusal(state_dir) == [
        f"error: {link} is a symbolic link where the daemon keeps {kind}{LINK}: remove it and start again"
    ]
    assert snapshot(target) == before
    assert link.is_symlink()


def test_an_entry_of_another_kind_refuses_the_start(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / "journal").mkdir()
    assert refusal(state_dir) == [
        f"error: {state_dir / 'journal'} is a directory where the daemon keeps a file: remove it and "
        "start again"
    ]
    (state_dir / "journal").rmdir()
    os.mkfifo(state_dir / "spill")
    assert refusal(state_dir) == [
        f"error: {state_dir / 'spill'} is a named pipe where the daemon keeps a directory: remove it "
        "and start again"
    ]


def test_a_block_file_that_is_a_link_refuses_the_start(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    (state_dir / "blocks" / "ab").mkdir(mode=0o700, parents=True)
    state_dir.chmod(0o700)
    (state_dir / MARK).write_bytes(MARK_TEXT)  # a directory of this format
    target = elsewhere(tmp_path, directory=False)
    before = snapshot(target)
    link = state_dir / "blocks" / "ab" / ("ab" + "0" * 62)
    link.symlink_to(target)
    with pytest.raises(StateDirError) as refused:
        InProcessDaemon.with_settings(state_dir)
    assert str(refused.value) == (
        f"{link} is a symbolic link where the daemon keeps a file{LINK}: remove it and start again"
    )
    assert snapshot(target) == before


def test_links_planted_at_new_key_prefixes_after_start_are_not_written_through(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    target = elsewhere(tmp_path, directory=True)
    before = snapshot(target)
    d = InProcessDaemon.with_settings(state_dir)
    try:
        with kvkeep.Client(d.address, timeout=60) as client:
            session = client.create_session(sampling=GREEDY, persistent=True)
            session.complete(STORY, max_tokens=4)
            blocks = state_dir / "blocks"
            planted = [blocks / f"{i:02x}" for i in range(256) if not (blocks / f"{i:02x}").exists()]
            for link in planted:
                link.symlink_to(target)
            with pytest.raises(kvkeep.StoreWriteError):
                session.checkpoint(label="through a link")
            assert snapshot(target) == before
            assert not any(p.is_file() for p in (blocks / "tmp").iterdir())
            for link in planted:
                link.unlink()
            assert session.checkpoint(label="kept").n_tokens > 0
            session.close()
    finally:
        d.stop()
    assert snapshot(target) == before


def test_a_link_planted_at_a_block_path_after_start_is_replaced_not_followed(tmp_path: Path) -> None:
    store = LocalBlockStore(tmp_path / "blocks")
    target = elsewhere(tmp_path, directory=False)
    before = snapshot(target)
    key = "ab" + "1" * 62
    (tmp_path / "blocks" / "ab").mkdir(mode=0o700)
    (tmp_path / "blocks" / "ab" / key).symlink_to(target)
    assert not store.has(key)
    assert store.put(key, b"the block") == len(b"the block")
    assert store.get(key) == b"the block"
    assert not (tmp_path / "blocks" / "ab" / key).is_symlink()
    assert snapshot(target) == before


def test_a_link_planted_at_the_journals_new_file_after_start_is_not_followed(tmp_path: Path) -> None:
    """Closing a persistent session erases its turns from the journal: the file is written
    again, as a new file renamed over it, with the other sessions' records."""
    state_dir = tmp_path / "state"
    target = elsewhere(tmp_path, directory=False)
    before = snapshot(target)
    d = InProcessDaemon.with_settings(state_dir)
    try:
        with kvkeep.Client(d.address, timeout=60) as client:
            kept = client.create_session(sampling=GREEDY, persistent=True)
            kept.complete(STORY, max_tokens=4)
            closed = client.create_session(sampling=GREEDY, persistent=True)
            closed.complete(STORY + " a fisherman", max_tokens=4)
            journal = state_dir / "journal"
            assert journal.stat().st_size > 0
            (state_dir / "journal.tmp").symlink_to(target)
            closed.close()
            wait_until(lambda: not (state_dir / "journal.tmp").is_symlink(), 30, "the journal's rewrite")
            assert snapshot(target) == before
            assert not journal.is_symlink()
            assert stat.S_IMODE(journal.stat().st_mode) == 0o600
            kept.complete(" Then", max_tokens=4)
            assert snapshot(target) == before
            kept.close()
    finally:
        d.stop()


def test_a_state_dir_of_the_earlier_name_is_refused_not_read(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / "catalog.db").write_bytes(b"SQLite format 3\0")
    (state_dir / "catalog.db").chmod(0o600)
    assert refusal(state_dir) == [
        f"error: the state directory {state_dir} was written by an earlier version (kvstash), whose "
        "state kvkeep does not read: move it away, or start with another --state-dir"
    ]
    assert not (state_dir / "kvkeep-state").exists()
    (state_dir / "catalog.db").unlink()
    (state_dir / "kvkeep-state").write_bytes(b"kvkeep state 2\n")
    (state_dir / "kvkeep-state").chmod(0o600)
    assert refusal(state_dir) == [
        f"error: the state directory {state_dir} is of another format (b'kvkeep state 2\\n' in "
        "kvkeep-state): start with another --state-dir"
    ]
