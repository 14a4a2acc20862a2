"""The state directory is one daemon's alone and private: a second daemon on it refuses to
start and touches nothing; what a daemon creates there is 0700/0600; the spill area does not
outlive a graceful stop."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemons import GREEDY, DaemonProcess, InProcessDaemon, check_serving, model_path

import kvstash

STORY = "Once upon a time, in a small village by the sea, there lived"


def contents(path: Path) -> dict[str, str]:
    """Every file under path (relative name -> SHA-256 of its bytes)."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def fill(client: kvstash.Client) -> tuple[kvstash.Session, kvstash.CheckpointInfo, kvstash.Session]:
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
    with kvstash.Client(first.address, timeout=60) as client:
        persistent, checkpoint, spilled = fill(client)
        blocks = contents(first.state_dir / "blocks")
        spill = contents(first.state_dir / "spill")
        assert blocks and spill
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvstashd",
                "--model",
                str(model_path()),
                "--address",
                "127.0.0.1:0",
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
            f"error: the state directory {first.state_dir} is in use by another kvstash daemon "
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
        with kvstash.Client(d.address, timeout=60) as client:
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
        with kvstash.Client(d.address, timeout=60) as client:
            fill(client)
        assert any(p.is_file() for p in (tmp_path / "state" / "spill").rglob("*"))
    finally:
        d.stop()
    assert not (tmp_path / "state" / "spill").exists()
    # ...and the lock is free again: the next daemon starts on it.
    InProcessDaemon.with_settings(tmp_path / "state").stop()
