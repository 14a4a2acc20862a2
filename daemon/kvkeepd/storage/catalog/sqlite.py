"""The embedded catalog: sqlite3 (WAL) tables in the state directory, one daemon's alone.

A checkpoint row, with its manifest and references, is committed in one transaction, after
the blocks it references are durable. The database file is created 0600 (it holds
conversations in plain text; sqlite gives -wal and -shm its mode). A read that fails is
StoreReadFailed; a write's sqlite3.Error is left to the caller (store_write). One daemon
holds the state directory (its lock), so it holds every session's lease: the lease methods
grant them all and fencing tokens are not checked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from kvkeepd.errors import StoreReadFailed
from kvkeepd.files import check_entry, private_file
from kvkeepd.storage.catalog import (
    RECORD_HEAD,
    CheckpointRow,
    Claim,
    Lease,
    ListedSession,
    Reservation,
    SessionRow,
)
from kvkeepd.storage.catalog.sqlite_schema import COLUMNS, SCHEMA

log = logging.getLogger(__name__)

# Session ids bound in one counting query (well under sqlite's limit on variables).
_IDS_PER_QUERY = 500
# A tenant's stored bytes (Catalog.stored_bytes): its distinct blocks, its manifests and its
# stored responses' records.
_STORED = (
    "SELECT (SELECT COALESCE(SUM(size), 0) FROM blocks WHERE block IN (SELECT refs.block FROM refs "
    "JOIN checkpoints USING (checkpoint_id) WHERE checkpoints.tenant = ?1)) "
    "+ (SELECT COALESCE(SUM(LENGTH(manifest)), 0) FROM checkpoints WHERE tenant = ?1) "
    "+ (SELECT COALESCE(SUM(LENGTH(record)), 0) FROM responses JOIN checkpoints USING (checkpoint_id) "
    "WHERE tenant = ?1)"
)


class SqliteCatalog:
    """Thread-safe access to one catalog database (a file, or ':memory:')."""

    shared = False

    def __init__(self, path: Path | str) -> None:
        self.path = None if str(path) == ":memory:" else Path(path)
        if self.path is not None:
            # sqlite opens its files itself, following links: each is checked first (a link
            # or a thing of another kind is StateDirError), the database made 0600 if new.
            private_file(self.path)
            for suffix in ("-wal", "-shm", "-journal"):
                check_entry(Path(f"{self.path}{suffix}"))
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        # Blocks used since the last write transaction, and when (see touch).
        self._touched: dict[str, float] = {}
        # Saves' holds on their tenants' quotas (reserve_stored): id -> (tenant, bytes). In
        # RAM: the saves they are for are this process's, and end with it.
        self._reserved: dict[str, tuple[str, int]] = {}
        with self._reading():  # a catalog that cannot be read stops the daemon's start
            if str(path) != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
            # Catalogs made before tenants existed: their rows are the anonymous tenant's.
            for table in ("sessions", "checkpoints"):
                columns = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
                if "tenant" not in columns:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN tenant TEXT NOT NULL DEFAULT ''")
            self._db.execute("CREATE INDEX IF NOT EXISTS checkpoints_tenant ON checkpoints (tenant)")
            # A tenant's stored responses in their listing's order (tenant_responses).
            self._db.execute(
                "CREATE INDEX IF NOT EXISTS checkpoints_responses ON checkpoints "
                "(tenant, created_at, checkpoint_id) WHERE kind = 'response'"
            )
            found = self._db.execute("SELECT COALESCE(SUM(LENGTH(manifest)), 0) FROM checkpoints").fetchone()
            self._manifest_bytes = int(found[0])

    @property
    def manifest_bytes(self) -> int:
        """Bytes of the manifests held (what a catalog in RAM takes, near enough)."""
        return self._manifest_bytes

    def file_bytes(self) -> int:
        """Bytes of the database on disk, its write-ahead log included (0 in RAM)."""
        if self.path is None:
            return 0
        total = 0
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(f"{self.path}{suffix}").st_size
        return total

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """The lock, for a read: a database that cannot be read is StoreReadFailed."""
        with self._lock:
            try:
                yield
            except sqlite3.Error as e:
                log.error("cannot read the catalog: %s", e)
                raise StoreReadFailed("the state store cannot be read (see the daemon's log)") from None

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction; the manifest count is taken again if it rolls back."""
        with self._lock:
            try:
                with self._db:
                    self._db.execute("BEGIN IMMEDIATE")
                    self._write_touched()
                    yield
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    found = self._db.execute(
                        "SELECT COALESCE(SUM(LENGTH(manifest)), 0) FROM checkpoints"
                    ).fetchone()
                    self._manifest_bytes = int(found[0])
                raise

    def add_checkpoint(
        self,
        row: CheckpointRow,
        manifest: bytes,
        blocks: Iterable[tuple[str, int]],
        now: float,
        head_of: str | None = None,
        fence: int = 0,
        claimed_at: float = 0.0,
        response: bytes | None = None,
        reservation: str = "",
    ) -> str | None:
        """Commit a checkpoint and its references. With head_of, it becomes that session's
        head and the previous head is deleted; its id is returned. (One daemon's: its
        store's lock orders saves and sweeps, so claims need no checking.) With `response`,
        the stored response's record commits with it; `reservation` is let go."""
        with self._transaction():
            # Under the lock reserve_stored takes: the checkpoint's bytes replace the hold.
            self._reserved.pop(reservation, None)
            self._db.execute(
                f"INSERT INTO checkpoints ({COLUMNS}, manifest) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    row.checkpoint_id,
                    row.session_id,
                    row.label,
                    row.kind,
                    row.n_tokens,
                    row.bytes_written,
                    row.bytes_referenced,
                    row.created_at,
                    row.tenant,
                    manifest,
                ),
            )
            self._manifest_bytes += len(manifest)
            if response is not None:
                self._db.execute(
                    "INSERT INTO responses (checkpoint_id, created_at, record) VALUES (?,?,?)",
                    (row.checkpoint_id, row.created_at, response),
                )
            for key, size in blocks:
                self._db.execute(
                    "INSERT INTO blocks (block, size, last_used) VALUES (?,?,?) "
                    "ON CONFLICT (block) DO UPDATE SET last_used = excluded.last_used",
                    (key, size, now),
                )
                self._db.execute(
                    "INSERT OR IGNORE INTO refs (checkpoint_id, block) VALUES (?,?)",
                    (row.checkpoint_id, key),
                )
            old: str | None = None
            if head_of is not None:
                found = self._db.execute(
                    "SELECT head FROM sessions WHERE session_id = ?", (head_of,)
                ).fetchone()
                old = found[0] if found else None
                self._db.execute(
                    "INSERT INTO sessions (session_id, created_at, head, tenant) VALUES (?,?,?,?) "
                    "ON CONFLICT (session_id) DO UPDATE SET head = excluded.head",
                    (head_of, row.created_at, row.checkpoint_id, row.tenant),
                )
                if old is not None:
                    self._delete(old)
            return old

    def _forget_manifests(self, where: str, arg: str) -> None:
        found = self._db.execute(
            f"SELECT COALESCE(SUM(LENGTH(manifest)), 0) FROM checkpoints WHERE {where} = ?", (arg,)
        ).fetchone()
        self._manifest_bytes -= int(found[0])

    def _delete(self, checkpoint_id: str) -> None:
        self._forget_manifests("checkpoint_id", checkpoint_id)
        self._db.execute("DELETE FROM refs WHERE checkpoint_id = ?", (checkpoint_id,))
        self._db.execute("DELETE FROM responses WHERE checkpoint_id = ?", (checkpoint_id,))
        self._db.execute("DELETE FROM checkpoints WHERE checkpoint_id = ?", (checkpoint_id,))

    def get(self, checkpoint_id: str) -> tuple[CheckpointRow, bytes] | None:
        with self._reading():
            found = self._db.execute(
                f"SELECT {COLUMNS}, manifest FROM checkpoints WHERE checkpoint_id = ?",
                (checkpoint_id,),
            ).fetchone()
        if found is None:
            return None
        return CheckpointRow(*found[:-1]), bytes(found[-1])

    def checkpoints(self, session_id: str, include_heads: bool = False) -> list[CheckpointRow]:
        kinds = ("explicit", "head") if include_heads else ("explicit",)
        with self._reading():
            rows = self._db.execute(
                f"SELECT {COLUMNS} FROM checkpoints WHERE session_id = ? AND kind IN "
                f"({','.join('?' * len(kinds))}) ORDER BY created_at",
                (session_id, *kinds),
            ).fetchall()
        return [CheckpointRow(*r) for r in rows]

    def response(self, checkpoint_id: str) -> tuple[CheckpointRow, bytes] | None:
        """A stored response's checkpoint row and record, or None."""
        columns = ", ".join(f"c.{c.strip()}" for c in COLUMNS.split(","))
        with self._reading():
            found = self._db.execute(
                f"SELECT {columns}, r.record FROM responses r JOIN checkpoints c USING (checkpoint_id) "
                "WHERE r.checkpoint_id = ?",
                (checkpoint_id,),
            ).fetchone()
        if found is None:
            return None
        return CheckpointRow(*found[:-1]), bytes(found[-1])

    def old_responses(self, created_before: float, limit: int) -> list[str]:
        """Stored responses' checkpoint ids made before `created_before`, oldest first."""
        with self._reading():
            rows = self._db.execute(
                "SELECT checkpoint_id FROM responses WHERE created_at < ? ORDER BY created_at LIMIT ?",
                (created_before, limit),
            ).fetchall()
        return [r[0] for r in rows]

    def expired_prefixes(self, now: float, limit: int) -> list[str]:
        """Kept prefixes past their time to live (their label) at `now`."""
        with self._reading():
            rows = self._db.execute(
                "SELECT checkpoint_id FROM checkpoints WHERE kind = 'prefix' "
                "AND created_at + CAST(label AS REAL) < ? ORDER BY created_at + CAST(label AS REAL) LIMIT ?",
                (now, limit),
            ).fetchall()
        return [r[0] for r in rows]

    def tenant_checkpoints(self, tenant: str) -> list[CheckpointRow]:
        """A tenant's explicit and imported checkpoints, oldest first."""
        with self._reading():
            rows = self._db.execute(
                f"SELECT {COLUMNS} FROM checkpoints WHERE tenant = ? AND kind IN ('explicit', 'imported') "
                "ORDER BY created_at",
                (tenant,),
            ).fetchall()
        return [CheckpointRow(*r) for r in rows]

    def tenant_responses(
        self, tenant: str, after: str, limit: int, descending: bool
    ) -> list[tuple[CheckpointRow, bytes]] | None:
        """A page of the tenant's stored responses, each with its record's first bytes; None
        if `after` is not one of them."""
        columns = ", ".join(f"c.{c.strip()}" for c in COLUMNS.split(","))
        direction, beyond = ("DESC", "<") if descending else ("ASC", ">")
        query = (
            f"SELECT {columns}, substr(r.record, 1, ?) FROM checkpoints c "
            "JOIN responses r USING (checkpoint_id) WHERE c.tenant = ? AND c.kind = 'response'"
        )
        args: list[object] = [RECORD_HEAD, tenant]
        with self._reading():
            if after:
                found = self._db.execute(
                    "SELECT created_at FROM checkpoints WHERE checkpoint_id = ? AND tenant = ? "
                    "AND kind = 'response'",
                    (after, tenant),
                ).fetchone()
                if found is None:
                    return None
                query += f" AND (c.created_at, c.checkpoint_id) {beyond} (?, ?)"
                args += [found[0], after]
            query += f" ORDER BY c.created_at {direction}, c.checkpoint_id {direction} LIMIT ?"
            rows = self._db.execute(query, (*args, limit)).fetchall()
        return [(CheckpointRow(*r[:-1]), bytes(r[-1])) for r in rows]

    def stored_bytes(self, tenant: str) -> int:
        """Bytes a tenant stores: its distinct blocks, manifests and records."""
        with self._reading():
            return int(self._db.execute(_STORED, (tenant,)).fetchone()[0])

    def reserve_stored(
        self, tenant: str, blocks: Sequence[tuple[str, int]], own: int, limit: int
    ) -> Reservation:
        """Room under the tenant's quota for a save, or none (see Catalog.reserve_stored).
        Commits and reservations take the same lock, so each sees the others whole."""
        most = dict(blocks)
        keys = list(most)
        with self._reading():
            held = int(self._db.execute(_STORED, (tenant,)).fetchone()[0])
            held += sum(n for owner, n in self._reserved.values() if owner == tenant)
            known: dict[str, tuple[int, bool]] = {}  # key -> (size, the tenant references it)
            for at in range(0, len(keys), _IDS_PER_QUERY):
                part = keys[at : at + _IDS_PER_QUERY]
                rows = self._db.execute(
                    "SELECT b.block, b.size, EXISTS (SELECT 1 FROM refs JOIN checkpoints c "
                    "USING (checkpoint_id) WHERE refs.block = b.block AND c.tenant = ?) FROM blocks b "
                    f"WHERE b.block IN ({','.join('?' * len(part))})",
                    (tenant, *part),
                ).fetchall()
                known.update((r[0], (int(r[1]), bool(r[2]))) for r in rows)
            needed = own
            for key in keys:
                size, theirs = known.get(key, (most[key], False))
                needed += 0 if theirs else size
            if held + needed > limit:
                return Reservation("", held, needed)
            reservation_id = secrets.token_hex(12)
            self._reserved[reservation_id] = (tenant, needed)
        return Reservation(reservation_id, held, needed)

    def release_stored(self, tenant: str, reservation_id: str) -> None:
        with self._lock:
            self._reserved.pop(reservation_id, None)

    def delete(self, checkpoint_id: str) -> bool:
        with self._transaction():
            found = self._db.execute(
                "SELECT 1 FROM checkpoints WHERE checkpoint_id = ?", (checkpoint_id,)
            ).fetchone()
            self._db.execute("UPDATE sessions SET head = NULL WHERE head = ?", (checkpoint_id,))
            self._delete(checkpoint_id)
            return found is not None

    def delete_session(self, session_id: str, fence: int = 0) -> None:
        """Forget a session, its head (if persistent) and all its checkpoints."""
        with self._transaction():
            for table in ("refs", "responses"):
                self._db.execute(
                    f"DELETE FROM {table} WHERE checkpoint_id IN "
                    "(SELECT checkpoint_id FROM checkpoints WHERE session_id = ?)",
                    (session_id,),
                )
            self._forget_manifests("session_id", session_id)
            self._db.execute("DELETE FROM checkpoints WHERE session_id = ?", (session_id,))
            self._db.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))

    def sessions(self) -> list[tuple[str, float, str | None]]:
        """Persistent sessions: (session_id, created_at, head checkpoint id or None)."""
        with self._reading():
            rows = self._db.execute(
                "SELECT session_id, created_at, head FROM sessions ORDER BY created_at"
            ).fetchall()
        return [(r[0], r[1], r[2]) for r in rows]

    def session(self, session_id: str) -> SessionRow | None:
        with self._reading():
            found = self._db.execute(
                "SELECT created_at, head, tenant FROM sessions WHERE session_id = ?", (session_id,)
            ).fetchone()
        return None if found is None else SessionRow(float(found[0]), found[1], found[2])

    def tenant_sessions(self, tenant: str, limit: int) -> list[ListedSession]:
        with self._reading():
            rows = self._db.execute(
                "SELECT s.session_id, s.created_at, h.created_at, s.head, h.n_tokens, "
                "(SELECT COUNT(*) FROM checkpoints e WHERE e.session_id = s.session_id "
                "AND e.kind = 'explicit') "
                "FROM sessions s JOIN checkpoints h ON h.checkpoint_id = s.head "
                "WHERE s.tenant = ? ORDER BY h.created_at DESC LIMIT ?",
                (tenant, limit),
            ).fetchall()
        return [ListedSession(r[0], float(r[1]), float(r[2]), r[3], int(r[4]), int(r[5])) for r in rows]

    def expire_sessions(self, idle_before: float, limit: int) -> list[str]:
        """Nothing: this catalog is one daemon's, which holds all of its sessions and expires
        them itself."""
        return []

    def counts(self, session_ids: Sequence[str]) -> dict[str, int]:
        """Explicit checkpoints per session, of `session_ids`."""
        query = "SELECT session_id, COUNT(*) FROM checkpoints WHERE kind = 'explicit'"
        # By the session index: a response about one session does not count every
        # checkpoint there is (a GROUP BY over all: 10 ms at 20,000 of them, against 0.02).
        ids = list(dict.fromkeys(session_ids))
        rows = []
        with self._reading():
            for at in range(0, len(ids), _IDS_PER_QUERY):
                chunk = ids[at : at + _IDS_PER_QUERY]
                marks = ",".join("?" * len(chunk))
                sql = f"{query} AND session_id IN ({marks}) GROUP BY session_id"
                rows += self._db.execute(sql, chunk).fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def touch(self, keys: Iterable[str], now: float) -> None:
        """Mark blocks used at `now`. Only the order in which unreferenced blocks are dropped
        reads it, so it is kept in RAM and written with the next write transaction (or before
        that order is read): a restore commits nothing and waits for no fsync (one per block,
        it was). A crash loses only this recency."""
        with self._lock:
            for key in keys:
                self._touched[key] = now

    def _write_touched(self) -> None:
        """Within a write transaction, holding the lock."""
        if self._touched:
            self._db.executemany(
                "UPDATE blocks SET last_used = ? WHERE block = ?", [(t, k) for k, t in self._touched.items()]
            )
            self._touched.clear()

    def present(self, keys: list[str]) -> set[str]:
        """Which of these blocks the catalog knows."""
        found: set[str] = set()
        with self._reading():
            for at in range(0, len(keys), 500):
                part = keys[at : at + 500]
                rows = self._db.execute(
                    f"SELECT block FROM blocks WHERE block IN ({','.join('?' * len(part))})", part
                ).fetchall()
                found.update(r[0] for r in rows)
        return found

    def block_size(self, key: str) -> int | None:
        with self._reading():
            found = self._db.execute("SELECT size FROM blocks WHERE block = ?", (key,)).fetchone()
        return None if found is None else int(found[0])

    def unreferenced(self) -> list[tuple[str, int]]:
        """Blocks no checkpoint references, least recently used first: (key, size)."""
        if self._touched:
            with self._transaction():
                pass  # the recency kept in RAM, written first
        with self._reading():
            rows = self._db.execute(
                "SELECT block, size FROM blocks WHERE block NOT IN (SELECT block FROM refs) "
                "ORDER BY last_used"
            ).fetchall()
        return [(r[0], int(r[1])) for r in rows]

    def forget_blocks(self, keys: Iterable[str]) -> list[str]:
        forgotten = []
        with self._transaction():  # one transaction, not one (and one fsync) per block
            for key in keys:
                gone = self._db.execute(
                    "DELETE FROM blocks WHERE block = ? AND block NOT IN (SELECT block FROM refs)", (key,)
                )
                if gone.rowcount:
                    forgotten.append(key)
        return forgotten

    def claim_blocks(self, keys: Sequence[str]) -> Claim:
        """The sizes of the blocks known; nothing to claim (saves and sweeps of one daemon
        are ordered by its store's lock)."""
        sizes: dict[str, int] = {}
        with self._reading():
            for at in range(0, len(keys), 500):
                part = list(keys[at : at + 500])
                rows = self._db.execute(
                    f"SELECT block, size FROM blocks WHERE block IN ({','.join('?' * len(part))})", part
                ).fetchall()
                sizes.update((r[0], int(r[1])) for r in rows)
        return Claim(sizes, set())

    def doomed_blocks(self, limit: int) -> list[str]:
        """None: this catalog's store is one daemon's, whose start removes what no row knows."""
        return []

    def deleted_blocks(self, keys: Sequence[str]) -> None:
        """Nothing to clear (see claim_blocks)."""

    def block_bytes(self) -> int:
        """Bytes of the blocks the catalog records (what a remote store is counted as)."""
        with self._reading():
            found = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM blocks").fetchone()
        return int(found[0])

    def known_blocks(self) -> set[str]:
        with self._reading():
            return {r[0] for r in self._db.execute("SELECT block FROM blocks").fetchall()}

    def ping(self) -> None:
        return None

    def take_lease(self, session_id: str, holder: str, ttl_ms: int) -> Lease:
        return Lease(1)

    def renew_leases(self, holder: str, leases: dict[str, int], ttl_ms: int) -> tuple[set[str], set[str]]:
        return set(), set()

    def release_lease(self, session_id: str, holder: str, token: int) -> None:
        return None
