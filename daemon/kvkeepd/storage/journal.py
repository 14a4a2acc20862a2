"""The turn journal: the durable record of persistent sessions' turns since their heads.

A persistent session's turn is acknowledged once its record is durable: an append to one
file, then `fdatasync`. The KV blocks of the turn are not written then; they are a cache
that a later head save writes (every `--head-interval` tokens, on a spill, at shutdown),
and after a crash the session continues from its head, evaluating again only the tokens
the journal holds beyond it (exact: see docs/design/durability.md and docs/design/exactness.md).

Group commit: appends made in one pass of the event loop go to the committer thread
together, and whatever queues up while it writes and syncs goes in its next write, so
concurrent turns of different sessions share one `fdatasync` (`syncs` and `records` count
both). A record is the key (a session id) and an opaque body (persistence.py's), framed:

    b"KVJ1" | u32 body length | u32 CRC-32 of key and body | u8 key length | key | body

Reading at start keeps the newest intact record of each key and stops at the first frame
that is torn or fails its checksum (what a kill during a write leaves at the tail); the
file is cut there, so later appends never follow garbage. The file is kept short: once
every record is covered by a head (`forget`) it is truncated, and when the records no
longer needed outweigh the live ones it is rewritten with the live ones only. Its bytes
count against the disk budget. `TurnJournal` is the interface; `FileJournal` is the local
file, `SharedJournal` (shared_journal.py) the catalog server's, for daemons sharing a catalog.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvkeepd.errors import Busy, StoreWriteFailed
from kvkeepd.files import FILE_MODE, fsync_dir, open_private
from kvkeepd.storage.budget import DiskBudget

log = logging.getLogger(__name__)

MAGIC = b"KVJ1"
_HEAD = struct.Struct("<4sII")
MAX_RECORD = 64 << 20  # a frame claiming more is damage, not a record
# A file at most this long is never rewritten just to drop records no longer needed.
COMPACT_FLOOR = 1 << 20


class TurnJournal(Protocol):
    """Where persistent sessions' turns are made durable before they are acknowledged."""

    syncs: int
    records: int

    def recovered(self) -> dict[str, bytes]:
        """The newest intact record body of each key found at start."""
        ...

    async def append(self, key: str, body: bytes, *, fence: int = 0, n_tokens: int = 0) -> None:
        """Make `body` the key's record, durably; returns once it is. StoreWriteFailed if
        the write or the sync fails (the record is then not kept), Busy if the disk
        budget has no room. `fence`: the session's lease token, `n_tokens`: its length
        (what a shared journal checks and lists)."""
        ...

    def record(self, key: str) -> bytes | None:
        """The key's newest record as the journal holds it now, for a daemon taking the
        session over (blocking); a local journal's are read at start (`recovered`)."""
        ...

    def forget(self, key: str, *, erase: bool = False) -> None:
        """The key's record is no longer needed (its head covers it, or it is closed);
        with `erase`, its bytes leave the file now (a closed session's conversation).
        Ordered after the key's earlier appends. Call from the event loop."""
        ...

    def file_bytes(self) -> int:
        """Bytes the journal holds on disk."""
        ...

    def close(self) -> None:
        """Finish what is queued and stop."""
        ...


def settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    """Complete an append's future with its outcome, unless it is already done (its waiter
    was cancelled, which cancels a future awaited directly)."""
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
        # NOTE: marked retrieved because a waiter behind `asyncio.shield` (the shared journal's)
        # may have been cancelled meanwhile, leaving the future to nobody: asyncio would log
        # "exception was never retrieved" when it is collected. A waiter still there gets the
        # exception raised all the same.
        done.exception()


def frame(key: str, body: bytes) -> bytes:
    k = key.encode()
    if len(k) > 255:
        raise ValueError("a journal key has at most 255 bytes")
    payload = bytes([len(k)]) + k + body
    return _HEAD.pack(MAGIC, len(body), zlib.crc32(payload)) + payload


def read_frames(data: bytes) -> tuple[dict[str, bytes], int]:
    """The newest record body of each key, and the length of the intact part of `data`
    (what precedes the first torn or damaged frame)."""
    found: dict[str, bytes] = {}
    at = 0
    while at + _HEAD.size + 1 <= len(data):
        magic, n, crc = _HEAD.unpack_from(data, at)
        k = data[at + _HEAD.size]
        end = at + _HEAD.size + 1 + k + n
        if magic != MAGIC or n > MAX_RECORD or end > len(data):
            break
        payload = data[at + _HEAD.size : end]
        if zlib.crc32(payload) != crc:
            break
        try:
            key = payload[1 : 1 + k].decode()
        except UnicodeDecodeError:
            break
        found[key] = payload[1 + k :]
        at = end
    return found, at


@dataclass
class _Append:
    key: str
    data: bytes
    done: Callable[[BaseException | None], None]


@dataclass
class _Forget:
    key: str
    erase: bool


