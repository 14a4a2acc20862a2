"""Routing by session: two real daemons behind a real HAProxy running deploy/haproxy.cfg
itself (its addresses from the environment), and the SDK's x-kvkeep-session metadata.

The daemons here share no catalog, so a call that reaches the wrong daemon finds no session:
being found at all is the proof of routing, and HAProxy's log (one line per call, naming the
server and the captured header) says which daemon answered.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from daemons import GREEDY, NOT_SERVING, SERVING, InProcessDaemon, wait_until
from servers import HaproxyServer, free_port, require_binary

import kvkeep
from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeep.v1 import kvkeep_pb2_grpc as pb_grpc

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"
HEADER = "x-kvkeep-session"
SERVERS = ("kvkeep1", "kvkeep2")  # the config's server names, in order

# HAProxy's HTTP log line: ... BACKEND/SERVER timers STATUS ... {captured header} "POST URL HTTP/2.0"
LOG_LINE = re.compile(
    r" kvkeep_daemons/(?P<server>\S+) .*\{(?P<session>[^}]*)\} \"POST \S*/kvkeep\.v1\.KvKeep/(?P<rpc>\w+) "
)


class Proxy:
    """HAProxy on deploy/haproxy.cfg in front of two daemons, and what its log says."""

    def __init__(self, daemons: tuple[InProcessDaemon, InProcessDaemon], log_dir: Path) -> None:
        self.daemons = daemons
        self.address = f"127.0.0.1:{free_port()}"
        env = {
            "KVKEEP_PROXY_ADDRESS": self.address,
            "KVKEEP_DAEMON_1": daemons[0].address,
            "KVKEEP_DAEMON_2": daemons[1].address,
        }
        self.server = HaproxyServer(CONFIG, env, log_dir / f"haproxy-{secrets.token_hex(3)}.log")

    def start(self) -> Proxy:
        self.server.start(self._answers)
        return self

    def _answers(self) -> bool:
        with kvkeep.Client(self.address, timeout=2) as client:
            try:
                return client.info().slots > 0
            except kvkeep.KvkeepError:
                return False

    def calls(self) -> list[tuple[str, str, str]]:
        """(server, session header, RPC) of every call logged so far."""
        return [
            (m["server"], m["session"], m["rpc"])
            for m in map(LOG_LINE.search, self.server.log().splitlines())
            if m is not None
        ]

    def servers_of(self, session_id: str) -> set[str]:
        """The servers that calls routed by ``session_id`` reached."""
        return {server for server, session, _ in self.calls() if session == session_id}

    def log_mark(self) -> int:
        """Where the log ends now: ``wait_for_state`` looks only at what comes after."""
        return len(self.server.log())

    def wait_for_state(self, server: str, state: str, since: int) -> None:
        """Until HAProxy's log says, after ``since``, that its health check found ``server``
        ``state`` (UP or DOWN)."""
        line = f"Server kvkeep_daemons/{server} is {state}"
        wait_until(lambda: line in self.server.log()[since:], 20, f"haproxy to log {line!r}", interval=0.1)

    def stop(self) -> None:
        self.server.stop()


def holder(session_id: str, daemons: tuple[InProcessDaemon, ...]) -> int:
    """The index of the one daemon that has the session (asked directly, not through the proxy)."""
    found = []
    for i, d in enumerate(daemons):
        with kvkeep.Client(d.address, timeout=10) as direct:
            try:
                direct.session(session_id)
                found.append(i)
            except kvkeep.NotFoundError:
                pass
    assert len(found) == 1, f"{session_id} is on daemons {found}"
    return found[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessDaemon, InProcessDaemon]]:
    """Two daemons for the proxies of this module (checked for HAProxy first: starting the
    daemons is what takes time)."""
    require_binary("haproxy")
    started: list[InProcessDaemon] = []
    try:
        for _ in range(2):
            started.append(
                InProcessDaemon.with_settings(tmp_path_factory.mktemp("state"), slots=2, ctx_per_session=512)
            )
        yield started[0], started[1]
    finally:
        for d in started:
            d.stop()


@pytest.fixture(scope="module")
def proxy(
    pair: tuple[InProcessDaemon, InProcessDaemon], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    p = Proxy(pair, tmp_path_factory.mktemp("haproxy"))
    try:
        yield p.start()
    finally:
        p.stop()


def test_a_sessions_calls_all_reach_the_daemon_that_made_it(proxy: Proxy) -> None:
    with kvkeep.Client(proxy.address, timeout=30) as client:
        # Creating names no session yet: round-robin, so new sessions spread over both.
        sessions = [client.create_session("You are terse.", sampling=GREEDY) for _ in range(4)]
        holders = {s.session_id: holder(s.session_id, proxy.daemons) for s in sessions}
        assert set(holders.values()) == {0, 1}
        forks = {}
        for s in sessions:
            s.chat("Name a colour.", max_tokens=3)
            s.info()
            ck = s.checkpoint(label="routed")
            assert [c.checkpoint_id for c in s.checkpoints()] == [ck.checkpoint_id]
            s.rewind(s.info().n_tokens - 1)
            s.restore(ck.checkpoint_id)
            forks[s.session_id] = [s.fork(), s.fork(ck.checkpoint_id), client.fork_session(s.session_id)]
            client.session(s.session_id).complete("Go on.", max_tokens=2)
        for parent, children in forks.items():
            for child in children:
                # A fork is made where its parent is, and its own calls follow it there.
                assert holder(child.session_id, proxy.daemons) == holders[parent]
                child.chat("And another?", max_tokens=2)
                child.close()
        for s in sessions:
            s.close()
    for session_id, held_by in [
        *holders.items(),
        *((c.session_id, holders[p]) for p, cs in forks.items() for c in cs),
    ]:
        assert proxy.servers_of(session_id) == {SERVERS[held_by]}, session_id
    logged = {rpc for _, session, rpc in proxy.calls() if session}
    assert {"Chat", "Generate", "Checkpoint", "ListCheckpoints", "Rewind"} <= logged
    assert {"RestoreCheckpoint", "ForkSession", "GetSession", "CloseSession"} <= logged


def test_streams_go_through_unbuffered(proxy: Proxy) -> None:
    prompt = "Write a long story about a lighthouse."
    with kvkeep.Client(proxy.address, timeout=30) as client:
        routed = client.create_session(sampling=GREEDY)
        chunks = list(routed.chat_stream(prompt, max_tokens=24))
        direct_daemon = proxy.daemons[1 - holder(routed.session_id, proxy.daemons)]
        with kvkeep.Client(direct_daemon.address, timeout=30) as direct:
            expected = direct.create_session(sampling=GREEDY).chat(prompt, max_tokens=24)
        assert len(chunks) > 2
        assert tuple(t for c in chunks for t in c.token_ids) == tuple(expected.token_ids)

        # The first chunk arrives while the daemon is still generating (nothing holds the
        # stream back), and leaving the stream cancels the generation through the proxy.
        before = routed.info().n_tokens
        stream = routed.chat_stream("Tell it again, longer.", max_tokens=300)
        first = next(stream)
        stream.close()
        assert first.token_ids or first.text
        after = wait_until(lambda: _settled_tokens(routed), 30, "the cancelled generation to end")
        assert after - before < 200, "the whole reply was generated before its first chunk came through"
        routed.close()


def _settled_tokens(session: kvkeep.Session) -> int | None:
    """The session's token count once it is no longer busy with a generation."""
    first = session.info().n_tokens
    time.sleep(0.2)
    return first if session.info().n_tokens == first else None


