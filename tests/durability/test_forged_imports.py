"""A forged import changes nothing but the importer's own sessions.

An export's digest is unkeyed and each block frame carries its own CRC, so a client can pair
one export's manifest and block keys with another export's frames: the import is accepted (its
structure is valid), and the state it restores is whatever the frames hold. Such a state must
never serve anyone else. Here a forgery pairs history T1 with the KV of another history T2 of
the same length; another session whose prompt begins with T1 must attach nothing of it and
continue exactly as T1 itself gives, through every path a state travels:

- restored into a session whose `cache_salt` another tenant also presents (the live slot);
- the same session's head on disk, after it is closed, and after a restart;
- inside one tenant, restored into a session with the tenant's own salt;
- a fork of the restored session, and a fork of the imported checkpoint;
- an ephemeral session holding it, spilled out of its slot and RAM.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from auth import TOKENS, write_auth
from checkpoint_helpers import (
    SPAWN_ARGS,
    Trace,
    build_export,
    export_bytes,
    long_text,
    manifest_parts,
    parse_export,
)
from daemons import DaemonProcess, InProcessDaemon

import kvkeep

SALT = "a pre-shared salt of at least 16 bytes"
N = 200  # three full blocks and a partial one
ATTACHED = 192  # what the prefix cache would attach of T1 + ten tokens: its whole blocks
GREEDY = kvkeep.SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class Forgery:
    """An export claiming history `t1` that holds the KV of `t2`, and what each continues as."""

    data: bytes
    t1: list[int]
    t2: list[int]
    honest: Trace  # T1 + ten tokens, evaluated
    forged: Trace  # what T1 + ten tokens gives if the forgery is attached


def history_of(client: kvkeep.Client, text: str, tmp: Path) -> list[int]:
    """The token ids a new session's history begins with, given `text`."""
    s = client.create_session(sampling=GREEDY, persistent=True)
    s.complete(text, max_tokens=1)
    ck = s.checkpoint()
    manifest, _ = parse_export(export_bytes(client, ck.checkpoint_id, tmp / f"{ck.checkpoint_id}.kvst"))
    s.close()  # its checkpoints go with it
    return manifest_parts(manifest)[1]


def trace_of(session: kvkeep.Session, prompt: list[int]) -> tuple[Trace, int]:
    c = session.complete(prompt, max_tokens=6, logprobs=1, sampling=GREEDY)
    return [(t.sampled.token_id, t.sampled.logprob) for t in c.logprobs], c.usage.reused_tokens


def forge(client: kvkeep.Client, tmp: Path) -> Forgery:
    """Two honest checkpoints of equally long histories, and an export pairing the first's
    manifest and keys with the second's frames (CRCs intact, digest recomputed)."""
    t1 = history_of(client, long_text(20, "forged lighthouse"), tmp)[: N + 10]
    t2 = history_of(client, long_text(20, "honest granary"), tmp)[: N + 10]
    assert len(t1) == len(t2) == N + 10 and t1[:64] != t2[:64]
    exports = []
    for t in (t1, t2):
        s = client.create_session(sampling=GREEDY, persistent=True)
        s.complete(t[:N], max_tokens=1)
        ck = s.checkpoint()
        exports.append(parse_export(export_bytes(client, ck.checkpoint_id, tmp / f"{ck.checkpoint_id}.kvst")))
        s.close()
    (manifest, blocks1), (_, blocks2) = exports
    assert len(blocks1) == len(blocks2)
    frames = [(key, frame) for (key, _), (_, frame) in zip(blocks1, blocks2, strict=True)]
    data = build_export(manifest, frames)
    control = client.create_session(sampling=GREEDY, cache_salt="a salt nobody else presents")
    honest, reused = trace_of(control, t1)
    assert reused == 0
    control.close()
    control = client.create_session(sampling=GREEDY, cache_salt="another salt nobody presents")
    # What a session given T1 + ten tokens would continue as with the forgery attached (the
    # 192 tokens of its whole blocks).
    forged, _ = trace_of(control, [*t2[:ATTACHED], *t1[ATTACHED:]])
    control.close()
    assert forged != honest  # the forgery would show
    return Forgery(data, t1, t2, honest, forged)


def assert_unaffected(client: kvkeep.Client, f: Forgery, **kw: object) -> None:
    """A new session given T1 + ten tokens attaches nothing forged and continues as T1 does."""
    s = client.create_session(sampling=GREEDY, **kw)  # type: ignore[arg-type]
    got, _ = trace_of(s, f.t1)
    s.close()
    assert got == f.honest


