"""Crash safety: SIGKILL at random moments during checkpoint, autosave, turns, close, fork and
import.

A daemon (subprocess) holds a persistent session of more than 1,500 tokens (the *main*
session). Each round runs one of six operations on a thread, over and over, until the daemon
is killed with SIGKILL at a random moment:

- ``checkpoint``: explicit checkpoints of the main session, back to back;
- ``autosave``: 4 tokens generated on the main session (its autosave appends a journal record;
  a turn that adds more than ``--head-interval`` tokens writes its blocks and a new head
  instead), then checkpoints; killed anywhere, or most likely inside the autosave;
- ``turns``: one-token turns on the main session, each acknowledged once its journal record is
  durable (its blocks wait for a later head), then checkpoints;
- ``close``: three persistent forks of the main session, each with a checkpoint of its own,
  closed one after the other;
- ``fork``: persistent forks of the main session and of its checkpoints;
- ``import``: a small exported checkpoint imported again and again.

After each restart:

- no unfinished block write is left behind (``blocks/tmp`` and the spill area are empty) and
  no block file is unknown to the catalog;
- the catalog is consistent: the sessions listed are the catalog's sessions, each has one
  head, every checkpoint belongs to a listed session (or is an import), its manifest's pieces
  are its references and every referenced block is present;
- the main session is listed, at the state of its last completed save (after a ``turns``
  round: every acknowledged turn, and perhaps the one in flight), and continues exactly;
- every acknowledged checkpoint, fork and import is listed, and restores (or continues)
  exactly like the tokens generated from the same state before the kill (token ids and
  log-probabilities); an acknowledged close is gone, one that was not is all or nothing.

The expected continuation of each state is recorded before the kill, by forking the main
session (an ephemeral copy; nothing on disk) and generating from the fork. The main session
only ever grows, so its length names its state.

``KVKEEP_CRASH_ROUNDS`` sets the number of kills (default 6: each of the six operations
once; run 240 by hand, 40 per operation).
"""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from checkpoint_helpers import SAMPLED, SPAWN_ARGS, Trace, block_files, gen, long_text, manifest_parts
from daemons import DaemonProcess

import kvkeep

ROUNDS = int(os.environ.get("KVKEEP_CRASH_ROUNDS", "6"))
OPERATIONS = ("checkpoint", "autosave", "turns", "close", "fork", "import")
LOOKAHEAD = 12  # tokens of expected continuation recorded per state
FOLLOW = 8  # tokens compared after a restore
STEP = 4  # tokens the autosave storm generates (the turns storm: turns) before its checkpoints
DOOMED = 3  # persistent forks a close round closes
# What the state directory may hold besides block files; anything else is left-over work.
STATE_FILES = {
    "catalog.db",
    "catalog.db-wal",
    "catalog.db-shm",
    "store.key",
    "fingerprints.json",
    "probes.json",  # unless the tests keep it elsewhere (KVKEEP_PROBE_CACHE)
    "lock",  # held by the running daemon; released by the kernel when it dies
    "kvkeep-state",  # what the directory is
    "blocks",
    "spill",
    "journal",  # persistent turns since their heads
}


@dataclass
class Storm:
    """One operation, repeated until the daemon dies; what it saw acknowledged."""

    address: str
    work: Callable[[kvkeep.Client, Storm], None]
    acked: list[Any] = field(default_factory=list)
    generated: Trace | None = None
    turns: Trace = field(default_factory=list)  # the turns storm's acknowledged tokens
    begun: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self) -> None:
        try:
            with kvkeep.Client(self.address, timeout=30) as client:
                self.work(client, self)
        except kvkeep.UnavailableError:
            pass  # the kill
        except kvkeep.KvkeepError as e:
            # A call cut off by the kill may also end as CANCELLED/UNKNOWN (InternalError).
            if not isinstance(e, kvkeep.InternalError):
                self.error = e
        except BaseException as e:
            self.error = e
        finally:
            self.begun.set()


def _checkpoints(session: kvkeep.Session, storm: Storm, label: str) -> None:
    for i in range(10_000):
        storm.begun.set()
        storm.acked.append(session.checkpoint(f"{label}-{i}"))


def _checkpoints_only(session_id: str, label: str) -> Callable[..., None]:
    def work(client: kvkeep.Client, storm: Storm) -> None:
        _checkpoints(client.session(session_id), storm, label)

    return work