def test_sessions_the_proxy_does_not_know_go_by_consistent_hash(
    pair: tuple[InProcessDaemon, InProcessDaemon], tmp_path: Path
) -> None:
    # A fresh HAProxy knows no session: every call goes by the hash of its header.
    fresh = Proxy(pair, tmp_path).start()
    try:
        ids = [f"s_{secrets.token_hex(12)}" for _ in range(40)]
        with kvkeep.Client(fresh.address, timeout=30) as client:
            for _ in range(2):
                for session_id in ids:
                    with pytest.raises(kvkeep.NotFoundError):
                        client.session(session_id)
        chosen = {session_id: fresh.servers_of(session_id) for session_id in ids}
        assert all(len(servers) == 1 for servers in chosen.values()), chosen
        assert set().union(*chosen.values()) == set(SERVERS)
    finally:
        fresh.stop()


def test_the_health_check_takes_a_daemon_out_and_back(
    pair: tuple[InProcessDaemon, InProcessDaemon], tmp_path: Path
) -> None:
    spare = InProcessDaemon.with_settings(tmp_path / "spare", slots=1, ctx_per_session=256)
    proxy = Proxy((pair[0], spare), tmp_path).start()
    try:
        with kvkeep.Client(proxy.address, timeout=30) as client:
            by_daemon: dict[int, kvkeep.Session] = {}
            for _ in range(6):  # round-robin: one on each, soon
                s = client.create_session()
                by_daemon.setdefault(holder(s.session_id, proxy.daemons), s)
            assert set(by_daemon) == {0, 1}

            # NOT_SERVING while still listening (a daemon draining): out, and back when SERVING.
            mark = proxy.log_mark()
            spare.run(spare.daemon._set_health(NOT_SERVING))  # type: ignore[union-attr]
            proxy.wait_for_state(SERVERS[1], "DOWN", mark)
            assert all(holder(client.create_session().session_id, proxy.daemons) == 0 for _ in range(3))
            mark = proxy.log_mark()
            spare.run(spare.daemon._set_health(SERVING))  # type: ignore[union-attr]
            proxy.wait_for_state(SERVERS[1], "UP", mark)
            by_daemon[1].complete("Hello", max_tokens=2)

            mark = proxy.log_mark()
            spare.stop()
            proxy.wait_for_state(SERVERS[1], "DOWN", mark)
            # Its sessions now go to the daemon that is up, which does not have them (no shared
            # catalog here): NOT_FOUND from a daemon, not UNAVAILABLE from the proxy.
            with pytest.raises(kvkeep.NotFoundError):
                by_daemon[1].info()
            by_daemon[0].complete("Hello", max_tokens=2)
            assert all(holder(client.create_session().session_id, proxy.daemons[:1]) == 0 for _ in range(3))
    finally:
        proxy.stop()
        spare.stop()


