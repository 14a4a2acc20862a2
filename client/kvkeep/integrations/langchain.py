"""LangChain on kvkeep sessions (`pip install 'kvkeep[langchain]'`).

- `ChatKvkeep`, a chat model whose conversation lives in a kvkeep session: each call sends
  only the messages the session does not hold yet, so the history is neither sent again nor
  evaluated again.
- `KvkeepChatMessageHistory`, a chat-message history kept in a persistent session: it
  survives daemon restarts, and its conversation is already evaluated when a model goes on
  with it.

Example::

    from kvkeep.integrations.langchain import ChatKvkeep
    from langchain_core.messages import HumanMessage, SystemMessage

    chat = ChatKvkeep(temperature=0)
    history = [SystemMessage("You are terse."), HumanMessage("Name three primes.")]
    history.append(chat.invoke(history))
    history.append(HumanMessage("And three more?"))
    for chunk in chat.stream(history):         # sends only the new message
        print(chunk.content, end="", flush=True)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.chat_history import BaseChatMessageHistory
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr

from kvkeep._async_client import AsyncClient, AsyncSession
from kvkeep._client import Client, Session
from kvkeep._connection import Tls
from kvkeep._types import Chunk, Message, SamplingParams, Usage

__all__ = ["ChatKvkeep", "KvkeepChatMessageHistory", "from_langchain", "to_langchain"]


def from_langchain(message: BaseMessage) -> Message:
    """A LangChain message as a kvkeep Message; ValueError for roles a chat template lacks."""
    if isinstance(message, SystemMessage):
        role = "system"
    elif isinstance(message, HumanMessage):
        role = "user"
    elif isinstance(message, AIMessage):
        role = "assistant"
    elif isinstance(message, ChatMessage) and message.role in ("system", "user", "assistant"):
        role = message.role
    else:
        raise ValueError(f"kvkeep sessions hold system, human and AI messages, not {message.type!r}")
    if message.tool_calls if isinstance(message, AIMessage) else False:
        raise ValueError("kvkeep sessions do not hold tool calls")
    return Message(role, message.text if not isinstance(message.content, str) else message.content)


def to_langchain(message: Message) -> BaseMessage:
    """A kvkeep Message as a LangChain message."""
    if message.role == "system":
        return SystemMessage(message.content)
    if message.role == "user":
        return HumanMessage(message.content)
    if message.role == "assistant":
        return AIMessage(message.content)
    return ChatMessage(content=message.content, role=message.role)


def _usage(u: Usage) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=u.prompt_tokens,
        output_tokens=u.generated_tokens,
        total_tokens=u.prompt_tokens + u.generated_tokens,
        input_token_details={"cache_read": u.reused_tokens},
    )


class ChatKvkeep(BaseChatModel):
    """A LangChain chat model whose conversation lives in one kvkeep session.

    The first call opens a session (its system prompt is the conversation's leading system
    message; ``persistent=True`` keeps it across daemon restarts) and later calls continue
    it: when the messages a call is given extend what the session holds, only the new ones
    are sent, and only they are evaluated. When they do not (an edited or shortened
    conversation, another conversation altogether), the whole conversation is sent and the
    session rewinds to the longest part of its history that matches it, token for token,
    and evaluates the rest. Either way the reply is the one a fresh session given the whole
    conversation would give.

    Pass ``session_id`` to go on with an existing session; the session in use is
    ``chat.session_id``. One instance holds one conversation at a time: calls on it are
    serialised, and the session should not be used by anyone else meanwhile (its history
    would no longer be the one this object knows; the next call would rewind to what
    matches, or append to a history it does not know). Streaming, stop strings and asyncio
    (through ``kvkeep.AsyncClient``) are supported; tool calls are not. ``close()`` and
    ``aclose()`` close its connections; the session stays on the daemon.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    address: str | None = None
    """The daemon's gRPC address; None: ``$KVKEEP_ADDRESS``, else ``127.0.0.1:50051``."""
    token: str | None = Field(default=None, repr=False)
    """Bearer token of a daemon with tenants; None: ``$KVKEEP_TOKEN``."""
    tls: Tls | None = None
    timeout: float | None = 60.0
    """Seconds for each call that returns one answer (streams take as long as they need)."""
    session_id: str | None = None
    persistent: bool = False
    max_tokens: int | None = None
    stop: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    # What the session holds, as far as this object knows (None: ask the daemon).
    _held: list[Message] | None = PrivateAttr(default=None)
    _client: Client | None = PrivateAttr(default=None)
    _aclient: AsyncClient | None = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _alock: asyncio.Lock | None = PrivateAttr(default=None)

    @property
    def _llm_type(self) -> str:
        return "kvkeep"

    def close(self) -> None:
        """Close the blocking connection; the session stays on the daemon."""
        if self._client is not None:
            self._client.close()
            self._client = None

    async def aclose(self) -> None:
        """Close the asyncio connection; the session stays on the daemon."""
        if self._aclient is not None:
            await self._aclient.close()
            self._aclient = None

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"address": self.address, "session_id": self.session_id, **self._sampling_dict()}

    def _sampling_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}

    def _turn(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        sampling = {**self._sampling_dict(), **{k: kwargs[k] for k in self._sampling_dict() if k in kwargs}}
        return {
            "max_tokens": kwargs.get("max_tokens", self.max_tokens),
            "stop": [*(self.stop or ()), *(stop or ())],
            "sampling": SamplingParams(**sampling),
        }

    def _plan(self, messages: Sequence[Message]) -> tuple[list[Message], bool]:
        """What to send and whether it is the whole conversation."""
        held = self._held or []
        n = len(held)
        if self._held is not None and list(messages[:n]) == held and len(messages) > n:
            return list(messages[n:]), False
        return list(messages), True

    def _split_system(self, messages: list[Message]) -> tuple[str, list[Message]]:
        if messages and messages[0].role == "system" and messages[0].content and len(messages) > 1:
            return messages[0].content, messages[1:]
        return "", messages

    def _finish(self, messages: Sequence[Message], reply: str) -> None:
        self._held = [*messages, Message("assistant", reply)]

    def _result(self, text: str, last: Chunk) -> ChatResult:
        assert last.usage is not None
        metadata = {"finish_reason": last.finish_reason, "session_id": self.session_id}
        message = AIMessage(content=text, usage_metadata=_usage(last.usage), response_metadata=metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])

    # ---- blocking ----------------------------------------------------------------------------

    def _session(self, messages: list[Message]) -> tuple[Session, list[Message], bool]:
        """The session, the messages to send, and whether they are the whole conversation."""
        if self._client is None:
            self._client = Client(self.address, timeout=self.timeout, token=self.token, tls=self.tls)
        if self.session_id is None:
            system, rest = self._split_system(messages)
            session = self._client.create_session(system, persistent=self.persistent)
            self.session_id = session.session_id
            self._held = [Message("system", system)] if system else []
            return session, rest, False
        session = Session(self._client, self.session_id)
        if self._held is None:
            self._held = list(session.info().messages)
        send, whole = self._plan(messages)
        return session, send, whole

    def _chunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[Chunk]:
        conversation = [from_langchain(m) for m in messages]
        with self._lock:
            session, send, whole = self._session(conversation)
            self._held, text = None, ""  # unknown until the reply is complete
            for chunk in session.chat_stream(send, whole=whole, **self._turn(stop, kwargs)):
                text += chunk.text
                if chunk.finish_reason is not None:
                    self._finish(conversation, text)
                yield chunk

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = list(self._chunks(messages, stop, kwargs))
        return self._result("".join(c.text for c in chunks), chunks[-1])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._chunks(messages, stop, kwargs):
            out = self._generation_chunk(chunk)
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=out)
            yield out

    def _generation_chunk(self, chunk: Chunk) -> ChatGenerationChunk:
        if chunk.finish_reason is None or chunk.usage is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=chunk.text))
        metadata = {"finish_reason": chunk.finish_reason, "session_id": self.session_id}
        message = AIMessageChunk(
            content=chunk.text, usage_metadata=_usage(chunk.usage), response_metadata=metadata
        )
        return ChatGenerationChunk(message=message)

    # ---- asyncio -----------------------------------------------------------------------------

    async def _asession(self, messages: list[Message]) -> tuple[AsyncSession, list[Message], bool]:
        if self._aclient is None:
            self._aclient = AsyncClient(self.address, timeout=self.timeout, token=self.token, tls=self.tls)
        if self.session_id is None:
            system, rest = self._split_system(messages)
            session = await self._aclient.create_session(system, persistent=self.persistent)
            self.session_id = session.session_id
            self._held = [Message("system", system)] if system else []
            return session, rest, False
        session = AsyncSession(self._aclient, self.session_id)
        if self._held is None:
            self._held = list((await session.info()).messages)
        send, whole = self._plan(messages)
        return session, send, whole

    async def _achunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> AsyncIterator[Chunk]:
        conversation = [from_langchain(m) for m in messages]
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            session, send, whole = await self._asession(conversation)
            self._held, text = None, ""
            async for chunk in session.chat_stream(send, whole=whole, **self._turn(stop, kwargs)):
                text += chunk.text
                if chunk.finish_reason is not None:
                    self._finish(conversation, text)
                yield chunk

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = [c async for c in self._achunks(messages, stop, kwargs)]
        return self._result("".join(c.text for c in chunks), chunks[-1])

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in self._achunks(messages, stop, kwargs):
            out = self._generation_chunk(chunk)
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=out)
            yield out