def _generate_then_checkpoint(session_id: str, label: str, *, mark_autosave: bool) -> Callable[..., None]:
    def work(client: kvkeep.Client, storm: Storm) -> None:
        session = client.session(session_id)
        got: Trace = []
        for chunk in session.generate("", max_tokens=STEP, logprobs=1):
            got += [(t.sampled.token_id, t.sampled.logprob) for t in chunk.logprobs]
            if mark_autosave and chunk.finish_reason is None and len(got) == STEP - 1:
                storm.begun.set()  # the last token, then the autosave, then the reply
            if chunk.finish_reason is not None:
                assert chunk.finish_reason == "length"
                storm.generated = got
        _checkpoints(session, storm, label)

    return work


def _turns(session_id: str, label: str) -> Callable[..., None]:
    """STEP one-token turns (empty prompt: each continues the last), then checkpoints. The
    kill's clock starts once the first turn is acknowledged: it lands in a later one."""

    def work(client: kvkeep.Client, storm: Storm) -> None:
        session = client.session(session_id)
        for _ in range(STEP):
            chunks = list(session.generate("", max_tokens=1, logprobs=1))
            storm.turns += [(t.sampled.token_id, t.sampled.logprob) for c in chunks for t in c.logprobs]
            storm.begun.set()
        _checkpoints(session, storm, label)

    return work


def _forks(session_id: str, sources: list[kvkeep.CheckpointInfo]) -> Callable[..., None]:
    """Persistent forks, of the session and of its checkpoints in turn: (fork id, n_tokens)."""

    def work(client: kvkeep.Client, storm: Storm) -> None:
        for i in range(10_000):
            storm.begun.set()
            if i % 2 == 0 or not sources:
                fork = client.fork_session(session_id, persistent=True)
            else:
                fork = client.fork_session(
                    checkpoint_id=sources[i % len(sources)].checkpoint_id, persistent=True
                )
            storm.acked.append(fork.session_id)

    return work


def _closes(session_ids: list[str]) -> Callable[..., None]:
    def work(client: kvkeep.Client, storm: Storm) -> None:
        for sid in session_ids:
            storm.begun.set()
            client.session(sid).close()
            storm.acked.append(sid)

    return work


def _imports(path: Path) -> Callable[..., None]:
    def work(client: kvkeep.Client, storm: Storm) -> None:
        for _ in range(10_000):
            storm.begun.set()
            storm.acked.append(client.import_checkpoint(path))

    return work


def audit_state_dir(state_dir: Path, listed: set[str]) -> None:
    """The state directory of a daemon just started (nothing run since): no left-over work,
    and a catalog that agrees with itself, with the block files and with ``listed``."""
    assert list((state_dir / "blocks" / "tmp").iterdir()) == [], "unfinished block writes left"
    spill = state_dir / "spill"
    assert not [p for p in spill.rglob("*") if p.is_file()], "spilled state left from before the start"
    extra = {p.name for p in state_dir.iterdir()} - STATE_FILES
    assert not extra, f"unexpected files in the state directory: {extra}"
    files = block_files(state_dir)
    uri = f"file:{state_dir / 'catalog.db'}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=30)) as db:
        sessions = dict(db.execute("SELECT session_id, head FROM sessions").fetchall())
        rows = db.execute("SELECT checkpoint_id, session_id, kind, manifest FROM checkpoints").fetchall()
        refs: dict[str, set[str]] = {}
        for ck, block in db.execute("SELECT checkpoint_id, block FROM refs"):
            refs.setdefault(ck, set()).add(block)
        known = {b for (b,) in db.execute("SELECT block FROM blocks")}
    assert set(sessions) == listed, f"listed {sorted(listed)}, catalog {sorted(sessions)}"
    kinds = {ck: (sid, kind) for ck, sid, kind, _ in rows}
    for sid, head in sessions.items():
        assert kinds.get(head) == (sid, "head"), f"session {sid}: its head {head} is {kinds.get(head)}"
    heads = [ck for ck, (_, kind) in kinds.items() if kind == "head"]
    assert sorted(heads) == sorted(sessions.values()), "a head that is no session's"
    for ck, sid, kind, manifest in rows:
        if kind == "imported":
            assert sid == "", ck
        else:
            assert sid in sessions, f"checkpoint {ck} ({kind}) of a session that is gone: {sid}"
        meta = manifest_parts(bytes(manifest))[0]
        pieces = {
            *meta["blocks"],
            *(k for k, _ in meta.get("window", [])),
            *filter(None, [meta.get("recurrent")]),
        }
        assert pieces == refs.get(ck, set()), f"checkpoint {ck}: its references are not its manifest's"
    assert set(refs) <= set(kinds), "references of a checkpoint that is gone"
    referenced = set().union(*refs.values()) if refs else set()
    assert referenced <= known, f"referenced blocks the catalog lacks: {sorted(referenced - known)[:3]}"
    assert referenced <= set(files), (
        f"referenced blocks missing on disk: {sorted(referenced - set(files))[:3]}"
    )
    assert set(files) <= known, f"orphan block files: {sorted(set(files) - known)[:3]}"


