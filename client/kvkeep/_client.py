"""The blocking client: Client, and Session for calls about one session.

Each method sends an operation of _operations, which builds its request and converts its
answer; this module only makes the calls.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

import grpc

from kvkeep import _operations as ops
from kvkeep._connection import Tls, auth_metadata, call_metadata, channel, resolve_address
from kvkeep._convert import join_chunks
from kvkeep._errors import from_rpc_error
from kvkeep._files import CHUNK_BYTES, PathOrFile, open_destination, open_source
from kvkeep._operations import described_by
from kvkeep._retry import DEFAULT_RETRY, Attempts, Retry
from kvkeep._types import (
    CheckpointInfo,
    Chunk,
    Completion,
    Info,
    Message,
    ResponsePage,
    SamplingParams,
    SessionInfo,
    Tool,
)
from kvkeep.v1 import kvkeep_pb2_grpc as pb_grpc

_T = TypeVar("_T")


class Client:
    """A blocking connection to a kvkeep daemon.

    Example::

        from kvkeep import Client

        with Client("127.0.0.1:50051") as client:
            session = client.create_session("You are a terse assistant.")
            print(session.chat("Name three primes.").text)
            for chunk in session.chat_stream("And three more?"):
                print(chunk.text, end="", flush=True)
            session.close()

    ``address`` is a gRPC target, ``host:port`` or ``unix:/path/to/socket``; None means
    ``$KVKEEP_ADDRESS``, else ``127.0.0.1:50051``. ``timeout`` bounds, in seconds, each call
    that returns one answer; streamed calls (generation, export, import) take as long as they
    need. Making a client does not connect: the first call does, and calls fail at once with
    UnavailableError while the daemon is down. Every failed call raises a KvkeepError.

    With several daemons behind a proxy, a call may find its session's daemon handing it
    over, or gone while another takes the session over. ``retry`` (a Retry: how long to try
    in all, and a backoff bounded by its ``most``) says how long the client sends such a
    call again: one refused with SessionElsewhereError, after each of the daemon's hints;
    one that reads or sets a state, or a stream of which nothing has arrived, after a lost
    connection once the client was answered at its address before (a daemon or proxy that
    was never reached fails the call at once). A stream that had answered, and a call whose
    outcome is unknown, are never sent again. ``retry=None`` raises every error at once.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float | None = None,
        token: str | None = None,
        tls: Tls | None = None,
        retry: Retry | None = DEFAULT_RETRY,
    ) -> None:
        self.address = resolve_address(address)
        self.timeout = timeout
        self.retry = retry
        # Whether a call was ever answered: until one is, nothing may be listening at the
        # address, and a lost connection is raised at once instead of tried again.
        self._reached = False
        self._metadata = auth_metadata(token)
        self._channel = channel(self.address, tls)
        self._stub = pb_grpc.KvKeepStub(self._channel)

    def __repr__(self) -> str:
        return f"Client({self.address!r})"

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection; calls in flight are cancelled."""
        self._channel.close()

    def _unary(self, op: ops.Unary[_T]) -> _T:
        rpc = getattr(self._stub, op.method)
        metadata = call_metadata(self._metadata, op.session_id)
        attempts = Attempts(self.retry, op.resend and self._reached)
        while True:
            try:
                response = rpc(op.request, timeout=self.timeout, metadata=metadata)
            except grpc.RpcError as e:
                error = from_rpc_error(e)
                pause = attempts.pause(error)
                if pause is None:
                    raise error from None
                time.sleep(pause)
                continue
            self._reached = True
            return op.convert(response)

    def _stream(self, op: ops.Stream[_T]) -> Generator[_T, None, None]:
        metadata = call_metadata(self._metadata, op.session_id)
        attempts = Attempts(self.retry, op.resend and self._reached)
        while True:
            call = getattr(self._stub, op.method)(op.request, metadata=metadata)
            answered = False
            try:
                for response in call:
                    answered = self._reached = True
                    if op.aside is not None and op.aside(response):
                        continue
                    yield op.convert(response)
                return
            except grpc.RpcError as e:
                error = from_rpc_error(e)
                # Sent again only while nothing of it was answered: a consumer never sees
                # a chunk twice.
                pause = attempts.pause(error, answered=answered)
                if pause is None:
                    raise error from None
            finally:
                # The consumer may stop early (break, an exception, Ctrl-C): stop the daemon's work.
                call.cancel()
            time.sleep(pause)

    @described_by(ops.info)
    def info(self) -> Info:
        return self._unary(ops.info())

    @described_by(ops.create_session)
    def create_session(
        self,
        system_prompt: str = "",
        *,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        persistent: bool = False,
        cache_salt: str | bytes | None = None,
        context_policy: str = "error",
        tools: Sequence[Tool] = (),
    ) -> Session:
        return Session(
            self,
            self._unary(
                ops.create_session(
                    system_prompt, sampling, stop, persistent, cache_salt, context_policy, tools
                )
            ),
        )

    @described_by(ops.session)
    def session(self, session_id: str) -> Session:
        return Session(self, self._unary(ops.session(session_id)))

    @described_by(ops.list_sessions)
    def list_sessions(self) -> list[SessionInfo]:
        return self._unary(ops.list_sessions())

    @described_by(ops.fork_session)
    def fork_session(
        self,
        session_id: str | None = None,
        checkpoint_id: str | None = None,
        *,
        persistent: bool = False,
    ) -> Session:
        return Session(self, self._unary(ops.fork_session(session_id, checkpoint_id, persistent)))

    @described_by(ops.list_checkpoints)
    def list_checkpoints(self, session_id: str | None = None) -> list[CheckpointInfo]:
        return self._unary(ops.list_checkpoints(session_id))

    @described_by(ops.delete_checkpoint)
    def delete_checkpoint(self, checkpoint_id: str) -> None:
        self._unary(ops.delete_checkpoint(checkpoint_id))

    @described_by(ops.list_responses)
    def list_responses(
        self, *, limit: int = 20, after: str | None = None, order: str = "desc"
    ) -> ResponsePage:
        return self._unary(ops.list_responses(limit, after, order))

    @described_by(ops.delete_response)
    def delete_response(self, response_id: str) -> None:
        self._unary(ops.delete_response(response_id))

    @described_by(ops.export_checkpoint)
    def export_checkpoint(self, checkpoint_id: str, path_or_file: PathOrFile) -> int:
        written = 0
        with open_destination(path_or_file) as f:
            for data in self._stream(ops.export_checkpoint(checkpoint_id)):
                f.write(data)
                written += len(data)
        return written

    @described_by(ops.IMPORT_CHECKPOINT)
    def import_checkpoint(self, path_or_file: PathOrFile) -> CheckpointInfo:
        with open_source(path_or_file) as f:
            requests = (ops.import_request(data) for data in iter(partial(f.read, CHUNK_BYTES), b""))
            try:
                response = getattr(self._stub, ops.IMPORT_METHOD)(requests, metadata=self._metadata)
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
        return ops.imported(response)


class Session:
    """One session of a daemon, reached through ``client``.

    Get one from Client.create_session, Client.session or Client.fork_session.
    """

    def __init__(self, client: Client, session_id: str) -> None:
        self.client = client
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"Session({self.session_id!r})"

    @described_by(ops.generate)
    def generate(
        self,
        prompt: str | Sequence[int] = "",
        *,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
        sampling: SamplingParams | None = None,
        logprobs: int = 0,
        grammar: str | None = None,
        json_schema: str | Mapping[str, Any] | None = None,
        parse_special: bool = False,
        on_progress: ops.OnProgress | None = None,
    ) -> Generator[Chunk, None, None]:
        op = ops.generate(
            self.session_id,
            prompt,
            max_tokens=max_tokens,
            stop=stop,
            sampling=sampling,
            logprobs=logprobs,
            grammar=grammar,
            json_schema=json_schema,
            parse_special=parse_special,
            on_progress=on_progress,
        )
        return self.client._stream(op)

    @described_by(ops.COMPLETE)
    def complete(
        self,
        prompt: str | Sequence[int] = "",
        *,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
        sampling: SamplingParams | None = None,
        logprobs: int = 0,
        grammar: str | None = None,
        json_schema: str | Mapping[str, Any] | None = None,
        parse_special: bool = False,
        on_progress: ops.OnProgress | None = None,
    ) -> Completion:
        return join_chunks(
            self.generate(
                prompt,
                max_tokens=max_tokens,
                stop=stop,
                sampling=sampling,
                logprobs=logprobs,
                grammar=grammar,
                json_schema=json_schema,
                parse_special=parse_special,
                on_progress=on_progress,
            )
        )

    @described_by(ops.chat)
    def chat_stream(
        self,
        message: str | Sequence[Message],
        *,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
        sampling: SamplingParams | None = None,
        logprobs: int = 0,
        grammar: str | None = None,
        json_schema: str | Mapping[str, Any] | None = None,
        whole: bool = False,
        tools: Sequence[Tool] | None = None,
        tool_choice: str | Tool | None = None,
        parallel_tool_calls: bool | None = None,
        on_progress: ops.OnProgress | None = None,
    ) -> Generator[Chunk, None, None]:
        op = ops.chat(
            self.session_id,
            message,
            max_tokens=max_tokens,
            stop=stop,
            sampling=sampling,
            logprobs=logprobs,
            grammar=grammar,
            json_schema=json_schema,
            whole=whole,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            on_progress=on_progress,
        )
        return self.client._stream(op)

    @described_by(ops.CHAT)
    def chat(
        self,
        message: str | Sequence[Message],
        *,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
        sampling: SamplingParams | None = None,
        logprobs: int = 0,
        grammar: str | None = None,
        json_schema: str | Mapping[str, Any] | None = None,
        whole: bool = False,
        tools: Sequence[Tool] | None = None,
        tool_choice: str | Tool | None = None,
        parallel_tool_calls: bool | None = None,
        on_progress: ops.OnProgress | None = None,
    ) -> Completion:
        return join_chunks(
            self.chat_stream(
                message,
                max_tokens=max_tokens,
                stop=stop,
                sampling=sampling,
                logprobs=logprobs,
                grammar=grammar,
                json_schema=json_schema,
                whole=whole,
                tools=tools,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                on_progress=on_progress,
            )
        )

    @described_by(ops.session_info)
    def info(self) -> SessionInfo:
        return self.client._unary(ops.session_info(self.session_id))

    @described_by(ops.close_session)
    def close(self) -> None:
        self.client._unary(ops.close_session(self.session_id))

    @described_by(ops.rewind)
    def rewind(self, n_tokens: int) -> SessionInfo:
        return self.client._unary(ops.rewind(self.session_id, n_tokens))

    @described_by(ops.checkpoint)
    def checkpoint(self, label: str | None = None) -> CheckpointInfo:
        return self.client._unary(ops.checkpoint(self.session_id, label))

    @described_by(ops.CHECKPOINTS)
    def checkpoints(self) -> list[CheckpointInfo]:
        return self.client.list_checkpoints(self.session_id)

    @described_by(ops.restore)
    def restore(self, checkpoint_id: str) -> SessionInfo:
        return self.client._unary(ops.restore(self.session_id, checkpoint_id))

    @described_by(ops.fork)
    def fork(self, checkpoint_id: str | None = None, *, persistent: bool = False) -> Session:
        return Session(self.client, self.client._unary(ops.fork(self.session_id, checkpoint_id, persistent)))