class KvkeepChatMessageHistory(BaseChatMessageHistory):
    """A chat-message history kept in a persistent kvkeep session.

    With no ``session_id`` a new persistent session is made (keep ``history.session_id`` to
    find it again, after a daemon restart too). Messages added are evaluated as they come
    (so a model that goes on with the conversation finds it computed: ``ChatKvkeep`` in the
    same tenant attaches its blocks from the prefix cache); to record them, the daemon draws
    one token after them and takes it back. ``clear`` empties the session and keeps it.
    """

    def __init__(
        self,
        session_id: str | None = None,
        *,
        client: Client | None = None,
        address: str | None = None,
        token: str | None = None,
        tls: Tls | None = None,
        timeout: float | None = 60.0,
    ) -> None:
        super().__init__()
        self.client = client or Client(address, timeout=timeout, token=token, tls=tls)
        if session_id is None:
            self.session = self.client.create_session(persistent=True)
        else:
            self.session = self.client.session(session_id)
        self.session_id = self.session.session_id

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        """The session's messages, from the daemon."""
        return [to_langchain(m) for m in self.session.info().messages]

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        """Append messages to the session (system, human and AI messages only)."""
        if not messages:
            return
        converted = [from_langchain(m) for m in messages]
        # A turn always ends in a reply: draw one token, then rewind to the end of the prompt
        # (the reply's message begins there, so it goes too).
        drawn = self.session.chat(converted, max_tokens=1)
        self.session.rewind(self.session.info().n_tokens - drawn.usage.generated_tokens)

    def clear(self) -> None:
        """Forget every message; the session stays, empty."""
        self.session.rewind(0)
