"""The asyncio client: AsyncClient and AsyncSession, the grpc.aio twins of Client and Session.

Each method awaits the same operation of _operations as its blocking twin calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, BinaryIO, TypeVar

import grpc

from kvkeep import _operations as ops
from kvkeep._connection import Tls, aio_channel, auth_metadata, call_metadata, resolve_address
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
from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeep.v1 import kvkeep_pb2_grpc as pb_grpc

_T = TypeVar("_T")


class AsyncClient:
    """An asyncio connection to a kvkeep daemon; make it inside a running event loop.

    Example::

        import asyncio
        from kvkeep import AsyncClient

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
        retry: Retry | None = DEFAULT_RETRY,
    ) -> None:
        self.address = resolve_address(address)
        self.timeout = timeout
        self.retry = retry
        # Whether a call was ever answered: until one is, nothing may be listening at the
        # address, and a lost connection is raised at once instead of tried again.
        self._reached = False
        self._metadata = auth_metadata(token)
        self._channel = aio_channel(self.address, tls)
        self._stub = pb_grpc.KvKeepStub(self._channel)

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

    async def _unary(self, op: ops.Unary[_T]) -> _T:
        rpc = getattr(self._stub, op.method)
        metadata = call_metadata(self._metadata, op.session_id)
        attempts = Attempts(self.retry, op.resend and self._reached)
        while True:
            try:
                response = await rpc(op.request, timeout=self.timeout, metadata=metadata)
            except grpc.RpcError as e:
                error = from_rpc_error(e)
                pause = attempts.pause(error)
                if pause is None:
                    raise error from None
                await asyncio.sleep(pause)
                continue
            self._reached = True
            return op.convert(response)

    async def _stream(self, op: ops.Stream[_T]) -> AsyncGenerator[_T, None]:
        metadata = call_metadata(self._metadata, op.session_id)
        attempts = Attempts(self.retry, op.resend and self._reached)
        while True:
            call = getattr(self._stub, op.method)(op.request, metadata=metadata)
            answered = False
            try:
                async for response in call:
                    answered = self._reached = True
                    if op.aside is not None and op.aside(response):
                        continue
                    yield op.convert(response)
                return
            except grpc.RpcError as e:
                error = from_rpc_error(e)
                # Sent again only while nothing of it was answered (see Client).
                pause = attempts.pause(error, answered=answered)
                if pause is None:
                    raise error from None
            finally:
                # The consumer may stop early or be cancelled: stop the daemon's work.
                call.cancel()
            await asyncio.sleep(pause)

    @described_by(ops.info)
    async def info(self) -> Info:
        return await self._unary(ops.info())

    @described_by(ops.create_session)
    async def create_session(
        self,
        system_prompt: str = "",
        *,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        persistent: bool = False,
        cache_salt: str | bytes | None = None,
        context_policy: str = "error",
        tools: Sequence[Tool] = (),
    ) -> AsyncSession:
        op = ops.create_session(system_prompt, sampling, stop, persistent, cache_salt, context_policy, tools)
        return AsyncSession(self, await self._unary(op))

    @described_by(ops.session)
    async def session(self, session_id: str) -> AsyncSession:
        return AsyncSession(self, await self._unary(ops.session(session_id)))

    @described_by(ops.list_sessions)
    async def list_sessions(self) -> list[SessionInfo]:
        return await self._unary(ops.list_sessions())

    @described_by(ops.fork_session)
    async def fork_session(
        self,
        session_id: str | None = None,
        checkpoint_id: str | None = None,
        *,
        persistent: bool = False,
    ) -> AsyncSession:
        return AsyncSession(self, await self._unary(ops.fork_session(session_id, checkpoint_id, persistent)))

    @described_by(ops.list_checkpoints)
    async def list_checkpoints(self, session_id: str | None = None) -> list[CheckpointInfo]:
        return await self._unary(ops.list_checkpoints(session_id))

    @described_by(ops.delete_checkpoint)
    async def delete_checkpoint(self, checkpoint_id: str) -> None:
        await self._unary(ops.delete_checkpoint(checkpoint_id))

    @described_by(ops.list_responses)
    async def list_responses(
        self, *, limit: int = 20, after: str | None = None, order: str = "desc"
    ) -> ResponsePage:
        return await self._unary(ops.list_responses(limit, after, order))

    @described_by(ops.delete_response)
    async def delete_response(self, response_id: str) -> None:
        await self._unary(ops.delete_response(response_id))

    @described_by(ops.export_checkpoint)
    async def export_checkpoint(self, checkpoint_id: str, path_or_file: PathOrFile) -> int:
        written = 0
        with open_destination(path_or_file) as f:
            async for data in self._stream(ops.export_checkpoint(checkpoint_id)):
                # File writes may block on slow disks; keep them off the event loop.
                await asyncio.to_thread(f.write, data)
                written += len(data)
        return written

    @described_by(ops.IMPORT_CHECKPOINT)
    async def import_checkpoint(self, path_or_file: PathOrFile) -> CheckpointInfo:
        with open_source(path_or_file) as f:
            try:
                rpc = getattr(self._stub, ops.IMPORT_METHOD)
                response = await rpc(_read_requests(f), metadata=self._metadata)
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
        return ops.imported(response)


async def _read_requests(f: BinaryIO) -> AsyncIterator[pb.ImportCheckpointRequest]:
    # File reads may block too.
    while data := await asyncio.to_thread(f.read, CHUNK_BYTES):
        yield ops.import_request(data)


async def _join(stream: AsyncGenerator[Chunk, None]) -> Completion:
    async with contextlib.aclosing(stream):
        return join_chunks([chunk async for chunk in stream])


class AsyncSession:
    """One session of a daemon, reached through ``client``; see Session."""

    def __init__(self, client: AsyncClient, session_id: str) -> None:
        self.client = client
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"AsyncSession({self.session_id!r})"

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
    ) -> AsyncGenerator[Chunk, None]:
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
        on_progress: ops.OnProgress | None = None,
    ) -> Completion:
        stream = self.generate(
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
        return await _join(stream)

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
    ) -> AsyncGenerator[Chunk, None]:
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
        tools: Sequence[Tool] | None = None,
        tool_choice: str | Tool | None = None,
        parallel_tool_calls: bool | None = None,
        on_progress: ops.OnProgress | None = None,
    ) -> Completion:
        stream = self.chat_stream(
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
        return await _join(stream)

    @described_by(ops.session_info)
    async def info(self) -> SessionInfo:
        return await self.client._unary(ops.session_info(self.session_id))

    @described_by(ops.close_session)
    async def close(self) -> None:
        await self.client._unary(ops.close_session(self.session_id))

    @described_by(ops.rewind)
    async def rewind(self, n_tokens: int) -> SessionInfo:
        return await self.client._unary(ops.rewind(self.session_id, n_tokens))

    @described_by(ops.checkpoint)
    async def checkpoint(self, label: str | None = None) -> CheckpointInfo:
        return await self.client._unary(ops.checkpoint(self.session_id, label))

    @described_by(ops.CHECKPOINTS)
    async def checkpoints(self) -> list[CheckpointInfo]:
        return await self.client.list_checkpoints(self.session_id)

    @described_by(ops.restore)
    async def restore(self, checkpoint_id: str) -> SessionInfo:
        return await self.client._unary(ops.restore(self.session_id, checkpoint_id))

    @described_by(ops.fork)
    async def fork(self, checkpoint_id: str | None = None, *, persistent: bool = False) -> AsyncSession:
        op = ops.fork(self.session_id, checkpoint_id, persistent)
        return AsyncSession(self.client, await self.client._unary(op))
