"""The asyncio client: AsyncClient and AsyncSession, the grpc.aio twins of Client and Session."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, BinaryIO, TypeVar

import grpc
from grpc import aio

from kvstash._connection import Tls, aio_channel, auth_metadata, resolve_address
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


class AsyncClient:
    """An asyncio connection to a kvstash daemon; make it inside a running event loop.

        Example::

            import asyncio
    import contextlib
            from kvstash import AsyncClient

            async def main() -> None:
                async with AsyncClient("127.0.0.1:50051") as client:
                    session = await client.create_session("You are a terse assistant.")
                    async for chunk in session.chat_stream("Name three primes."):
                        print(chunk.text, end="", flush=True)
                    await session.close()

            asyncio.run(main())

        Arguments, methods and errors are those of Client, as coroutines; the streaming
        methods are async generators. Leaving one early cancels its call once the generator is
        closed: wrap it in ``contextlib.aclosing`` to have that happen at once.
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
        self._channel = aio_channel(self.address, tls)
        self._stub = pb_grpc.KvStashStub(self._channel)

    def __repr__(self) -> str:
        return f"AsyncClient({self.address!r})"

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; calls in flight are cancelled."""
        await self._channel.close(None)

    async def _unary(self, rpc: aio.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req) -> _Resp:
        try:
            return await rpc(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def _stream(
        self,
        rpc: aio.UnaryStreamMultiCallable[_Req, _Resp],
        request: _Req,
        convert: Callable[[_Resp], _T],
    ) -> AsyncGenerator[_T, None]:
        call = rpc(request, metadata=self._metadata)
        try:
            async for response in call:
                yield convert(response)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            # The consumer may stop early or be cancelled: stop the daemon's work.
            call.cancel()

    async def info(self) -> Info:
        """What the daemon runs: model, engine mode, limits and counters."""
        return info_from_pb(await self._unary(self._stub.GetInfo, pb.GetInfoRequest()))

    async def create_session(
        self,
        system_prompt: str = "",
        *,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        persistent: bool = False,
        cache_salt: str | bytes | None = None,
        context_policy: str = "error",
    ) -> AsyncSession:
        """Open a session; see Client.create_session."""
        request = create_session_request(
            system_prompt, sampling, stop, persistent, cache_salt, context_policy
        )
        response = await self._unary(self._stub.CreateSession, request)
        return AsyncSession(self, response.session.session_id)

    async def session(self, session_id: str) -> AsyncSession:
        """The session ``session_id``; raises NotFoundError when there is none."""
        request = pb.GetSessionRequest(session_id=session_id)
        response = await self._unary(self._stub.GetSession, request)
        return AsyncSession(self, response.session.session_id)

    async def list_sessions(self) -> list[SessionInfo]:
        """Every session the daemon holds."""
        response = await self._unary(self._stub.ListSessions, pb.ListSessionsRequest())
        return [session_info_from_pb(s) for s in response.sessions]

    async def fork_session(
        self,
        session_id: str | None = None,
        checkpoint_id: str | None = None,
        *,
        persistent: bool = False,
    ) -> AsyncSession:
        """A new session copied from a session's current state or from a checkpoint."""
        request = pb.ForkSessionRequest(
            session_id=session_id or "", checkpoint_id=checkpoint_id or "", persistent=persistent
        )
        response = await self._unary(self._stub.ForkSession, request)
        return AsyncSession(self, response.session.session_id)

    async def list_checkpoints(self, session_id: str | None = None) -> list[CheckpointInfo]:
        """The checkpoints of a session; with none, all of the caller's (imports too)."""
        request = pb.ListCheckpointsRequest(session_id=session_id or "")
        response = await self._unary(self._stub.ListCheckpoints, request)
        return [checkpoint_info_from_pb(c) for c in response.checkpoints]

    async def delete_checkpoint(self, checkpoint_id: str) -> None:
        """Delete a checkpoint; blocks that other checkpoints share are kept."""
        request = pb.DeleteCheckpointRequest(checkpoint_id=checkpoint_id)
        await self._unary(self._stub.DeleteCheckpoint, request)

    async def export_checkpoint(self, checkpoint_id: str, path_or_file: PathOrFile) -> int:
        """Write a checkpoint as one self-contained file; see Client.export_checkpoint."""
        request = pb.ExportCheckpointRequest(checkpoint_id=checkpoint_id)
        written = 0
        with open_destination(path_or_file) as f:
            async for data in self._stream(self._stub.ExportCheckpoint, request, _data):
                # File writes may block on slow disks; keep them off the event loop.
                await asyncio.to_thread(f.write, data)
                written += len(data)
        return written

    async def import_checkpoint(self, path_or_file: PathOrFile) -> CheckpointInfo:
        """Load an exported checkpoint into the daemon's store."""
        with open_source(path_or_file) as f:
            try:
                response = await self._stub.ImportCheckpoint(_read_requests(f), metadata=self._metadata)
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
        return checkpoint_info_from_pb(response.checkpoint)