class FileJournal:
    """A journal in one append-only file, written by one committer thread."""

    def __init__(self, path: Path, budget: DiskBudget | None = None) -> None:
        self.path = path
        self.budget = budget
        self.syncs = 0
        self.records = 0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)  # a rewrite a crash cut short: the old file is whole
        # One descriptor, opened without following a link, reads, cuts and appends: the path
        # is not opened again (a rewrite's new file is made with O_EXCL and renamed over it).
        self._fd = open_private(path, os.O_RDWR | os.O_APPEND)
        try:
            data = _read_all(self._fd)
            found, good = read_frames(data)
            if good < len(data):
                log.warning(
                    "the turn journal ends in %d bytes that are not an intact record (a write cut "
                    "short, or damage); they are dropped",
                    len(data) - good,
                )
                os.ftruncate(self._fd, good)
                os.fsync(self._fd)
        except BaseException:
            os.close(self._fd)
            raise
        self._recovered = found
        # The newest frame of each key not yet covered (what a rewrite keeps); the file's length.
        self._frames = {key: frame(key, body) for key, body in self._recovered.items()}
        self._size = good
        self._dir_synced = True
        self._pending: list[_Append | _Forget] = []
        self._kicked = False
        self._queue: queue.SimpleQueue[list[_Append | _Forget] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._commit_loop, name="kvkeep-journal", daemon=True)
        self._thread.start()

    @property
    def _tmp(self) -> Path:
        return self.path.with_name(self.path.name + ".tmp")

    def recovered(self) -> dict[str, bytes]:
        return dict(self._recovered)

    def file_bytes(self) -> int:
        with self._lock:
            return self._size

    def record(self, key: str) -> bytes | None:
        """None: sessions of a local journal are all loaded at start, with `recovered`."""
        return None

    async def append(self, key: str, body: bytes, *, fence: int = 0, n_tokens: int = 0) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finish(error: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(settle, done, error)

        self._enqueue(_Append(key, frame(key, body), finish))
        await done

    def forget(self, key: str, *, erase: bool = False) -> None:
        self._enqueue(_Forget(key, erase))

    def _enqueue(self, item: _Append | _Forget) -> None:
        self._pending.append(item)
        if not self._kicked:
            # Everything queued in this pass of the loop goes to the committer together.
            self._kicked = True
            asyncio.get_running_loop().call_soon(self._kick)

    def _kick(self) -> None:
        batch, self._pending, self._kicked = self._pending, [], False
        self._queue.put(batch)

    def close(self) -> None:
        """Call from the event loop (what is queued in this pass is written first); waits
        for the committer thread."""
        if self._kicked:
            self._kick()
        self._queue.put(None)
        self._thread.join(30)
        with contextlib.suppress(OSError):
            os.close(self._fd)

    # ---- the committer thread ------------------------------------------------------------------

    def _commit_loop(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            # Batches that queued up during the last write join this one.
            closing = False
            while not self._queue.empty():
                more = self._queue.get_nowait()
                if more is None:
                    closing = True
                    break
                batch += more
            self._commit(batch)
            if closing:
                return

    def _commit(self, batch: list[_Append | _Forget]) -> None:
        # Runs of appends between forgets are one write and one sync each (a forget is
        # rare: a head save or a close).
        run: list[_Append] = []
        for item in batch:
            if isinstance(item, _Append):
                run.append(item)
                continue
            self._write(run)
            run = []
            self._drop(item)
        self._write(run)
        self._compact_if_worthwhile()

    def _write(self, run: list[_Append]) -> None:
        if not run:
            return
        data = b"".join(a.data for a in run)
        error: BaseException | None = None
        try:
            with self.budget.reserve(len(data)) if self.budget else contextlib.nullcontext():
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(self._fd, view) :]
                    os.fdatasync(self._fd)
                    if not self._dir_synced:  # a rewrite's rename not yet known durable
                        fsync_dir(self.path.parent)
                        self._dir_synced = True
                except OSError as e:
                    log.error("the turn journal failed: %s", e)
                    # No record of this write may survive: the turns are reported failed.
                    try:
                        os.ftruncate(self._fd, self._size)
                    except OSError as again:
                        log.error("the turn journal could not be cut back: %s", again)
                    error = StoreWriteFailed("the state store is failing (disk full?); nothing was saved")
        except Busy as e:
            error = e
        if error is None:
            with self._lock:
                self._size += len(data)
                for a in run:
                    self._frames[a.key] = a.data
            self.syncs += 1
            self.records += len(run)
        for a in run:
            a.done(error)

    def _drop(self, item: _Forget) -> None:
        with self._lock:
            had = self._frames.pop(item.key, None) is not None
            left = bool(self._frames)
        if had and item.erase and left:
            self._rewrite()

    def _compact_if_worthwhile(self) -> None:
        with self._lock:
            live = sum(len(f) for f in self._frames.values())
            size = self._size
        if not live:
            if size:
                self._truncate()
        elif size > COMPACT_FLOOR and size > 2 * live:
            self._rewrite()

    def _truncate(self) -> None:
        """Every record is covered: the file is emptied (not synced: records that came back
        after a crash would be ignored, each older than its session's head)."""
        try:
            os.ftruncate(self._fd, 0)
        except OSError as e:
            log.error("the turn journal could not be emptied: %s", e)
            return
        with self._lock:
            self._size = 0

    def _rewrite(self) -> None:
        """The file again with only the live records: written beside it, synced, renamed
        over it. A failure before the rename leaves the old file (its extra records are
        harmless); after it, appends go to the new file, and until its directory entry is
        known durable each write syncs the directory too."""
        with self._lock:
            data = b"".join(self._frames.values())
        tmp = self._tmp
        fd = -1
        try:
            with self.budget.reserve(len(data)) if self.budget else contextlib.nullcontext():
                # A new file (whatever was planted at its name is unlinked, not written through).
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(tmp, flags, FILE_MODE)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fdatasync(fd)
                os.replace(tmp, self.path)
        except (OSError, Busy) as e:
            log.warning("the turn journal was not compacted: %s", e)
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        # The renamed file is the journal now; its descriptor follows it.
        old, self._fd = self._fd, fd
        os.close(old)
        with self._lock:
            self._size = len(data)
        self._sync_dir()

    def _sync_dir(self) -> None:
        try:
            fsync_dir(self.path.parent)
        except OSError as e:
            log.error("the turn journal's directory could not be synced: %s", e)
            self._dir_synced = False
        else:
            self._dir_synced = True


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)
