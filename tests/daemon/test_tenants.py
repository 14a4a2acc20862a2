"""Tenants: bearer tokens, ownership, TLS, the unix socket, quotas, and untrusted imports.

- Without a valid token every call gets UNAUTHENTICATED (health checks do not need one);
  the auth file is read again on SIGHUP.
- Another tenant's session or checkpoint id gets NOT_FOUND with the message an unknown id
  gets; listings and GetInfo show a tenant only its own.
- Without an auth file the daemon listens on loopback or a unix socket only; the socket is
  created owner-only. TLS and mutual TLS work with the SDK's Tls options.
- Quotas: sessions, parked bytes and stored bytes per tenant; beyond them BusyError for that
  tenant alone.
- An imported checkpoint belongs to the importer, is listed, forked, deleted; its manifest is
  held to the RPC limits; its blocks never stand for blocks computed here.
"""

from __future__ import annotations

import io
import os
import signal
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tlscerts
from auth import TOKENS, write_auth
from checkpoint_helpers import (
    GREEDY,
    PROMPT,
    SAMPLED,
    edit_export,
    export_bytes,
    gen,
    long_text,
    parse_export,
)
from daemons import SERVING, DaemonProcess, InProcessDaemon, health_status, model_path

import kvkeep
from kvkeepd.config.settings import ConfigError, Settings


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    """A daemon with two tenants, alice and bob."""
    root = tmp_path_factory.mktemp("tenants")
    d = InProcessDaemon.with_settings(
        root / "state", auth_file=write_auth(root / "auth.toml", TOKENS), slots=2
    )
    yield d
    d.stop()


@pytest.fixture
def alice(multi: InProcessDaemon) -> Iterator[kvkeep.Client]:
    with kvkeep.Client(multi.address, timeout=60, token=TOKENS["alice"]) as c:
        yield c


@pytest.fixture
def bob(multi: InProcessDaemon) -> Iterator[kvkeep.Client]:
    with kvkeep.Client(multi.address, timeout=60, token=TOKENS["bob"]) as c:
        yield c


def test_calls_need_a_valid_token(multi: InProcessDaemon, alice: kvkeep.Client) -> None:
    for token in (None, "wrong-token-0123456789", TOKENS["alice"] + "x"):
        with kvkeep.Client(multi.address, timeout=10, token=token) as c, pytest.raises(kvkeep.AuthError):
            c.info()
    assert alice.info().model_path == ""  # a multi-tenant daemon shows no paths
    assert health_status(multi.address) == SERVING  # health checks need no token