def test_a_header_naming_another_session_is_refused(client: kvkeep.Client, daemon_address: str) -> None:
    one, other = client.create_session(), client.create_session()
    with grpc.insecure_channel(daemon_address) as channel:
        stub = pb_grpc.KvKeepStub(channel)
        request = pb.GetSessionRequest(session_id=one.session_id)
        assert stub.GetSession(request, metadata=[(HEADER, one.session_id)], timeout=10).session.session_id
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetSession(request, metadata=[(HEADER, other.session_id)], timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert HEADER in (refused.value.details() or "")
        chat = pb.ChatRequest(session_id=one.session_id, message="Hi", max_tokens=1)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Chat(chat, metadata=[(HEADER, other.session_id)], timeout=10))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A fork of a checkpoint names no session in its request: any header may route it.
        ck = one.checkpoint()
        fork = pb.ForkSessionRequest(checkpoint_id=ck.checkpoint_id)
        forked, call = stub.ForkSession.with_call(fork, metadata=[(HEADER, other.session_id)], timeout=10)
        # The answer names the new session in the same header, for a proxy to learn.
        assert (HEADER, forked.session.session_id) in tuple(call.initial_metadata())
    for s in (one, other, client.session(forked.session.session_id)):
        s.close()


# --- the SDK side -------------------------------------------------------------------------------


