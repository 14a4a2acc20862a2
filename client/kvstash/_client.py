"""The blocking client: Client, and Session for calls about one session."""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

import grpc

from kvstash._connection import Tls, auth_metadata, channel, resolve_address
from kvstash._convert import (
    chat_request,
    checkpoint_info_from_pb,
    chunk_from_pb,
    create_session_request,
    generate_request,
    info_from_pb,
    join_chunks,
    session_info_from_pb,
)
from kvstash._errors import from_rpc_error
from kvstash._files import CHUNK_BYTES, PathOrFile, open_destination, open_source
from kvstash._types import CheckpointInfo, Chunk, Completion, Info, Message, SamplingParams, SessionInfo
from kvstash.v1 import kvstash_pb2 as pb
from kvstash.v1 import kvstash_pb2_grpc as pb_grpc

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_T = TypeVar("_T")


class Client:
    """A blocking connection to a kvstash daemon.

    Example::

        from kvstash import Client

        with Client("127.0.0.1:50051") as client:
            session = client.create_session("You are a terse assistant.")
            print(session.chat("Name three primes.").text)
            for chunk in session.chat_stream("And three more?"):
                print(chunk.text, end="", flush=True)
            session.close()

    ``address`` is a gRPC target, ``host:port`` or ``unix:/path/to/socket``; None means
    ``$KVSTASH_ADDRESS``, else ``127.0.0.1:50051``. ``timeout`` bounds, in seconds, each call
    that returns one answer; streamed calls (generation, export, import) take as long as they
    need. Making a client does not connect: the first call does, and calls fail at once with
    UnavailableError while the daemon is down. Every failed call raises a KvstashError.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float | None = None,
        token: str | None = None,
        tls: Tls | None = None,
    ) -> None:
        self.address = resolve_address(address)
        self.timeout = timeout
        self._metadata = auth_metadata(token)
        self._channel = channel(self.address, tls)
        self._stub = pb_grpc.KvStashStub(self._channel)

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

    def _unary(self, rpc: grpc.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req) -> _Resp:
        try:
            return rpc(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def _stream(
        self,
        rpc: grpc.UnaryStreamMultiCallable[_Req, _Resp],
        request: _Req,
        convert: Callable[[_Resp], _T],
    ) -> Generator[_T, None, None]:
        call = rpc(request, metadata=self._metadata)
        try:
            for response in call:
                yield convert(response)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            # The consumer may stop early (break, an exception, Ctrl-C): stop the daemon's work.
            call.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leave cancel() untyped

    def info(self) -> Info:
        """What the daemon runs: model, engine mode, limits and counters."""
        return info_from_pb(self._unary(self._stub.GetInfo, pb.GetInfoRequest()))

    def create_session(
        self,
        system_prompt: str = "",
        *,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        persistent: bool = False,
        cache_salt: str | bytes | None = None,
        context_policy: str = "error",
    ) -> Session:
        """Open a session; ``sampling`` and ``stop`` become its defaults for every request.

        A persistent session survives a daemon restart. Prompt prefixes are computed once
        per tenant; ``cache_salt`` (16+ bytes, hard to guess) shares them instead with
        whoever presents the same salt. ``context_policy`` says what a chat turn that does
        not fit the context does: ``"error"`` raises ContextFullError, ``"truncate"`` drops
        the oldest whole turns (the system prompt stays) to make room for it and its reply.
        """
        request = create_session_request(
            system_prompt, sampling, stop, persistent, cache_salt, context_policy
        )
        response = self._unary(self._stub.CreateSession, request)
        return Session(self, response.session.session_id)

    def session(self, session_id: str) -> Session:
        """The session ``session_id``; raises NotFoundError when there is none."""
        request = pb.GetSessionRequest(session_id=session_id)
        response = self._unary(self._stub.GetSession, request)
        return Session(self, response.session.session_id)

    def list_sessions(self) -> list[SessionInfo]:
        """Every session of the caller's (its tenant's)."""
        response = self._unary(self._stub.ListSessions, pb.ListSessionsRequest())
        return [session_info_from_pb(s) for s in response.sessions]

    def fork_session(
        self,
        session_id: str | None = None,
        checkpoint_id: str | None = None,
        *,
        persistent: bool = False,
    ) -> Session:
        """A new session copied from a session's current state or from a checkpoint."""
        request = pb.ForkSessionRequest(
            session_id=session_id or "", checkpoint_id=checkpoint_id or "", persistent=persistent
        )
        response = self._unary(self._stub.ForkSession, request)
        return Session(self, response.session.session_id)

    def list_checkpoints(self, session_id: str | None = None) -> list[CheckpointInfo]:
        """The checkpoints of a session; with none, all of the caller's (imports too)."""
        request = pb.ListCheckpointsRequest(session_id=session_id or "")
        response = self._unary(self._stub.ListCheckpoints, request)
        return [checkpoint_info_from_pb(c) for c in response.checkpoints]

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        """Delete a checkpoint; blocks that other checkpoints share are kept."""
        request = pb.DeleteCheckpointRequest(checkpoint_id=checkpoint_id)
        self._unary(self._stub.DeleteCheckpoint, request)

    def export_checkpoint(self, checkpoint_id: str, path_or_file: PathOrFile) -> int:
        """Write a checkpoint as one self-contained file; returns the bytes written.

        A path is replaced only once the whole checkpoint has arrived.
        """
        request = pb.ExportCheckpointRequest(checkpoint_id=checkpoint_id)
        written = 0
        with open_destination(path_or_file) as f:
            for data in self._stream(self._stub.ExportCheckpoint, request, _data):
                f.write(data)
                written += len(data)
        return written

    def import_checkpoint(self, path_or_file: PathOrFile) -> CheckpointInfo:
        """Load an exported checkpoint into the daemon's store."""
        with open_source(path_or_file) as f:
            requests = (
                pb.ImportCheckpointRequest(data=data) for data in iter(partial(f.read, CHUNK_BYTES), b"")
            )
            try:
                response = self._stub.ImportCheckpoint(requests, metadata=self._metadata)
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
        return checkpoint_info_from_pb(response.checkpoint)