def test_the_token_comes_from_the_environment(
    multi: InProcessDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVKEEP_TOKEN", TOKENS["bob"])
    with kvkeep.Client(multi.address, timeout=10) as c:
        assert c.info().slots == 2


def test_the_cli_takes_a_token(multi: InProcessDaemon) -> None:
    from click.testing import CliRunner

    from kvkeep.cli import main as cli_main

    ok = CliRunner().invoke(cli_main, ["--address", multi.address, "--token", TOKENS["alice"], "info"])
    assert ok.exit_code == 0, ok.output
    refused = CliRunner().invoke(cli_main, ["--address", multi.address, "info"], env={"KVKEEP_TOKEN": ""})
    assert refused.exit_code != 0 and "token" in refused.output.lower()


def test_another_tenants_ids_are_not_found_like_unknown_ones(
    alice: kvkeep.Client, bob: kvkeep.Client, tmp_path: Path
) -> None:
    mine = alice.create_session(sampling=SAMPLED)
    gen(mine, PROMPT, 4)
    ck = mine.checkpoint("alice's")
    unknown_session, unknown_checkpoint = "s_" + "0" * 24, "c_" + "0" * 24

    def message(call: Callable[[], object]) -> str:
        with pytest.raises(kvkeep.NotFoundError) as e:
            call()
        return e.value.message

    def same(theirs: Callable[[str], object], unknown_id: str, real_id: str) -> None:
        assert message(lambda: theirs(real_id)) == message(lambda: theirs(unknown_id)).replace(
            unknown_id, real_id
        )

    same(lambda i: bob.session(i), unknown_session, mine.session_id)
    same(lambda i: bob.session(i).complete("Hi", max_tokens=1), unknown_session, mine.session_id)
    same(lambda i: bob.session(i).close(), unknown_session, mine.session_id)
    same(lambda i: bob.list_checkpoints(i), unknown_session, mine.session_id)
    same(lambda i: bob.fork_session(checkpoint_id=i), unknown_checkpoint, ck.checkpoint_id)
    same(lambda i: bob.delete_checkpoint(i), unknown_checkpoint, ck.checkpoint_id)
    same(lambda i: bob.export_checkpoint(i, tmp_path / "x.kvst"), unknown_checkpoint, ck.checkpoint_id)
    theirs = bob.create_session()
    same(lambda i: theirs.restore(i), unknown_checkpoint, ck.checkpoint_id)

    assert mine.session_id in {s.session_id for s in alice.list_sessions()}
    assert mine.session_id not in {s.session_id for s in bob.list_sessions()}
    assert ck.checkpoint_id in {c.checkpoint_id for c in alice.list_checkpoints()}
    assert ck.checkpoint_id not in {c.checkpoint_id for c in bob.list_checkpoints()}
    assert bob.info().sessions == len(bob.list_sessions())
    mine.close()
    theirs.close()


def test_without_an_auth_file_the_daemon_stays_local(tmp_path: Path) -> None:
    def settings(**kw: object) -> Settings:
        return Settings(model_path=model_path(), state_dir=tmp_path, **kw)  # type: ignore[arg-type]

    with pytest.raises(ConfigError, match="loopback"):
        settings(address="0.0.0.0:50051").validate()
    for local in ("127.0.0.1:0", "localhost:50051", "[::1]:0", f"unix:{tmp_path}/k.sock"):
        settings(address=local).validate()
    auth = write_auth(tmp_path / "auth.toml", TOKENS)
    settings(address="0.0.0.0:50051", auth_file=auth).validate()


def test_the_unix_socket_is_owner_only(start_daemon: Callable[..., InProcessDaemon], tmp_path: Path) -> None:
    sock = tmp_path / "kvkeep.sock"
    start_daemon(address=f"unix:{sock}")
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    with kvkeep.Client(f"unix:{sock}", timeout=10) as c:
        assert c.info().slots >= 1


def test_tls_and_mutual_tls(start_daemon: Callable[..., InProcessDaemon], tmp_path: Path) -> None:
    certs = tlscerts.make(tmp_path)
    d = start_daemon(tls_cert=certs.server.cert, tls_key=certs.server.key)
    with kvkeep.Client(d.address, timeout=10, tls=kvkeep.Tls(ca_file=certs.ca)) as c:
        assert c.info().slots >= 1
    with kvkeep.Client(d.address, timeout=5) as plain, pytest.raises(kvkeep.UnavailableError):
        plain.info()

    m = start_daemon(tls_cert=certs.server.cert, tls_key=certs.server.key, tls_client_ca=certs.ca)
    with (
        kvkeep.Client(m.address, timeout=5, tls=kvkeep.Tls(ca_file=certs.ca)) as anonymous,
        pytest.raises(kvkeep.UnavailableError),
    ):
        anonymous.info()
    client_tls = kvkeep.Tls(ca_file=certs.ca, cert_file=certs.client.cert, key_file=certs.client.key)
    with kvkeep.Client(m.address, timeout=10, tls=client_tls) as c:
        assert c.info().slots >= 1


def test_sighup_reads_the_auth_file_again(spawn_daemon: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    auth = write_auth(tmp_path / "auth.toml", TOKENS)
    d = spawn_daemon("--auth-file", str(auth))
    with kvkeep.Client(d.address, timeout=10, token=TOKENS["alice"]) as c:
        c.info()
    carol = "carol-token-0123456789"
    write_auth(auth, {"bob": TOKENS["bob"], "carol": carol})
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)

    def reloaded() -> bool:
        try:
            with kvkeep.Client(d.address, timeout=5, token=carol) as c:
                c.info()
            return True
        except kvkeep.AuthError:
            return False

    from daemons import wait_until

    wait_until(reloaded, 20, "the auth file to be read again")
    with kvkeep.Client(d.address, timeout=5, token=TOKENS["alice"]) as c, pytest.raises(kvkeep.AuthError):
        c.info()
    auth.write_text("this is not toml [")
    d.proc.send_signal(signal.SIGHUP)  # a broken file keeps the last good one
    wait_until(lambda: "was not reloaded" in d.log(), 20, "the reload to fail")
    with kvkeep.Client(d.address, timeout=5, token=carol) as c:
        c.info()
    assert carol not in d.log() and TOKENS["bob"] not in d.log()  # tokens are never logged


# ---- cache salts -----------------------------------------------------------------------------


def _turn(client: kvkeep.Client, system: str, **kw: object) -> kvkeep.Completion:
    """One chat turn in a new session (left open: an open session's state is a prefix
    source; a closed ephemeral one leaves nothing behind)."""
    s = client.create_session(system, sampling=GREEDY, **kw)  # type: ignore[arg-type]
    return s.chat("Which note mentions pier 7?", max_tokens=4, logprobs=1)


def test_prefixes_are_shared_within_a_tenant_or_a_salt_only(alice: kvkeep.Client, bob: kvkeep.Client) -> None:
    system = long_text(12, "salted archive")
    first = _turn(alice, system)
    assert first.usage.reused_tokens == 0
    again = _turn(alice, system)
    assert again.usage.reused_tokens >= 128  # alice's own cache
    assert [t.sampled for t in again.logprobs] == [t.sampled for t in first.logprobs]
    assert _turn(bob, system).usage.reused_tokens == 0  # never alice's

    salt = "a shared salt of 32 bytes, pre-shared"
    assert _turn(alice, system, cache_salt=salt).usage.reused_tokens == 0  # a new namespace
    shared = _turn(bob, system, cache_salt=salt)
    assert shared.usage.reused_tokens >= 128  # whoever presents the salt shares
    assert [t.sampled for t in shared.logprobs] == [t.sampled for t in first.logprobs]
    with pytest.raises(kvkeep.InvalidRequestError, match="cache_salt"):
        alice.create_session(cache_salt="too short")


def test_checkpoint_sizes_do_not_reveal_another_tenants_blocks(
    alice: kvkeep.Client, bob: kvkeep.Client
) -> None:
    """A checkpoint writes only the blocks its store lacks, so its size could tell whether
    somebody else holds the same tokens: only a tenant's own blocks are ever shared."""
    text = long_text(10, "sealed ledger")

    def written(client: kvkeep.Client) -> tuple[int, int]:
        s = client.create_session(sampling=GREEDY)
        s.complete(text, max_tokens=1)
        ck = s.checkpoint()
        return ck.bytes_written, ck.bytes_referenced

    first, bobs, again = written(alice), written(bob), written(alice)
    assert first[0] == first[1] and bobs[0] == bobs[1]  # every block written: nothing shared
    assert again[0] < again[1] / 10  # alice's second: her blocks were there (the test can see it)


# ---- quotas ----------------------------------------------------------------------------------


def test_quotas_hold_per_tenant(start_daemon: Callable[..., InProcessDaemon], tmp_path: Path) -> None:
    quotas = {"alice": {"max_sessions": 2, "max_stored_bytes": 1, "max_parked_bytes": 1}}
    # Every persistent turn saves its head (its blocks), not only a journal record.
    d = start_daemon(auth_file=write_auth(tmp_path / "auth.toml", TOKENS, quotas), slots=1, head_interval=1)
    assert d.daemon is not None and d.daemon.manager is not None
    manager = d.daemon.manager
    with (
        kvkeep.Client(d.address, timeout=60, token=TOKENS["alice"]) as a,
        kvkeep.Client(d.address, timeout=60, token=TOKENS["bob"]) as b,
    ):
        first, second = a.create_session(sampling=GREEDY), a.create_session(sampling=GREEDY)
        with pytest.raises(kvkeep.BusyError, match="quota"):
            a.create_session()
        with pytest.raises(kvkeep.BusyError, match="quota"):
            first.fork()
        bobs = [b.create_session(sampling=GREEDY) for _ in range(3)]  # bob has no quota
        # One slot: every turn parks the last session; alice's parked state goes to disk at
        # once (a 1-byte quota), bob's stays in RAM.
        for s in [first, second, *bobs]:
            s.complete(PROMPT, max_tokens=2)
        assert manager.residency.parked_bytes("alice") == 0
        assert manager.residency.parked_bytes("bob") > 0
        second.close()
        # A persistent session's first head is a manifest (no blocks yet): over 1 byte.
        with pytest.raises(kvkeep.BusyError, match="quota"):
            a.create_session(sampling=GREEDY, persistent=True)
        bobs[0].fork(persistent=True).checkpoint()  # bob's quota is his own


# ---- imports ---------------------------------------------------------------------------------


def test_an_import_belongs_to_the_importer(alice: kvkeep.Client, bob: kvkeep.Client, tmp_path: Path) -> None:
    s = alice.create_session(sampling=SAMPLED)
    gen(s, PROMPT, 8)
    ck = s.checkpoint("to share")
    after = gen(s, "", 8)
    data = export_bytes(alice, ck.checkpoint_id, tmp_path / "share.kvst")
    imported = bob.import_checkpoint(io.BytesIO(data))
    assert imported.checkpoint_id in {c.checkpoint_id for c in bob.list_checkpoints()}
    assert imported.checkpoint_id not in {c.checkpoint_id for c in alice.list_checkpoints()}
    fork = bob.fork_session(checkpoint_id=imported.checkpoint_id)
    assert gen(fork, "", 8) == after
    fork.close()
    bob.delete_checkpoint(imported.checkpoint_id)
    assert imported.checkpoint_id not in {c.checkpoint_id for c in bob.list_checkpoints()}
    s.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("draws", -1),
        ("label", "x" * 300),
        ("stop", [f"s{i}" for i in range(17)]),
        ("block_tokens", 4096),
    ],
)
def test_an_import_beyond_the_rpc_limits_is_refused(
    alice: kvkeep.Client, tmp_path: Path, field: str, value: object
) -> None:
    s = alice.create_session(sampling=SAMPLED)
    gen(s, PROMPT, 4)
    data = export_bytes(alice, s.checkpoint().checkpoint_id, tmp_path / "x.kvst")
    s.close()

    def edit(meta: dict[str, object]) -> None:
        meta[field] = value

    with pytest.raises(kvkeep.CorruptCheckpointError):
        alice.import_checkpoint(io.BytesIO(edit_export(data, edit)))