class Recorder(grpc.GenericRpcHandler):
    """A server that answers nothing (UNIMPLEMENTED) and records each call's session header."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    def service(self, details: grpc.HandlerCallDetails) -> None:
        header = next((v for k, v in details.invocation_metadata if k == HEADER), None)  # type: ignore[attr-defined]
        self.calls.append((details.method.rsplit("/", 1)[-1], header))  # type: ignore[attr-defined]


@pytest.fixture
def recorder() -> Iterator[tuple[Recorder, str]]:
    handler = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield handler, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


SID, CID = "s_" + "a" * 24, "c_" + "b" * 24

#: Every public method of Client and AsyncClient: its arguments, and the header it must send.
CLIENT_CALLS: dict[str, tuple[Callable[[Path], tuple[Any, ...]], dict[str, Any], str | None]] = {
    "info": (lambda p: (), {}, None),
    "create_session": (lambda p: ("Hi",), {}, None),
    "list_sessions": (lambda p: (), {}, None),
    "session": (lambda p: (SID,), {}, SID),
    "fork_session": (lambda p: (SID,), {}, SID),
    "list_checkpoints": (lambda p: (SID,), {}, SID),
    "delete_checkpoint": (lambda p: (CID,), {}, None),
    "export_checkpoint": (lambda p: (CID, p / "out.kvkeep"), {}, None),
    "import_checkpoint": (lambda p: (p / "in.kvkeep",), {}, None),
    # A stored response is not a session's: its calls name none.
    "list_responses": (lambda p: (), {}, None),
    "delete_response": (lambda p: ("resp_" + "0" * 24,), {}, None),
    "close": (lambda p: (), {}, None),  # makes no call
}

#: Every public method of Session and AsyncSession: its arguments. All send the session's id.
SESSION_CALLS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "generate": (("Hi",), {}),
    "complete": (("Hi",), {}),
    "chat_stream": (("Hi",), {}),
    "chat": (("Hi",), {}),
    "info": ((), {}),
    "close": ((), {}),
    "rewind": ((1,), {}),
    "checkpoint": ((), {}),
    "checkpoints": ((), {}),
    "restore": ((CID,), {}),
    "fork": ((), {}),
    "fork_checkpoint": ((), {"checkpoint_id": CID}),  # a fork of its checkpoint goes where it is
}


def _public(cls: type[Any]) -> set[str]:
    return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}


def test_every_call_about_a_session_names_it(recorder: tuple[Recorder, str], tmp_path: Path) -> None:
    handler, address = recorder
    (tmp_path / "in.kvkeep").write_bytes(b"x")
    assert _public(kvkeep.Client) == _public(kvkeep.AsyncClient) == set(CLIENT_CALLS)
    assert _public(kvkeep.Session) == _public(kvkeep.AsyncSession) == set(SESSION_CALLS) - {"fork_checkpoint"}

    def method(target: Any, name: str) -> Any:
        return getattr(target, "fork" if name == "fork_checkpoint" else name)

    def sync_call(target: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with pytest.raises(kvkeep.KvkeepError):
            result = method(target, name)(*args, **kwargs)
            list(result)  # a stream starts when it is read

    async def async_call(target: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with pytest.raises(kvkeep.KvkeepError):
            result = method(target, name)(*args, **kwargs)
            if hasattr(result, "__anext__"):
                async for _ in result:
                    pass
            else:
                await result

    expected: list[tuple[str, str | None]] = []
    with kvkeep.Client(address, timeout=5) as client:
        for name, (args, kwargs, header) in CLIENT_CALLS.items():
            if name != "close":
                sync_call(client, name, args(tmp_path), kwargs)
                expected.append((name, header))
        session = kvkeep.Session(client, SID)
        for name, (args, kwargs) in SESSION_CALLS.items():
            sync_call(session, name, args, kwargs)
            expected.append((name, SID))

    async def run_async() -> None:
        async with kvkeep.AsyncClient(address, timeout=5) as client:
            for name, (args, kwargs, _) in CLIENT_CALLS.items():
                if name != "close":
                    await async_call(client, name, args(tmp_path), kwargs)
            session = kvkeep.AsyncSession(client, SID)
            for name, (args, kwargs) in SESSION_CALLS.items():
                await async_call(session, name, args, kwargs)

    asyncio.run(run_async())
    headers = [header for _, header in handler.calls]
    assert headers == [h for _, h in expected] * 2, list(zip(expected * 2, handler.calls, strict=False))


def test_an_id_that_cannot_be_a_header_is_sent_without_it(recorder: tuple[Recorder, str]) -> None:
    handler, address = recorder
    with kvkeep.Client(address, timeout=5) as client:
        for session_id in ("s_é", "s_a\nb", " s_a", "s_" + "a" * 20000):
            with pytest.raises(kvkeep.KvkeepError) as e:
                client.session(session_id)
            assert e.value.code == "UNIMPLEMENTED"  # it reached the server
    assert [header for _, header in handler.calls] == [None, None, None, None]