async def _read_requests(f: BinaryIO) -> AsyncIterator[pb.ImportCheckpointRequest]:
    while data := await asyncio.to_thread(f.read, CHUNK_BYTES):
        yield pb.ImportCheckpointRequest(data=data)


async def _join(stream: AsyncGenerator[Chunk, None]) -> Completion:
    async with contextlib.aclosing(stream):
        return join_chunks([chunk async for chunk in stream])


def _data(response: pb.ExportCheckpointResponse) -> bytes:
    return response.data


class AsyncSession:
    """One session of a daemon, reached through ``client``; see Session."""

    def __init__(self, client: AsyncClient, session_id: str) -> None:
        self.client = client
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"AsyncSession({self.session_id!r})"

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
    ) -> AsyncGenerator[Chunk, None]:
        """Append ``prompt`` to the session and stream what follows; see Session.generate."""
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

    async def complete(
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
        stream = self.generate(
            prompt,
            max_tokens=max_tokens,
            stop=stop,
            sampling=sampling,
            logprobs=logprobs,
            grammar=grammar,
            json_schema=json_schema,
            parse_special=parse_special,
        )
        return await _join(stream)

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
    ) -> AsyncGenerator[Chunk, None]:
        """Send a user message through the chat template and stream the reply; ``message``
        and ``whole`` work as in Session.chat_stream."""
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

    async def chat(
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
        stream = self.chat_stream(
            message,
            max_tokens=max_tokens,
            stop=stop,
            sampling=sampling,
            logprobs=logprobs,
            grammar=grammar,
            json_schema=json_schema,
            whole=whole,
        )
        return await _join(stream)

    async def info(self) -> SessionInfo:
        """The session's current state."""
        request = pb.GetSessionRequest(session_id=self.session_id)
        response = await self.client._unary(self.client._stub.GetSession, request)
        return session_info_from_pb(response.session)

    async def close(self) -> None:
        """End the session: its history, head and checkpoints are deleted (export first to keep one)."""
        request = pb.CloseSessionRequest(session_id=self.session_id)
        await self.client._unary(self.client._stub.CloseSession, request)

    async def rewind(self, n_tokens: int) -> SessionInfo:
        """Keep only the first ``n_tokens`` tokens of the session's history."""
        request = pb.RewindRequest(session_id=self.session_id, n_tokens=n_tokens)
        response = await self.client._unary(self.client._stub.Rewind, request)
        return session_info_from_pb(response.session)

    async def checkpoint(self, label: str | None = None) -> CheckpointInfo:
        """Save the session's current state."""
        request = pb.CheckpointRequest(session_id=self.session_id, label=label or "")
        response = await self.client._unary(self.client._stub.Checkpoint, request)
        return checkpoint_info_from_pb(response.checkpoint)

    async def checkpoints(self) -> list[CheckpointInfo]:
        """The session's checkpoints."""
        return await self.client.list_checkpoints(self.session_id)

    async def restore(self, checkpoint_id: str) -> SessionInfo:
        """Put the session back in the state a checkpoint saved."""
        request = pb.RestoreCheckpointRequest(session_id=self.session_id, checkpoint_id=checkpoint_id)
        response = await self.client._unary(self.client._stub.RestoreCheckpoint, request)
        return session_info_from_pb(response.session)

    async def fork(self, checkpoint_id: str | None = None, *, persistent: bool = False) -> AsyncSession:
        """A new session copied from this one's current state, or from ``checkpoint_id``."""
        if checkpoint_id is not None:
            return await self.client.fork_session(checkpoint_id=checkpoint_id, persistent=persistent)
        return await self.client.fork_session(self.session_id, persistent=persistent)


def _generate_chunk(response: pb.GenerateResponse) -> Chunk:
    return chunk_from_pb(response.chunk)


def _chat_chunk(response: pb.ChatResponse) -> Chunk:
    return chunk_from_pb(response.chunk)
