"""Several daemons, one population of sessions: two daemons (subprocesses, separate state
directories, the store key given as a file to one and in the environment to the other)
share a Redis catalog and a Redis block store on loopback. Any daemon continues any
persistent session exactly, from its head and the turn records on the catalog's server
after a kill; every daemon lists the tenant's sessions and which daemon holds each; one
daemon at a time expires the sessions no daemon holds; a session swapped out to storage
lets its lease go; a session has one writer at a time (a lease with a fencing token); a
daemon paused or killed mid-generation loses the session to the other, which goes on from
the last acknowledged turn; a catalog server that stops makes requests UNAVAILABLE until
it is back, and nothing acknowledged is lost.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemons import DaemonProcess, wait_until
from servers import RedisServer, free_port

import kvkeep
from kvkeep.cli import main as cli_main

LEASE_SECONDS = 1.5
# Room to spare for a loaded 2-core machine: the lease lapses, then one renewal period.
LAPSE = LEASE_SECONDS + 1.0
SAMPLING = kvkeep.SamplingParams(seed=1234)  # sampled, not greedy: the RNG position must move too
SYSTEM = (
    "You are a helpful assistant for a small bakery. You answer questions about bread, cakes, "
    "opening hours and orders. Keep every answer short and friendly, and never invent prices. "
    "When you do not know something, say so and suggest calling the shop. The shop opens at "
    "seven in the morning and closes at six in the evening, every day except Monday. Orders "
    "for cakes need two days of notice. The bakery sells sourdough, rye, baguettes, croissants "
    "and seasonal fruit tarts."
)
SALT = b"shared-test-salt-0001"
OTHER_SALT = b"shared-test-salt-0002"


def shared_pair(
    spawn_daemon: Callable[..., DaemonProcess],
    tmp_path: Path,
    redis_url: str,
    *b_args: str,
    both: Sequence[str] = (),
) -> tuple[DaemonProcess, DaemonProcess]:
    """Two daemons on one Redis catalog (a prefix of their own) and store, with the same store
    key (A's from a file, B's from the environment, as a deployment hands a secret over; B
    also given `b_args`), both given `both`."""
    catalog = f"{redis_url}?prefix=shared-{secrets.token_hex(6)}"
    args = (
        "--catalog",
        catalog,
        "--store",
        redis_url,
        "--lease-seconds",
        str(LEASE_SECONDS),
        "--lease-wait",
        "4",
        *both,
    )
    key = secrets.token_hex(32)
    key_file = tmp_path / "deployment.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    a = spawn_daemon(*args, "--daemon-name", "daemon-a", "--store-key-file", str(key_file))
    b = spawn_daemon(*args, "--daemon-name", "daemon-b", *b_args, env={"KVKEEP_STORE_KEY": key})
    return a, b


def test_a_session_continues_exactly_on_another_daemon(
    spawn_daemon: Callable[..., DaemonProcess], tmp_path: Path, redis_server: str
) -> None:
    a, b = shared_pair(spawn_daemon, tmp_path, redis_server)
    # One key, given as a secret is: neither start writes it or logs it, both name it alike.
    key = (tmp_path / "deployment.key").read_text().strip()
    fingerprints = {re.search(r"store key ([0-9a-f]{16}) \(from ", d.log())[1] for d in (a, b)}  # type: ignore[index]
    assert len(fingerprints) == 1 and all(key not in d.log() for d in (a, b))
    assert not (a.state_dir / "store.key").exists() and not (b.state_dir / "store.key").exists()
    with kvkeep.Client(a.address, timeout=60) as ca, kvkeep.Client(b.address, timeout=60) as cb:
        s = ca.create_session(SYSTEM, persistent=True, sampling=SAMPLING, cache_salt=SALT)
        s.chat("When do you open?", max_tokens=12)
        checkpoint = s.checkpoint("after the first turn")
        twin = s.fork(persistent=True)  # the same state, on A: what A would have said next
        expected = twin.chat("And on Mondays?", max_tokens=16)
        before = s.info().n_tokens

        moved = cb.session(s.session_id)  # B finds it in the catalog; A hands it over
        assert moved.info().n_tokens == before
        got = moved.chat("And on Mondays?", max_tokens=16)
        assert got.token_ids == expected.token_ids
        assert got.usage is not None and expected.usage is not None
        # Restored from the shared store, not evaluated again.
        assert got.usage.evaluated_tokens == expected.usage.evaluated_tokens < before

        forked = cb.fork_session(checkpoint_id=checkpoint.checkpoint_id)  # A's checkpoint
        assert forked.chat("And on Mondays?", max_tokens=16).token_ids == expected.token_ids

        # A's cached system prompt is attached on B for the same salt, and never for another.
        same = cb.create_session(SYSTEM, sampling=SAMPLING, cache_salt=SALT).chat("Hi", max_tokens=1)
        other = cb.create_session(SYSTEM, sampling=SAMPLING, cache_salt=OTHER_SALT).chat("Hi", max_tokens=1)
        assert same.usage is not None and other.usage is not None
        assert same.usage.reused_tokens >= 64 and other.usage.reused_tokens == 0
        assert same.token_ids == other.token_ids

        # And back to A, with B's turn in it.
        back = ca.session(s.session_id)
        assert back.info().n_tokens == moved.info().n_tokens
        back.close()
        with pytest.raises(kvkeep.NotFoundError):
            cb.session(s.session_id)


def test_turns_are_records_on_the_catalog_server_and_another_daemon_continues_them_after_a_kill(
    spawn_daemon: Callable[..., DaemonProcess], tmp_path: Path, redis_server: str
) -> None:
    a, b = shared_pair(spawn_daemon, tmp_path, redis_server)
    with kvkeep.Client(a.address, timeout=60) as ca, kvkeep.Client(b.address, timeout=60) as cb:
        s = ca.create_session(SYSTEM, persistent=True, sampling=SAMPLING)
        head = s.info().head_checkpoint_id
        for question in ("When do you open?", "And on Sundays?", "Do you sell rye?"):
            s.chat(question, max_tokens=8)
        acknowledged = s.info()
        # Short turns are journal records on the catalog's server: no head was written.
        assert acknowledged.head_checkpoint_id == head
        expected = s.fork(persistent=True).chat("And cakes?", max_tokens=12)  # what A would say
        listed = {i.session_id: i for i in cb.list_sessions()}[s.session_id]
        assert listed.holder == "daemon-a" and listed.n_tokens == acknowledged.n_tokens
        assert listed.residency == "cold" and listed.last_used_at >= acknowledged.last_used_at - 1

        a.kill()
        # B takes the session over once A's lease lapses (the client waits out the hints),
        # from its head and the record: every acknowledged turn, then the same next tokens.
        moved = cb.session(s.session_id)
        assert moved.info().n_tokens == acknowledged.n_tokens
        assert [m.content for m in moved.info().messages] == [m.content for m in acknowledged.messages]
        got = moved.chat("And cakes?", max_tokens=12)
        assert got.token_ids == expected.token_ids
        assert got.usage is not None and expected.usage is not None
        # The turns past the head were evaluated again, not read from the store.
        assert got.usage.evaluated_tokens > expected.usage.evaluated_tokens
        assert {i.session_id: i for i in cb.list_sessions()}[s.session_id].holder == "daemon-b"
        listing = CliRunner().invoke(cli_main, ["--address", b.address, "session", "list"])
        assert listing.exit_code == 0 and "HELD BY" in listing.output
        assert any(
            s.session_id in line and line.rstrip().endswith("daemon-b")
            for line in listing.output.splitlines()
        )


ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789abc"


def ids(client: kvkeep.Client) -> list[str]:
    return [i.session_id for i in client.list_sessions()]


def test_every_daemon_lists_a_tenants_persistent_sessions_and_never_another_tenants(
    spawn_daemon: Callable[..., DaemonProcess], tmp_path: Path, redis_server: str
) -> None:
    auth = tmp_path / "auth.toml"
    auth.write_text(f'[tenants.alice]\ntokens = ["{ALICE}"]\n[tenants.bob]\ntokens = ["{BOB}"]\n')
    a, b = shared_pair(spawn_daemon, tmp_path, redis_server, both=("--auth-file", str(auth)))
    with (
        kvkeep.Client(a.address, timeout=60, token=ALICE) as ca,
        kvkeep.Client(b.address, timeout=60, token=ALICE) as cb,
        kvkeep.Client(a.address, timeout=60, token=BOB) as bob_a,
        kvkeep.Client(b.address, timeout=60, token=BOB) as bob_b,
    ):
        s = ca.create_session(SYSTEM, persistent=True, sampling=SAMPLING)
        s.chat("When do you open?", max_tokens=8)
        s.checkpoint("after the first turn")
        here = cb.create_session(persistent=False)  # B's own, ephemeral
        mine = bob_b.create_session(persistent=True)  # another tenant's, on B

        # A holds the session: B lists it from the catalog (its head), and takes nothing over.
        listed = {i.session_id: i for i in cb.list_sessions()}
        assert sorted(listed) == sorted([s.session_id, here.session_id])
        on_a = s.info()
        got = listed[s.session_id]
        assert got.persistent and got.residency == "cold" and got.n_checkpoints == 1
        # Its head is in the daemons' shared (Redis) store; --persistent-ttl 0: it never expires.
        assert got.location == "shared store" and got.expires_at == 0
        assert listed[here.session_id].expires_at > 0  # --idle-ttl's
        assert got.head_checkpoint_id == on_a.head_checkpoint_id and 0 < got.n_tokens <= on_a.n_tokens
        # The catalog's times: the first head's save (just after the creation) and the last one's.
        assert on_a.created_at <= got.created_at < on_a.last_used_at <= got.last_used_at
        assert [i.residency for i in ca.list_sessions()] == [on_a.residency] != ["cold"]  # A's own view, once
        assert ids(bob_a) == ids(bob_b) == [mine.session_id]

        # A stops (saving the session and letting its lease go): held by none, B still lists it.
        a.terminate()
        listed = {i.session_id: i for i in cb.list_sessions()}
        assert sorted(listed) == sorted([s.session_id, here.session_id])
        assert listed[s.session_id].n_tokens == on_a.n_tokens
        assert ids(bob_b) == [mine.session_id]


def test_one_daemon_at_a_time_expires_the_sessions_no_daemon_holds(
    spawn_daemon: Callable[..., DaemonProcess], tmp_path: Path, redis_server: str
) -> None:
    ttl = 1.0
    a, b = shared_pair(
        spawn_daemon, tmp_path, redis_server, both=("--persistent-ttl", str(ttl), "--sweep-interval", "0.2")
    )
    duty = "now does the cluster's expiry"
    wait_until(lambda: duty in a.log() or duty in b.log(), 20, "a daemon to take the expiry duty")
    time.sleep(1.0)  # several sweeps of each: the duty stays where it is
    assert (duty in a.log()) != (duty in b.log())
    holder, other = (a, b) if duty in a.log() else (b, a)
    with kvkeep.Client(other.address, timeout=60) as c:
        free = c.create_session(persistent=True).session_id
    other.restart()  # a graceful stop lets its leases go: the session is held by no daemon
    with kvkeep.Client(holder.address, timeout=60) as ch, kvkeep.Client(other.address, timeout=60) as co:
        wait_until(lambda: free not in ids(ch), 20, "the duty's holder to expire the session no daemon holds")
        assert f"session {free} expired in the shared catalog" in holder.log()
        assert free not in other.log().split("===== start 2")[-1] and free not in ids(co)
        with pytest.raises(kvkeep.NotFoundError):
            co.session(free)
    # The duty's holder dies: the other daemon takes the duty once its lease lapses.
    holder.kill()
    wait_until(lambda: duty in other.log(), 20, "the other daemon to take the expiry duty")


def test_a_persistent_session_swapped_out_to_storage_lets_its_lease_go(
    spawn_daemon: Callable[..., DaemonProcess], tmp_path: Path, redis_server: str
) -> None:
    # A has one slot and no RAM for parked state: a session evicted from the slot is
    # swapped out to the store at once. B waits for no lease.
    a, b = shared_pair(
        spawn_daemon, tmp_path, redis_server, "--lease-wait", "0", both=("--slots", "1", "--ram-cache", "0")
    )
    with kvkeep.Client(a.address, timeout=60) as ca, kvkeep.Client(b.address, timeout=60, retry=None) as cb:
        s = ca.create_session(SYSTEM, persistent=True, sampling=SAMPLING)
        s.chat("When do you open?", max_tokens=8)
        expected = s.fork(persistent=True).chat("And on Mondays?", max_tokens=12)  # evicts s
        released = f"session {s.session_id} swapped out to storage; its lease is released"
        wait_until(lambda: released in a.log(), 20, "A to let the swapped-out session go")
        # B takes it at once: no hand-over to wait for, no lease to lapse.
        moved = cb.session(s.session_id)
        assert moved.chat("And on Mondays?", max_tokens=12).token_ids == expected.token_ids


class Background:
    """A streamed chat in a thread: its first chunk is awaited, its end (or error) kept."""

    def __init__(self, session: kvkeep.Session, message: str, max_tokens: int) -> None:
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.chunks: list[kvkeep.Chunk] = []
        self._thread = threading.Thread(target=self._run, args=(session, message, max_tokens), daemon=True)
        self._thread.start()
        assert self.started.wait(60), "the generation did not start"

    def _run(self, session: kvkeep.Session, message: str, max_tokens: int) -> None:
        try:
            for chunk in session.chat_stream(message, max_tokens=max_tokens):
                self.chunks.append(chunk)
                self.started.set()
        except BaseException as e:
            self.error = e
        finally:
            self.started.set()

    def join(self, timeout: float = 120) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive()


def test_a_paused_daemon_is_fenced_and_a_killed_ones_sessions_go_on_elsewhere(
    spawn_daemon: Callable[..., DaemonProcess], tmp_path: Path, redis_server: str
) -> None:
    # One pair for both faults (daemons are slow to start); B waits for no lease. The clients
    # raise SessionElsewhereError at once, so that the test sees it.
    a, b = shared_pair(spawn_daemon, tmp_path, redis_server, "--lease-wait", "0")
    ca = kvkeep.Client(a.address, timeout=120, retry=None)
    cb = kvkeep.Client(b.address, timeout=60, retry=None)
    with ca, cb:
        # Paused mid-generation past its lease: B takes over from the last acknowledged turn.
        s = ca.create_session(SYSTEM, persistent=True, sampling=SAMPLING)
        s.chat("When do you open?", max_tokens=8)
        expected = s.fork(persistent=True).chat("Do you sell rye?", max_tokens=12)
        acknowledged = s.info().n_tokens
        running = Background(s, "Tell me about every bread you sell.", max_tokens=120)
        os.kill(a.pid, signal.SIGSTOP)
        try:
            time.sleep(LAPSE)
            moved = cb.session(s.session_id)
            assert moved.info().n_tokens == acknowledged
            assert moved.chat("Do you sell rye?", max_tokens=12).token_ids == expected.token_ids
        finally:
            os.kill(a.pid, signal.SIGCONT)
        running.join()
        # A's generation ends, and its autosave is refused: the lease is B's.
        assert isinstance(running.error, kvkeep.SessionElsewhereError), running.error
        assert "another daemon" in a.log()
        # Once A has let the session go (it was busy with that generation until now; asked
        # before, it answers session-elsewhere), the head is B's: asked again, A takes the
        # session over from B with B's turn.
        dropped = f"session {s.session_id} dropped: another daemon holds it now"
        wait_until(lambda: dropped in a.log(), 30, "A to let the session go", interval=0.1)
        n_on_b = moved.info().n_tokens
        assert ca.session(s.session_id).info().n_tokens == n_on_b

        # Killed mid-generation: until its lease lapses B answers UNAVAILABLE with a retry
        # hint; then B takes the session over, from the last acknowledged turn. A client
        # that waits (the default) sends its call again after each hint, and gets the session.
        s = ca.create_session(SYSTEM, persistent=True, sampling=SAMPLING)
        s.chat("Can I order a cake?", max_tokens=8)
        expected = s.fork(persistent=True).chat("For Friday?", max_tokens=12)
        acknowledged = s.info().n_tokens
        running = Background(s, "List every cake you make, with details.", max_tokens=120)
        a.kill()
        running.join()
        assert isinstance(running.error, kvkeep.UnavailableError)
        with pytest.raises(kvkeep.SessionElsewhereError) as refused:
            cb.session(s.session_id)
        hint = refused.value.retry_after
        assert hint is not None and 0 < hint <= LEASE_SECONDS
        with kvkeep.Client(b.address, timeout=60) as waiting:
            moved = waiting.session(s.session_id)
            assert moved.info().n_tokens == acknowledged
            assert moved.chat("For Friday?", max_tokens=12).token_ids == expected.token_ids


def test_a_catalog_outage_is_unavailable_loses_nothing_and_ends_by_itself(
    spawn_daemon: Callable[..., DaemonProcess], start_redis: Callable[[], RedisServer]
) -> None:
    server = start_redis()
    assert server.proc is not None
    metrics = f"127.0.0.1:{free_port()}"
    daemon = spawn_daemon(
        "--catalog", server.url, "--lease-seconds", str(LEASE_SECONDS), "--metrics-address", metrics
    )

    def reachable() -> str:
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as response:
            text = response.read().decode()
        return next(line for line in text.splitlines() if line.startswith("kvkeep_catalog_reachable "))

    assert reachable() == "kvkeep_catalog_reachable 1.0"
    with kvkeep.Client(daemon.address, timeout=60) as client:
        s = client.create_session(SYSTEM, persistent=True, sampling=SAMPLING)
        s.chat("When do you open?", max_tokens=8)
        expected = s.fork(persistent=True).chat("And close?", max_tokens=12)
        acknowledged = s.info().n_tokens
        os.kill(server.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with pytest.raises(kvkeep.UnavailableError) as failed:
                s.chat("And close?", max_tokens=12)  # its autosave cannot reach the catalog
            assert failed.value.cause == "catalog-unavailable"
            assert "cannot be reached" in str(failed.value)
            with pytest.raises(kvkeep.UnavailableError):
                client.create_session(SYSTEM, persistent=True)
            # The lease renewals find it out too (held past 10 s if the machine is slow).
            while reachable() != "kvkeep_catalog_reachable 0.0":
                assert time.monotonic() - stopped < 60
                time.sleep(0.2)
            time.sleep(max(0.0, 10 - (time.monotonic() - stopped)))
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        # Back: no restart; the failed turn was undone, so sent again it gives the same tokens.
        assert s.info().n_tokens == acknowledged
        again = s.chat("And close?", max_tokens=12)
        assert again.token_ids == expected.token_ids
        assert client.create_session(SYSTEM, persistent=True).info().n_tokens > 0
    wait_until(lambda: reachable() == "kvkeep_catalog_reachable 1.0", 30, "the catalog to answer again")
    assert daemon.running