@pytest.fixture
def tenants(tmp_path: Path) -> Path:
    return write_auth(tmp_path / "auth.toml", TOKENS)


def test_a_forged_import_never_serves_another_tenant(
    start_daemon: Callable[..., InProcessDaemon], tenants: Path, tmp_path: Path
) -> None:
    d = start_daemon(slots=4, auth_file=tenants)
    with (
        kvkeep.Client(d.address, timeout=120, token=TOKENS["alice"]) as alice,
        kvkeep.Client(d.address, timeout=120, token=TOKENS["bob"]) as bob,
    ):
        f = forge(alice, tmp_path)
        imported = alice.import_checkpoint(io.BytesIO(f.data))
        holder = alice.create_session(sampling=GREEDY, cache_salt=SALT, persistent=True)
        holder.complete("Hello", max_tokens=1)
        holder.restore(imported.checkpoint_id)
        # The live slot, and the head written after the restore.
        assert_unaffected(bob, f, cache_salt=SALT)
        # Forks inherit the import's salt: neither is a source either.
        twin = holder.fork(persistent=True)
        other = alice.fork_session(checkpoint_id=imported.checkpoint_id, persistent=True)
        assert_unaffected(bob, f, cache_salt=SALT)
        for s in (holder, twin, other):
            s.close()
        # Closed: their blocks stay as a cache on disk, under the import's salt.
        assert_unaffected(bob, f, cache_salt=SALT)
        assert_unaffected(alice, f, cache_salt=SALT)


def test_a_forged_import_never_serves_the_importers_other_sessions(
    start_daemon: Callable[..., InProcessDaemon], tmp_path: Path
) -> None:
    d = start_daemon(slots=4)
    with kvkeep.Client(d.address, timeout=120) as client:
        f = forge(client, tmp_path)
        imported = client.import_checkpoint(io.BytesIO(f.data))
        holder = client.create_session(sampling=GREEDY, persistent=True)
        holder.restore(imported.checkpoint_id)
        assert_unaffected(client, f)
        holder.close()
        assert_unaffected(client, f)


def test_a_forged_import_spilled_to_disk_serves_nobody(
    start_daemon: Callable[..., InProcessDaemon], tmp_path: Path
) -> None:
    d = start_daemon(slots=2, ram_cache=1)
    with kvkeep.Client(d.address, timeout=120) as client:
        f = forge(client, tmp_path)
        imported = client.import_checkpoint(io.BytesIO(f.data))
        holder = client.create_session(sampling=GREEDY)
        holder.complete("Hello", max_tokens=1)
        holder.restore(imported.checkpoint_id)
        bumps = [client.create_session(sampling=GREEDY) for _ in range(2)]
        for bump in bumps:  # they take both slots: the holder spills (no RAM to park in)
            bump.complete("Something else", max_tokens=1)
        assert holder.info().residency == "cold"
        for bump in bumps:
            bump.close()
        assert_unaffected(client, f)
        holder.complete(" More", max_tokens=1)  # back from the spill area into a slot
        assert holder.info().residency == "hot"
        assert_unaffected(client, f)
        holder.close()


def test_a_forged_import_serves_nobody_after_a_restart(
    spawn_daemon: Callable[..., DaemonProcess], tenants: Path, tmp_path: Path
) -> None:
    d = spawn_daemon(*SPAWN_ARGS, "--auth-file", str(tenants))
    with kvkeep.Client(d.address, timeout=120, token=TOKENS["alice"]) as alice:
        f = forge(alice, tmp_path)
        imported = alice.import_checkpoint(io.BytesIO(f.data))
        holder = alice.create_session(sampling=GREEDY, cache_salt=SALT, persistent=True)
        holder.restore(imported.checkpoint_id)
        holder_id = holder.session_id
    d.restart(kill=True)
    with (
        kvkeep.Client(d.address, timeout=120, token=TOKENS["alice"]) as alice,
        kvkeep.Client(d.address, timeout=120, token=TOKENS["bob"]) as bob,
    ):
        assert_unaffected(bob, f, cache_salt=SALT)
        alice.session(holder_id).complete("More", max_tokens=1)  # in a slot again
        assert_unaffected(bob, f, cache_salt=SALT)