@pytest.mark.timeout(max(300, ROUNDS * 20))
def test_sigkill_during_saves_closes_forks_and_imports_loses_nothing(
    spawn_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    started = time.monotonic()
    proc = spawn_daemon(
        *SPAWN_ARGS, "--slots", "2", "--ctx-per-session", "2048", "--disk-budget", str(256 << 20)
    )
    rng = random.Random(20240229)
    export = tmp_path / "donor.kvs"

    with kvkeep.Client(proc.address, timeout=60) as client:
        s = client.create_session(sampling=SAMPLED, persistent=True)
        gen(s, long_text(95, "crash"), 1)
        assert s.info().n_tokens >= 1500
        # The imports' source: a small ephemeral session's checkpoint, exported, then gone.
        donor = client.create_session(sampling=SAMPLED)
        gen(donor, long_text(12, "donor"), 1)
        client.export_checkpoint(donor.checkpoint("donor").checkpoint_id, export)
        donor_follows = gen(donor, "", FOLLOW)
        donor.close()
    session_id = s.session_id

    # n_tokens -> the tokens that follow that state of the main session.
    expected: dict[int, Trace] = {}
    acked: list[kvkeep.CheckpointInfo] = []  # the main session's, all rounds
    kills: Counter[str] = Counter()
    acks: Counter[str] = Counter()
    checked: Counter[str] = Counter()

    def continues(session: kvkeep.Session, follow: Trace, what: str) -> None:
        assert gen(session, "", len(follow)) == follow, f"{what} does not continue exactly"
        checked["continuations"] += 1

    for round_ in range(ROUNDS):
        op = OPERATIONS[round_ % len(OPERATIONS)]
        where = f"round {round_} ({op})"
        doomed: dict[str, str] = {}  # close rounds: fork id -> its checkpoint id
        with kvkeep.Client(proc.address, timeout=60) as client:
            n = client.session(session_id).info().n_tokens
            fork = client.fork_session(session_id)
            ahead = gen(fork, "", LOOKAHEAD)
            fork.close()
            if n in expected:  # the state the session came back in continues as recorded
                known = expected[n]
                assert ahead[: len(known)] == known, f"{where}: the head does not continue exactly"
            expected[n] = ahead
            for k in range(1, STEP + 1):  # after k tokens, generated or one-token turns
                expected[n + k] = ahead[k:]
            if op == "close":
                for _ in range(DOOMED):
                    f = client.fork_session(session_id, persistent=True)
                    doomed[f.session_id] = f.checkpoint("doomed").checkpoint_id

        if op == "checkpoint":
            work = _checkpoints_only(session_id, f"r{round_}")
        elif op == "autosave":
            work = _generate_then_checkpoint(session_id, f"r{round_}", mark_autosave=round_ % 2 == 1)
        elif op == "turns":
            work = _turns(session_id, f"r{round_}")
        elif op == "close":
            work = _closes(list(doomed))
        elif op == "fork":
            work = _forks(session_id, [c for c in acked if c.n_tokens in expected][-4:])
        else:
            work = _imports(export)
        storm = Storm(proc.address, work)
        thread = threading.Thread(target=storm.run, name="storm", daemon=True)
        thread.start()
        if op == "autosave" and round_ % 2 == 0:  # anywhere: loading, generating, saving, checkpointing
            time.sleep(rng.uniform(0, 0.400))
        else:
            storm.begun.wait(30)
            pause = {"autosave": 0.060, "turns": 0.600, "close": 0.040, "import": 0.300}.get(op, 0.150)
            time.sleep(rng.uniform(0, pause))
        proc.kill()
        kills[op] += 1
        thread.join(30)
        assert not thread.is_alive()
        assert storm.error is None, f"{where}: {storm.error!r}"
        if storm.generated is not None:
            assert storm.generated == ahead[:STEP], where
            checked["generations acknowledged"] += 1
        assert storm.turns == ahead[: len(storm.turns)], where
        checked["turns acknowledged"] += len(storm.turns)
        acks[op] += len(storm.acked)

        proc.start()
        with kvkeep.Client(proc.address, timeout=60) as client:
            listed = {i.session_id for i in client.list_sessions()}
            audit_state_dir(proc.state_dir, listed)
            assert session_id in listed
            session = client.session(session_id)
            n_after = session.info().n_tokens
            # The last completed save: after the storm's generation if it was acknowledged,
            # else before or after it (the kill may land between the save and the reply).
            if op == "turns":  # every acknowledged turn; the one in flight, or not
                acked_turns = len(storm.turns)
                assert n + acked_turns <= n_after <= min(n + acked_turns + 1, n + STEP), where
                checked["turns in flight, kept"] += n_after - n - acked_turns
            else:
                assert n_after == n + STEP if storm.generated is not None else n_after in (n, n + STEP), where
            everything = client.list_checkpoints()
            listed_checkpoints = {c.checkpoint_id for c in everything}
            if op in ("checkpoint", "autosave", "turns"):
                acked += storm.acked
            missing = [c.checkpoint_id for c in acked if c.checkpoint_id not in listed_checkpoints]
            assert not missing, f"{where}: acknowledged checkpoints lost: {missing}"
            scratch = client.create_session()
            if acked:  # the newest checkpoint, and one older one at random
                for ck in {
                    acked[-1].checkpoint_id: acked[-1],
                    **{(c := rng.choice(acked)).checkpoint_id: c},
                }.values():
                    assert scratch.restore(ck.checkpoint_id).n_tokens == ck.n_tokens
                    continues(
                        scratch, expected[ck.n_tokens][:FOLLOW], f"{where}: checkpoint {ck.checkpoint_id}"
                    )

            others = listed - {session_id}
            if op == "fork":  # acknowledged forks are there; one cut short is there or not
                assert set(storm.acked) <= others, f"{where}: acknowledged forks lost"
                for sid in others:
                    fork_session = client.session(sid)
                    if sid == (storm.acked or [None])[-1] or sid not in storm.acked:
                        follow = expected[fork_session.info().n_tokens][:FOLLOW]
                        continues(fork_session, follow, f"{where}: fork {sid}")
            elif op == "close":
                assert others <= set(doomed), f"{where}: sessions nobody made: {others - set(doomed)}"
                for sid in storm.acked:
                    assert sid not in others and doomed[sid] not in listed_checkpoints, (
                        f"{where}: the acknowledged close of {sid} is undone"
                    )
                    with pytest.raises(kvkeep.NotFoundError):
                        client.session(sid).info()
                order = list(doomed)  # closed in this order: acknowledged, in flight, untouched
                in_flight = order[len(storm.acked)] if len(storm.acked) < DOOMED else None
                assert set(order[len(storm.acked) + 1 :]) <= others, f"{where}: a session closed unasked"
                for sid in others:  # not closed, or a close cut short: all of it is there
                    assert doomed[sid] in listed_checkpoints, f"{where}: {sid} is back without its checkpoint"
                    continues(client.session(sid), expected[n][:FOLLOW], f"{where}: unclosed {sid}")
                if in_flight is not None and in_flight not in others:  # cut short, all gone
                    assert doomed[in_flight] not in listed_checkpoints, (
                        f"{where}: a checkpoint outlived {in_flight}"
                    )
                if in_flight is not None:
                    checked["closes cut short: " + ("all there" if in_flight in others else "all gone")] += 1
            elif op == "import":
                imports = [c for c in everything if c.session_id == ""]
                ids = {c.checkpoint_id for c in imports}
                assert {c.checkpoint_id for c in storm.acked} <= ids, f"{where}: acknowledged imports lost"
                checked["imports cut short, committed"] += len(ids) - len(storm.acked)
                for c in imports:
                    scratch.restore(c.checkpoint_id)
                    continues(scratch, donor_follows, f"{where}: import {c.checkpoint_id}")
            with contextlib.suppress(kvkeep.KvkeepError):
                scratch.close()
            # Back to the main session alone: whatever this round left is closed or deleted.
            for sid in others:
                client.session(sid).close()
            for c in client.list_checkpoints():
                if c.session_id == "":
                    client.delete_checkpoint(c.checkpoint_id)
            checked["audits"] += 1

    assert proc.starts == ROUNDS + 1
    assert acked, "no checkpoint was ever acknowledged before a kill"
    elapsed = time.monotonic() - started
    log = proc.log()
    swept = log.count("unfinished block writes")
    orphaned = log.count("blocks that no checkpoint was committed for")
    print(
        f"{ROUNDS} kills in {elapsed:.0f} s: kills {dict(kills)}; acknowledged {dict(acks)}; "
        f"checked {dict(checked)}; {swept} starts swept unfinished block writes, "
        f"{orphaned} removed orphan blocks"
    )
