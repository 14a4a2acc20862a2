"""The client and CLI without a daemon: error mapping, conversions, and a fake in-process server."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner

import kvkeep
from kvkeep import _convert as conv
from kvkeep._errors import from_rpc_error
from kvkeep.cli import main
from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeep.v1 import kvkeep_pb2_grpc as pb_grpc


class FakeRpcError(grpc.RpcError):
    def __init__(
        self, code: grpc.StatusCode, details: str | None, trailing: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self._code = code
        self._details = details
        self._trailing = trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, kvkeep.InvalidRequestError),
        (grpc.StatusCode.NOT_FOUND, kvkeep.NotFoundError),
        (grpc.StatusCode.ALREADY_EXISTS, kvkeep.AlreadyExistsError),
        (grpc.StatusCode.OUT_OF_RANGE, kvkeep.ContextFullError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, kvkeep.BusyError),
        (grpc.StatusCode.FAILED_PRECONDITION, kvkeep.FailedPreconditionError),
        (grpc.StatusCode.DATA_LOSS, kvkeep.CorruptCheckpointError),
        (grpc.StatusCode.UNAUTHENTICATED, kvkeep.AuthError),
        (grpc.StatusCode.UNAVAILABLE, kvkeep.UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, kvkeep.UnavailableError),
        (grpc.StatusCode.INTERNAL, kvkeep.InternalError),
        (grpc.StatusCode.UNKNOWN, kvkeep.InternalError),
        (grpc.StatusCode.CANCELLED, kvkeep.InternalError),
        (grpc.StatusCode.UNIMPLEMENTED, kvkeep.InternalError),
    ],
)
def test_status_maps_to_error_class(status: grpc.StatusCode, cls: type[Exception]) -> None:
    error = from_rpc_error(FakeRpcError(status, "it broke"))
    assert type(error) is cls
    assert isinstance(error, kvkeep.KvkeepError)
    assert error.code == status.name
    assert error.message == "it broke" == str(error)


@pytest.mark.parametrize(
    ("status", "cause", "cls"),
    [
        (grpc.StatusCode.FAILED_PRECONDITION, "incompatible-checkpoint", kvkeep.IncompatibleCheckpointError),
        (grpc.StatusCode.FAILED_PRECONDITION, "no-chat-template", kvkeep.NoChatTemplateError),
        (grpc.StatusCode.FAILED_PRECONDITION, "checkpoint-in-use", kvkeep.CheckpointInUseError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "store-write-failed", kvkeep.StoreWriteError),
        (grpc.StatusCode.UNAVAILABLE, "store-read-failed", kvkeep.StoreReadError),
        (grpc.StatusCode.UNAVAILABLE, "store-unreachable", kvkeep.StoreUnreachableError),
        # A cause nobody knows, or one that belongs to another status, leaves the status's class.
        (grpc.StatusCode.FAILED_PRECONDITION, "something-new", kvkeep.FailedPreconditionError),
        (grpc.StatusCode.NOT_FOUND, "no-chat-template", kvkeep.NotFoundError),
    ],
)
def test_the_daemons_cause_picks_the_subclass(
    status: grpc.StatusCode, cause: str, cls: type[kvkeep.KvkeepError]
) -> None:
    error = from_rpc_error(FakeRpcError(status, "why", (("other", "x"), ("kvkeep-error", cause))))
    assert type(error) is cls
    assert error.code == status.name
    assert error.message == "why"


def test_error_without_details_says_its_status() -> None:
    assert from_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, None)).message == "NOT_FOUND"


def test_rpc_error_that_is_not_a_call_is_internal() -> None:
    error = from_rpc_error(grpc.RpcError())
    assert isinstance(error, kvkeep.InternalError)
    assert error.code == "UNKNOWN"


def test_errors_made_by_hand_carry_their_class_code() -> None:
    assert kvkeep.NotFoundError("gone").code == "NOT_FOUND"
    assert kvkeep.KvkeepError("x", code="ABORTED").code == "ABORTED"


# --- conversions ------------------------------------------------------------------------------


def test_sampling_round_trip_keeps_unset_fields_unset() -> None:
    full = kvkeep.SamplingParams(
        temperature=0.7,
        top_k=40,
        top_p=0.95,
        min_p=0.05,
        repeat_penalty=1.1,
        penalty_last_n=-1,
        seed=2**63,
    )
    message = conv.sampling_to_pb(full)
    assert message is not None
    # float32 on the wire, yet the numbers come back as typed.
    assert conv.sampling_from_pb(message) == full

    partial = kvkeep.SamplingParams(temperature=0.0, seed=0)
    message = conv.sampling_to_pb(partial)
    assert message is not None
    assert message.HasField("temperature") and message.HasField("seed")
    assert not message.HasField("top_k")
    assert conv.sampling_from_pb(message) == partial
    assert conv.sampling_to_pb(None) is None
    assert conv.sampling_from_pb(pb.SamplingParams()) == kvkeep.SamplingParams()


def _chunk(final: bool) -> kvkeep.Chunk:
    top = (kvkeep.TokenLogprob(7, " a", -0.25), kvkeep.TokenLogprob(8, " b", -2.5))
    return kvkeep.Chunk(
        text=" a",
        token_ids=(7,),
        logprobs=(kvkeep.GeneratedToken(sampled=top[0], top=top),),
        finish_reason="eos" if final else None,
        usage=kvkeep.Usage(5, 1, 3, 2) if final else None,
    )


@pytest.mark.parametrize("final", [False, True])
def test_chunk_round_trip(final: bool) -> None:
    chunk = _chunk(final)
    message = conv.chunk_to_pb(chunk)
    assert message.HasField("usage") is final
    assert conv.chunk_from_pb(message) == chunk


def test_every_finish_reason_round_trips() -> None:
    for reason in ("length", "eos", "stop", "context_full", "cancelled"):
        message = pb.GenerationChunk(finish_reason=pb.FinishReason.Value(f"FINISH_REASON_{reason.upper()}"))
        assert conv.chunk_from_pb(message).finish_reason == reason


def test_session_info_round_trip() -> None:
    info = kvkeep.SessionInfo(
        session_id="s1",
        persistent=True,
        n_tokens=12,
        n_ctx=2048,
        sampling=kvkeep.SamplingParams(temperature=0.5, seed=3),
        stop=("\n\n",),
        messages=(
            kvkeep.Message("system", "Be brief."),
            kvkeep.Message("user", "Hi"),
            kvkeep.Message("assistant", "Hello."),
        ),
        residency="warm",
        created_at=1700000000.5,
        last_used_at=1700000001.25,
        n_checkpoints=2,
        head_checkpoint_id=None,
        location="ram",
        expires_at=1700003601.25,
        forked_from="c0",
    )
    message = conv.session_info_to_pb(info)
    assert message.head_checkpoint_id == ""
    assert message.residency == pb.RESIDENCY_WARM
    assert conv.session_info_from_pb(message) == info
    assert conv.session_info_from_pb(pb.SessionInfo(head_checkpoint_id="c1")).head_checkpoint_id == "c1"


@pytest.mark.parametrize("label", [None, "before-tools"])
def test_checkpoint_info_round_trip(label: str | None) -> None:
    info = kvkeep.CheckpointInfo("c1", "s1", label, 99, 4096, 1 << 40, 1700000000.0)
    assert conv.checkpoint_info_from_pb(conv.checkpoint_info_to_pb(info)) == info


def test_info_round_trip_covers_every_field() -> None:
    message = pb.GetInfoResponse()
    for n, field in enumerate(message.DESCRIPTOR.fields, start=1):
        if field.type == field.TYPE_STRING:
            setattr(message, field.name, f"v{n}")
        elif field.type == field.TYPE_BOOL:
            setattr(message, field.name, True)
        elif field.type == field.TYPE_DOUBLE:
            setattr(message, field.name, n + 0.5)
        else:
            setattr(message, field.name, n)
    info = conv.info_from_pb(message)
    assert conv.info_to_pb(info) == message
    assert info.mode == message.mode


def test_generate_request_takes_text_or_token_ids() -> None:
    args: dict[str, Any] = {
        "max_tokens": None,
        "stop": "\n",
        "sampling": None,
        "logprobs": 0,
        "parse_special": False,
    }
    text = conv.generate_request("s1", "Once", **args)
    assert text.prompt == "Once" and not text.prompt_token_ids
    assert not text.HasField("max_tokens") and not text.HasField("sampling")
    assert list(text.stop) == ["\n"]  # a lone string is one stop string, not one per character
    tokens = conv.generate_request("s1", [1, 2, 3], **{**args, "max_tokens": 0})
    assert tokens.prompt == "" and list(tokens.prompt_token_ids) == [1, 2, 3]
    assert tokens.HasField("max_tokens") and tokens.max_tokens == 0


def test_join_chunks() -> None:
    completion = conv.join_chunks([_chunk(False), _chunk(True)])
    assert completion.text == " a a"
    assert completion.token_ids == (7, 7)
    assert len(completion.logprobs) == 2
    assert completion.finish_reason == "eos"
    assert completion.usage == kvkeep.Usage(5, 1, 3, 2)
    with pytest.raises(kvkeep.InternalError):
        conv.join_chunks([_chunk(False)])


# --- the CLI without a daemon -----------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--address", "127.0.0.1:1", "info"],
        ["--address", "127.0.0.1:1", "--json", "session", "list"],
        ["run", "hi", "--address", "127.0.0.1:1"],
        ["chat", "--address", "127.0.0.1:1"],
        [
            "--address",
            "127.0.0.1:2",
            "session",
            "create",
            "--persistent",
            "--json",
            "--address",
            "127.0.0.1:1",
        ],
    ],
)
def test_cli_unreachable_daemon_is_one_error_line_that_says_how_to_start_one(args: list[str]) -> None:
    started = time.monotonic()
    result = CliRunner().invoke(main, ["--timeout", "5", *args])
    assert time.monotonic() - started < 5
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: cannot reach kvkeep at 127.0.0.1:1 (Connection refused): start a daemon with "
        "`kvkeep serve`, or give its address with --address or KVKEEP_ADDRESS"
    ]


def test_cli_address_comes_from_the_environment() -> None:
    result = CliRunner(env={"KVKEEP_ADDRESS": "127.0.0.1:1"}).invoke(main, ["info"])
    assert result.exit_code == 1
    assert "cannot reach kvkeep at 127.0.0.1:1" in result.stderr


# --- a fake daemon in this process ------------------------------------------------------------


class FakeDaemon(pb_grpc.KvKeepServicer):
    """Just enough of the service to drive the client: one session "s1", one checkpoint "c1"."""

    def __init__(self) -> None:
        self.generate_ended = threading.Event()
        self.blob = bytes(range(256)) * 9000  # > 2 MiB, so export and import take several chunks
        self.imported = b""
        self.closed: list[str] = []
        # Calls about session "moving" that are refused, as another daemon's, before it is here.
        self.elsewhere = 0
        self.refused = 0
        # Calls about session "flaky" (and CreateSession) that fail as a lost connection does.
        self.cut = 0
        self.cuts = 0

    def _cut(self, context: grpc.ServicerContext, how: str = "reset") -> None:
        if self.cuts < self.cut:
            self.cuts += 1
            if how == "removed":  # what gRPC reports when a proxy ends a stream short
                context.abort(grpc.StatusCode.INTERNAL, "Stream removed")
            if how == "bug":  # the daemon's own internal error
                context.set_trailing_metadata((("kvkeep-error", "internal"),))
                context.abort(grpc.StatusCode.INTERNAL, "internal error (see the daemon's log)")
            context.abort(grpc.StatusCode.UNAVAILABLE, "upstream connection reset")

    def _held_elsewhere(self, context: grpc.ServicerContext) -> None:
        if self.refused < self.elsewhere:
            self.refused += 1
            hint = (("kvkeep-error", "session-elsewhere"), ("kvkeep-retry-after-ms", "20"))
            context.set_trailing_metadata(hint)
            context.abort(grpc.StatusCode.UNAVAILABLE, "session moving is held by another daemon")

    def _session(self, session_id: str, context: grpc.ServicerContext) -> pb.SessionInfo:
        if session_id == "flaky":
            self._cut(context)
            return pb.SessionInfo(session_id="flaky", n_tokens=3, n_ctx=256, residency=pb.RESIDENCY_HOT)
        if session_id == "moving":
            self._held_elsewhere(context)
            return pb.SessionInfo(session_id="moving", n_tokens=3, n_ctx=256, residency=pb.RESIDENCY_COLD)
        if session_id != "s1":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {session_id!r}")
        return pb.SessionInfo(session_id="s1", n_tokens=3, n_ctx=256, residency=pb.RESIDENCY_HOT)

    def GetInfo(self, request: Any, context: Any) -> pb.GetInfoResponse:
        return pb.GetInfoResponse(mode="exact", has_chat_template=True)

    def CreateSession(self, request: Any, context: Any) -> pb.CreateSessionResponse:
        self._cut(context)
        return pb.CreateSessionResponse(session=self._session("s1", context))

    def GetSession(self, request: Any, context: Any) -> pb.GetSessionResponse:
        return pb.GetSessionResponse(session=self._session(request.session_id, context))

    def CloseSession(self, request: Any, context: Any) -> pb.CloseSessionResponse:
        self._session(request.session_id, context)
        self.closed.append(request.session_id)
        return pb.CloseSessionResponse()

    def Chat(self, request: Any, context: Any) -> Iterator[pb.ChatResponse]:
        if request.session_id == "moving":
            if request.message == "late":  # refused after a chunk: the client must not send it again
                yield pb.ChatResponse(chunk=pb.GenerationChunk(text="partial"))
            self._held_elsewhere(context)
        if request.session_id == "flaky":
            if request.message == "late":  # cut after a chunk: the client must not send it again
                yield pb.ChatResponse(chunk=pb.GenerationChunk(text="partial"))
            self._cut(context, how=request.message if request.message in ("removed", "bug") else "reset")
        if request.message == "overflow":
            yield pb.ChatResponse(chunk=pb.GenerationChunk(text="partial"))
            context.abort(grpc.StatusCode.OUT_OF_RANGE, "the context is full")
        for word in ("echo:", f" {request.message}"):
            yield pb.ChatResponse(chunk=pb.GenerationChunk(text=word, token_ids=[1]))
        usage = pb.Usage(prompt_tokens=4, generated_tokens=2)
        final = pb.GenerationChunk(finish_reason=pb.FINISH_REASON_EOS, usage=usage)
        yield pb.ChatResponse(chunk=final)

    def Generate(self, request: Any, context: Any) -> Iterator[pb.GenerateResponse]:
        # Endless: only the client's cancellation ends it.
        context.add_callback(self.generate_ended.set)
        while context.is_active():
            yield pb.GenerateResponse(chunk=pb.GenerationChunk(text="x", token_ids=[0]))
            time.sleep(0.005)

    def ExportCheckpoint(self, request: Any, context: Any) -> Iterator[pb.ExportCheckpointResponse]:
        if request.checkpoint_id != "c1":
            context.abort(grpc.StatusCode.NOT_FOUND, "no such checkpoint")
        for i in range(0, len(self.blob), 1 << 20):
            yield pb.ExportCheckpointResponse(data=self.blob[i : i + (1 << 20)])

    def ImportCheckpoint(self, request_iterator: Any, context: Any) -> pb.ImportCheckpointResponse:
        self.imported = b"".join(r.data for r in request_iterator)
        info = pb.CheckpointInfo(checkpoint_id="c2", bytes_written=len(self.imported))
        return pb.ImportCheckpointResponse(checkpoint=info)


@pytest.fixture
def fake() -> Iterator[tuple[FakeDaemon, str]]:
    daemon = FakeDaemon()  # type: ignore[abstract]  # the RPCs it lacks answer UNIMPLEMENTED
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_KvKeepServicer_to_server(daemon, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield daemon, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_chat_and_errors_through_a_server(fake: tuple[FakeDaemon, str]) -> None:
    _, address = fake
    with kvkeep.Client(address, timeout=5) as client:
        session = client.create_session("Be brief.")
        completion = session.chat("hi")
        assert completion.text == "echo: hi"
        assert completion.finish_reason == "eos"
        assert completion.usage.generated_tokens == 2
        with pytest.raises(kvkeep.NotFoundError, match="no session 'nope'"):
            client.session("nope")
        # An error in the middle of a stream is converted too.
        with pytest.raises(kvkeep.ContextFullError, match="context is full"):
            list(session.chat_stream("overflow"))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_call_about_a_session_held_elsewhere_is_sent_again_after_each_hint(
    fake: tuple[FakeDaemon, str], asynchronous: bool
) -> None:
    daemon, address = fake

    async def calls(client: kvkeep.AsyncClient) -> tuple[int, str]:
        session = await client.session("moving")
        n = (await session.info()).n_tokens
        daemon.refused = 0
        return n, (await session.chat("hi")).text

    def run(**kw: Any) -> tuple[int, str]:
        if asynchronous:

            async def main() -> tuple[int, str]:
                async with kvkeep.AsyncClient(address, timeout=5, **kw) as client:
                    return await calls(client)

            return asyncio.run(main())
        with kvkeep.Client(address, timeout=5, **kw) as client:
            session = client.session("moving")
            n = session.info().n_tokens
            daemon.refused = 0
            return n, session.chat("hi").text

    daemon.elsewhere = 3
    assert run() == (3, "echo: hi")  # three refusals each, then answered
    assert daemon.refused == 3
    daemon.refused = 0
    for wait in (0, 0.01):  # no wait, or less than the hint: raised at the first refusal
        with pytest.raises(kvkeep.SessionElsewhereError) as refused:
            run(retry=kvkeep.Retry(wait=wait))
        assert refused.value.retry_after == 0.02 and daemon.refused == 1
        daemon.refused = 0


@pytest.mark.parametrize("asynchronous", [False, True])
def test_after_a_lost_connection_reads_and_unanswered_turns_are_sent_again_creations_never(
    fake: tuple[FakeDaemon, str], asynchronous: bool
) -> None:
    daemon, address = fake

    async def calls(client: kvkeep.AsyncClient) -> None:
        daemon.cut, daemon.cuts = 1, 0
        with pytest.raises(kvkeep.UnavailableError):  # nothing answered yet: it may not be there
            await client.session("flaky")
        await client.info()
        daemon.cut, daemon.cuts = 2, 0
        assert (await (await client.session("flaky")).info()).n_tokens == 3
        flaky = kvkeep.AsyncSession(client, "flaky")
        daemon.cut, daemon.cuts = 2, 0
        assert (await flaky.chat("hi")).text == "echo: hi" and daemon.cuts == 2
        daemon.cut, daemon.cuts = 1, 0
        with pytest.raises(kvkeep.UnavailableError):  # it had answered: never twice
            await flaky.chat("late")
        daemon.cut, daemon.cuts = 1, 0
        with pytest.raises(kvkeep.UnavailableError):  # its outcome is unknown: never twice
            await client.create_session()
        assert daemon.cuts == 1

    def blocking(client: kvkeep.Client) -> None:
        daemon.cut, daemon.cuts = 1, 0
        with pytest.raises(kvkeep.UnavailableError):  # nothing answered yet: it may not be there
            client.session("flaky")
        client.info()
        daemon.cut, daemon.cuts = 2, 0
        assert client.session("flaky").info().n_tokens == 3
        flaky = kvkeep.Session(client, "flaky")
        daemon.cut, daemon.cuts = 2, 0
        assert flaky.chat("hi").text == "echo: hi" and daemon.cuts == 2
        daemon.cut, daemon.cuts = 1, 0
        with pytest.raises(kvkeep.UnavailableError):
            flaky.chat("late")
        daemon.cut, daemon.cuts = 1, 0
        with pytest.raises(kvkeep.UnavailableError):
            client.create_session()
        assert daemon.cuts == 1
        # A stream a proxy cut short is INTERNAL without the daemon's cause: sent again; the
        # daemon's own internal error never is.
        daemon.cut, daemon.cuts = 2, 0
        assert flaky.chat("removed").text == "echo: removed" and daemon.cuts == 2
        daemon.cut, daemon.cuts = 2, 0
        with pytest.raises(kvkeep.InternalError) as bug:
            flaky.chat("bug")
        assert bug.value.cause == "internal" and daemon.cuts == 1

    if asynchronous:

        async def main() -> None:
            async with kvkeep.AsyncClient(address, timeout=5) as client:
                await calls(client)

        asyncio.run(main())
    else:
        with kvkeep.Client(address, timeout=5) as client:
            blocking(client)
    daemon.cut, daemon.cuts = 1, 0
    with kvkeep.Client(address, timeout=5, retry=None) as client:
        client.info()
        with pytest.raises(kvkeep.UnavailableError):
            client.session("flaky")  # retry=None: raised at once


def test_a_retry_pauses_by_a_bounded_backoff_and_at_least_the_hint() -> None:
    from kvkeep._retry import Attempts

    lost = kvkeep.UnavailableError("connection reset")
    attempts = Attempts(kvkeep.Retry(wait=60, first=0.1, most=0.4), resend=True)
    pauses = [attempts.pause(lost) for _ in range(6)]
    bounds = [0.1, 0.2, 0.4, 0.4, 0.4, 0.4]
    assert all(p is not None and b / 2 <= p <= b for p, b in zip(pauses, bounds, strict=True)), pauses
    elsewhere = kvkeep.SessionElsewhereError("held elsewhere")
    elsewhere.retry_after = 1.5
    assert attempts.pause(elsewhere) == 1.5  # the hint, when longer than the backoff
    assert Attempts(kvkeep.Retry(), resend=False).pause(lost) is None  # not a read: raised
    assert Attempts(kvkeep.Retry(wait=0.01), resend=True).pause(elsewhere) is None  # past its wait
    assert Attempts(kvkeep.Retry(), resend=True).pause(kvkeep.CatalogUnavailableError("x")) is None
    with pytest.raises(ValueError):
        kvkeep.Retry(first=0)


def test_a_stream_refused_after_its_first_chunk_is_not_sent_again(fake: tuple[FakeDaemon, str]) -> None:
    daemon, address = fake
    with kvkeep.Client(address, timeout=5) as client:
        session = client.session("moving")
        daemon.elsewhere = 1
        chunks: list[str] = []
        with pytest.raises(kvkeep.SessionElsewhereError):
            for chunk in session.chat_stream("late"):
                chunks.append(chunk.text)
    assert chunks == ["partial"] and daemon.refused == 1


def test_leaving_a_stream_early_cancels_the_call(fake: tuple[FakeDaemon, str]) -> None:
    daemon, address = fake
    with kvkeep.Client(address) as client:
        for n, _chunk in enumerate(client.session("s1").generate("go")):
            if n == 3:
                break
        assert daemon.generate_ended.wait(5)


def test_export_and_import_through_a_path(fake: tuple[FakeDaemon, str], tmp_path: Path) -> None:
    daemon, address = fake
    target = tmp_path / "c1.kvkeep"
    with kvkeep.Client(address) as client:
        assert client.export_checkpoint("c1", target) == len(daemon.blob)
        assert target.read_bytes() == daemon.blob
        assert client.import_checkpoint(str(target)).checkpoint_id == "c2"
        assert daemon.imported == daemon.blob
        with pytest.raises(kvkeep.NotFoundError):
            client.export_checkpoint("nope", tmp_path / "nope.kvkeep")
    # A failed export leaves neither the file nor its temporary.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c1.kvkeep"]


def test_async_client(fake: tuple[FakeDaemon, str]) -> None:
    _, address = fake

    async def go() -> str:
        async with kvkeep.AsyncClient(address, timeout=5) as client:
            session = await client.session("s1")
            with pytest.raises(kvkeep.NotFoundError):
                await client.session("nope")
            return (await session.chat("hi")).text

    assert asyncio.run(go()) == "echo: hi"


def test_async_export_import_and_leaving_a_stream(fake: tuple[FakeDaemon, str], tmp_path: Path) -> None:
    daemon, address = fake
    target = tmp_path / "c1.kvkeep"

    async def go() -> tuple[int, str, str]:
        async with kvkeep.AsyncClient(address, timeout=5) as client:
            written = await client.export_checkpoint("c1", target)
            imported = await client.import_checkpoint(target)
            session = await client.session("s1")
            stream = session.generate("go")
            async with contextlib.aclosing(stream):
                first = await anext(stream)
            info = await session.info()
            return written, imported.checkpoint_id, first.text + info.session_id

    written, imported, seen = asyncio.run(go())
    assert written == len(daemon.blob) == target.stat().st_size
    assert imported == "c2" and daemon.imported == daemon.blob
    assert seen == "xs1"
    assert daemon.generate_ended.wait(5)  # closing the stream cancelled the call


@pytest.mark.parametrize(
    ("blocking", "asynchronous"),
    [(kvkeep.Client, kvkeep.AsyncClient), (kvkeep.Session, kvkeep.AsyncSession)],
)
def test_both_faces_have_the_same_methods_arguments_and_docstrings(
    blocking: type[Any], asynchronous: type[Any]
) -> None:
    def public(cls: type[Any]) -> set[str]:
        return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}

    assert public(blocking) == public(asynchronous)
    for name in public(blocking):
        sync_method, async_method = getattr(blocking, name), getattr(asynchronous, name)
        assert sync_method.__doc__ and sync_method.__doc__ == async_method.__doc__, name
        sync_parameters = list(inspect.signature(sync_method).parameters.values())
        async_parameters = list(inspect.signature(async_method).parameters.values())
        assert [(p.name, p.kind, p.default) for p in sync_parameters] == [
            (p.name, p.kind, p.default) for p in async_parameters
        ], name
        streams = name in ("generate", "chat_stream")
        assert inspect.iscoroutinefunction(async_method) == (not streams), name


def test_cli_chat_reads_lines_from_stdin(fake: tuple[FakeDaemon, str]) -> None:
    _, address = fake
    result = CliRunner().invoke(main, ["--address", address, "chat"], input="hello\n\nagain\n")
    assert result.exit_code == 0, result.output
    assert "echo: hello\n" in result.stdout
    assert "echo: again\n" in result.stdout
    assert "session s1" in result.stderr


def test_cli_run_closes_its_session(fake: tuple[FakeDaemon, str]) -> None:
    daemon, address = fake
    result = CliRunner().invoke(main, ["--address", address, "--json", "run", "hi"])
    assert result.exit_code == 0, result.output
    assert '"text": "echo: hi"' in result.stdout
    assert daemon.closed == ["s1"]


def test_cli_daemon_error_is_one_line(fake: tuple[FakeDaemon, str]) -> None:
    _, address = fake
    result = CliRunner().invoke(main, ["--address", address, "session", "show", "nope"])
    assert result.exit_code == 1
    assert result.stderr == "error: no session 'nope'\n"


def test_global_options_go_before_or_after_the_command(fake: tuple[FakeDaemon, str]) -> None:
    _, address = fake
    before = CliRunner().invoke(main, ["--address", address, "--json", "session", "create"])
    after = CliRunner().invoke(main, ["session", "create", "--json", "--address", address])
    between = CliRunner().invoke(main, ["--address", address, "session", "--json", "create"])
    for result in (before, after, between):
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["session_id"] == "s1"
    # Only --json is listed in a command's help; the others are the root's.
    shown = CliRunner().invoke(main, ["session", "create", "--help"]).stdout
    assert "--json" in shown and "--address" not in shown


def test_serve_without_the_daemon_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvkeepd.server", None)  # makes the import fail
    needs = (
        "kvkeep serve needs the daemon's dependencies (no module 'kvkeepd.server'): "
        "pip install 'kvkeep[daemon]'"
    )
    result = CliRunner().invoke(main, ["serve", "--model", "x.gguf"])
    assert result.exit_code == 1
    assert result.stderr == f"error: {needs}\n"
    # Its options are listed all the same, with what to install first.
    helped = CliRunner().invoke(main, ["serve", "--help"])
    assert helped.exit_code == 0
    assert helped.stderr.splitlines()[0] == f"note: {needs}"
    assert "--ctx-per-session" in helped.stdout


def test_the_client_does_not_import_the_daemon() -> None:
    code = "import sys, kvkeep, kvkeep.cli; print([m for m in sys.modules if 'kvkeepd' in m])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