def _data(response: pb.ExportCheckpointResponse) -> bytes:
    return response.data


class Session:
    """One session of a daemon, reached through ``client``.

    Get one from Client.create_session, Client.session or Client.fork_session.
    """

    def __init__(self, client: Client, session_id: str) -> None:
        self.client = client
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"Session({self.session_id!r})"

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
    ) -> Generator[Chunk, None, None]:
        """Append ``prompt`` (text, or token ids) to the session and stream what follows.

        An empty prompt continues from where the session stopped. ``stop`` adds to the
        session's stop strings and ``sampling`` overrides its parameters, for this request
        only. ``logprobs`` asks for that many alternatives per token. Control-token markers in
        the text are parsed only with ``parse_special``. The call starts on the first
        ``next()``; stopping the iteration early cancels it.

        Structured output: ``grammar`` (GBNF text) or ``json_schema`` (a dict or JSON text)
        makes the output match it. Output cut short (``max_tokens``, a stop string) leaves the
        constraint open: calling generate again with an empty prompt continues within it.
        """
        request = generate_request(
            self.session_id,
            prompt,
            max_tokens=max_tokens,
            stop=stop,
            sampling=sampling,
            logprobs=logprobs,
            grammar=grammar,
            json_schema=json_schema,
            parse_special=parse_special,
        )
        return self.client._stream(self.client._stub.Generate, request, _generate_chunk)

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
    ) -> Completion:
        """Like generate, but waits for the whole continuation."""
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
            )
        )

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
    ) -> Generator[Chunk, None, None]:
        """Send a user message through the model's chat template and stream the reply.

        ``message`` may instead be a sequence of Message of any roles, added in order before
        the reply. With ``whole``, that sequence is the whole conversation: the session keeps
        the part of its history that matches it, token for token, and evaluates only the
        rest (an edited or shortened conversation rewinds the session). The other arguments
        work as in generate.
        """
        request = chat_request(
            self.session_id,
            message,
            max_tokens=max_tokens,
            stop=stop,
            sampling=sampling,
            logprobs=logprobs,
            grammar=grammar,
            json_schema=json_schema,
            whole=whole,
        )
        return self.client._stream(self.client._stub.Chat, request, _chat_chunk)

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
    ) -> Completion:
        """Like chat_stream, but waits for the whole reply."""
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
            )
        )

    def info(self) -> SessionInfo:
        """The session's current state."""
        request = pb.GetSessionRequest(session_id=self.session_id)
        response = self.client._unary(self.client._stub.GetSession, request)
        return session_info_from_pb(response.session)

    def close(self) -> None:
        """End the session: its history, head and checkpoints are deleted (export first to keep one)."""
        request = pb.CloseSessionRequest(session_id=self.session_id)
        self.client._unary(self.client._stub.CloseSession, request)

    def rewind(self, n_tokens: int) -> SessionInfo:
        """Keep only the first ``n_tokens`` tokens of the session's history."""
        request = pb.RewindRequest(session_id=self.session_id, n_tokens=n_tokens)
        return session_info_from_pb(self.client._unary(self.client._stub.Rewind, request).session)

    def checkpoint(self, label: str | None = None) -> CheckpointInfo:
        """Save the session's current state."""
        request = pb.CheckpointRequest(session_id=self.session_id, label=label or "")
        response = self.client._unary(self.client._stub.Checkpoint, request)
        return checkpoint_info_from_pb(response.checkpoint)

    def checkpoints(self) -> list[CheckpointInfo]:
        """The session's checkpoints."""
        return self.client.list_checkpoints(self.session_id)

    def restore(self, checkpoint_id: str) -> SessionInfo:
        """Put the session back in the state a checkpoint saved."""
        request = pb.RestoreCheckpointRequest(session_id=self.session_id, checkpoint_id=checkpoint_id)
        response = self.client._unary(self.client._stub.RestoreCheckpoint, request)
        return session_info_from_pb(response.session)

    def fork(self, checkpoint_id: str | None = None, *, persistent: bool = False) -> Session:
        """A new session copied from this one's current state, or from ``checkpoint_id``."""
        if checkpoint_id is not None:
            return self.client.fork_session(checkpoint_id=checkpoint_id, persistent=persistent)
        return self.client.fork_session(self.session_id, persistent=persistent)


def _generate_chunk(response: pb.GenerateResponse) -> Chunk:
    return chunk_from_pb(response.chunk)


def _chat_chunk(response: pb.ChatResponse) -> Chunk:
    return chunk_from_pb(response.chunk)