def test_imported_blocks_never_stand_for_blocks_computed_here(
    multi: InProcessDaemon, alice: kvkeep.Client, tmp_path: Path
) -> None:
    """An import whose KV was tampered with (structurally valid: CRCs and digest made anew)
    is accepted, but a local session with the same tokens never attaches its blocks."""
    import struct
    import zlib

    from checkpoint_helpers import build_export

    text = long_text(8, "forged harbour")
    s = alice.create_session(sampling=GREEDY)
    s.complete(text, max_tokens=1)
    data = export_bytes(alice, s.checkpoint().checkpoint_id, tmp_path / "forged.kvst")
    s.close()
    manifest, blocks = parse_export(data)
    forged = []
    for key, frame in blocks:
        magic, code, length, _crc = struct.unpack_from("<4sBII", frame)
        payload = bytes(b ^ 0x55 for b in frame[13:]) if code == 0 else frame[13:]
        forged.append((key, struct.pack("<4sBII", magic, code, length, zlib.crc32(payload)) + payload))
    alice.import_checkpoint(io.BytesIO(build_export(manifest, forged)))
    # A fresh daemon-wide view: nothing of the text is cached but the forged import.
    fresh = alice.create_session(sampling=GREEDY)
    c = fresh.complete(text, max_tokens=1)
    assert c.usage.reused_tokens == 0
    fresh.close()
