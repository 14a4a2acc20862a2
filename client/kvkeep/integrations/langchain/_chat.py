"""ChatKvkeep: a LangChain chat model whose conversation lives in one kvkeep session."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LangSmithParams, LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr

from kvkeep._async_client import AsyncClient, AsyncSession
from kvkeep._client import Client, Session
from kvkeep._connection import Tls
from kvkeep._convert import join_calls
from kvkeep._types import Chunk, Info, Message, SamplingParams, ToolCall, ToolCallDelta
from kvkeep.integrations.langchain._messages import (
    ai_chunk,
    ai_message,
    from_langchain,
    kvkeep_tools,
    tool_choice,
)

#: The keywords a call takes (bound or given to invoke); any other is refused, not dropped.
CALL_KEYWORDS = frozenset(
    {
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "strict",
        "response_format",
        "json_schema",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "model",
    }
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

    Tools: ``bind_tools`` (any tool LangChain takes; ``tool_choice`` "auto", "none", "any" or
    "required", or a tool's name) and ``with_structured_output`` (by tool call, or by JSON
    schema or JSON mode: ``method="json_schema"``/``"json_mode"``). The model calls tools in
    its own syntax, every call held to its tool's schema; replies carry ``tool_calls`` (a
    call cut short by ``max_tokens`` as an invalid tool call) and streams
    ``tool_call_chunks``. Tool results go back as ToolMessages. A call's
    ``response_format`` (OpenAI's ``{"type": "json_schema", "json_schema": {"schema": ...}}``,
    ``{"type": "json_object"}``, ``{"type": "text"}``, or a Pydantic class or TypedDict), as
    LangChain's agents bind it, holds a reply that is not a call to its schema; with tools,
    the reply is either calls or that answer.

    A call takes these keywords besides ``stop``: ``tools``, ``tool_choice``,
    ``parallel_tool_calls``, ``strict`` (calls are always held to their schemas),
    ``response_format``, ``json_schema``, ``max_tokens``, ``temperature``, ``top_p``,
    ``top_k``, ``seed`` and ``model`` (the name its reply reports: the daemon serves one
    model); any other is a TypeError, not silently dropped.

    Pass ``session_id`` to go on with an existing session; the session in use is
    ``chat.session_id``. One instance holds one conversation at a time: calls on it are
    serialised, and the session should not be used by anyone else meanwhile (its history
    would no longer be the one this object knows; the next call would rewind to what
    matches, or append to a history it does not know). Streaming, stop strings and asyncio
    (through ``kvkeep.AsyncClient``) are supported. ``close()`` and ``aclose()`` close its
    connections; the session stays on the daemon. ``model_name`` is the daemon's model (its
    file's name), asked of it once.
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
    model_name: str | None = None
    """The daemon's model; None: asked of the daemon on first use."""
    max_tokens: int | None = None
    stop: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    parallel_tool_calls: bool = False
    """Whether a reply may make several calls (``bind_tools`` may say otherwise). Off by
    default, as in llama.cpp's server: a small model let call again repeats its call."""

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

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kvkeep"
        params["ls_model_name"] = self._model_name()
        return params

    def _model_name(self) -> str:
        if self.model_name is None:
            self.model_name = _name_of(self._blocking().info())
        return self.model_name

    def _blocking(self) -> Client:
        if self._client is None:
            self._client = Client(self.address, timeout=self.timeout, token=self.token, tls=self.tls)
        return self._client

    # ---- tools -------------------------------------------------------------------------------

    def bind_tools(
        self,
        tools: Sequence[Any],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with ``tools`` (BaseTools, functions, Pydantic classes, TypedDicts,
        OpenAI tools or JSON schemas) to call: ``tool_choice`` "auto" (the default), "none",
        "any"/"required" (a call; of the one tool if there is one), a tool's name;
        ``parallel_tool_calls=False`` allows one call at most."""
        return self.bind(
            tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, **kwargs
        )

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        include_raw: bool = False,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """Replies parsed into ``schema`` (a Pydantic class, a TypedDict, an OpenAI tool or a
        JSON schema): by a call of it as a tool (``function_calling``), or by the reply held
        to its JSON schema (``json_schema``), or to any JSON object (``json_mode``)."""
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        kwargs.pop("strict", None)
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        if method == "json_mode":
            json_schema: dict[str, Any] = {"type": "object"}
        elif method == "json_schema":
            json_schema = convert_to_json_schema(schema)
        else:
            raise ValueError(f"method must be function_calling, json_schema or json_mode, not {method!r}")
        structured = {"kwargs": {"method": method}, "schema": schema}
        llm = self.bind(json_schema=json_schema, ls_structured_output_format=structured)
        parser: Runnable[Any, Any] = (
            PydanticOutputParser(pydantic_object=schema)
            if isinstance(schema, type) and is_basemodel_subclass(schema)
            else JsonOutputParser()
        )
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    # ---- a turn ------------------------------------------------------------------------------

    def _sampling_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}

    def _turn(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(kwargs) - CALL_KEYWORDS)
        if unknown:
            raise TypeError(
                f"ChatKvkeep does not take {', '.join(map(repr, unknown))}; "
                f"a call takes {', '.join(sorted(CALL_KEYWORDS))}"
            )
        if kwargs.get("json_schema") is not None and kwargs.get("response_format") is not None:
            raise ValueError("give response_format or json_schema, not both")
        sampling = {**self._sampling_dict(), **{k: kwargs[k] for k in self._sampling_dict() if k in kwargs}}
        tools = kvkeep_tools(kwargs.get("tools") or ())
        turn: dict[str, Any] = {
            "max_tokens": kwargs.get("max_tokens", self.max_tokens),
            "stop": [*(self.stop or ()), *(stop or ())],
            "sampling": SamplingParams(**sampling),
            "json_schema": kwargs.get("json_schema") or response_schema(kwargs.get("response_format")),
            # A call has the tools it is bound with: none when it is bound with none.
            "tools": tools,
            "tool_choice": tool_choice(kwargs.get("tool_choice"), tools) if tools else None,
            "parallel_tool_calls": (
                self.parallel_tool_calls
                if kwargs.get("parallel_tool_calls") is None
                else kwargs["parallel_tool_calls"]
            ),
        }
        return turn

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

    def _metadata(self, chunk: Chunk, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {
            "finish_reason": chunk.finish_reason,
            "session_id": self.session_id,
            # A call's own `model` is the name its reply reports (LangChain's per-call override).
            "model_name": kwargs.get("model") or self.model_name,
        }

    def _result(
        self, chunks: Sequence[Chunk], calls: tuple[ToolCall, ...], kwargs: dict[str, Any]
    ) -> ChatResult:
        last = chunks[-1]
        metadata = self._metadata(last, kwargs)
        message = ai_message("".join(c.text for c in chunks), calls, last.usage, metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _generation_chunk(self, chunk: Chunk, kwargs: dict[str, Any]) -> ChatGenerationChunk:
        if chunk.finish_reason is None or chunk.usage is None:
            return ChatGenerationChunk(message=ai_chunk(chunk.text, chunk.tool_calls))
        return ChatGenerationChunk(
            message=ai_chunk(chunk.text, chunk.tool_calls, chunk.usage, self._metadata(chunk, kwargs))
        )

    def _record(self) -> Callable[[Sequence[Message], Chunk], tuple[ToolCall, ...]]:
        """What follows a reply's chunks, recording the reply once it is whole."""
        self._held = None  # unknown until the reply is complete
        text, deltas = "", list[ToolCallDelta]()

        def record(conversation: Sequence[Message], chunk: Chunk) -> tuple[ToolCall, ...]:
            nonlocal text
            text += chunk.text
            deltas.extend(chunk.tool_calls)
            calls = join_calls((), deltas)
            if chunk.finish_reason is not None:
                self._held = [*conversation, Message("assistant", text, calls)]
            return calls

        return record

    # ---- blocking ----------------------------------------------------------------------------

    def _session(self, messages: list[Message], tools: Any) -> tuple[Session, list[Message], bool]:
        """The session, the messages to send, and whether they are the whole conversation."""
        client = self._blocking()
        self._model_name()
        if self.session_id is None:
            system, rest = self._split_system(messages)
            session = client.create_session(
                system,
                persistent=self.persistent,
                tools=tools,
                sampling=SamplingParams(**self._sampling_dict()),
            )
            self.session_id = session.session_id
            self._held = [Message("system", system)] if system else []
            return session, rest, False
        session = Session(client, self.session_id)
        if self._held is None:
            self._held = list(session.info().messages)
        send, whole = self._plan(messages)
        return session, send, whole

    def _chunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[tuple[Chunk, tuple[ToolCall, ...]]]:
        conversation = [from_langchain(m) for m in messages]
        turn = self._turn(stop, kwargs)
        with self._lock:
            session, send, whole = self._session(conversation, turn["tools"])
            record = self._record()
            for chunk in session.chat_stream(send, whole=whole, **turn):
                yield chunk, record(conversation, chunk)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        pairs = list(self._chunks(messages, stop, kwargs))
        return self._result([c for c, _ in pairs], pairs[-1][1], kwargs)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk, _ in self._chunks(messages, stop, kwargs):
            out = self._generation_chunk(chunk, kwargs)
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=out)
            yield out

    # ---- asyncio -----------------------------------------------------------------------------

    async def _asession(
        self, messages: list[Message], tools: Any
    ) -> tuple[AsyncSession, list[Message], bool]:
        if self._aclient is None:
            self._aclient = AsyncClient(self.address, timeout=self.timeout, token=self.token, tls=self.tls)
        if self.model_name is None:
            self.model_name = _name_of(await self._aclient.info())
        if self.session_id is None:
            system, rest = self._split_system(messages)
            session = await self._aclient.create_session(
                system,
                persistent=self.persistent,
                tools=tools,
                sampling=SamplingParams(**self._sampling_dict()),
            )
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
    ) -> AsyncIterator[tuple[Chunk, tuple[ToolCall, ...]]]:
        conversation = [from_langchain(m) for m in messages]
        turn = self._turn(stop, kwargs)
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            session, send, whole = await self._asession(conversation, turn["tools"])
            record = self._record()
            async for chunk in session.chat_stream(send, whole=whole, **turn):
                yield chunk, record(conversation, chunk)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        pairs = [p async for p in self._achunks(messages, stop, kwargs)]
        return self._result([c for c, _ in pairs], pairs[-1][1], kwargs)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk, _ in self._achunks(messages, stop, kwargs):
            out = self._generation_chunk(chunk, kwargs)
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=out)
            yield out


def response_schema(fmt: Any) -> dict[str, Any] | None:
    """The JSON schema of a call's ``response_format`` (None: free text)."""
    if fmt is None:
        return None
    if isinstance(fmt, type):
        return convert_to_json_schema(fmt)
    if isinstance(fmt, dict):
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        inner = fmt.get("json_schema")
        if kind == "json_schema" and isinstance(inner, dict) and isinstance(inner.get("schema"), dict):
            schema: dict[str, Any] = inner["schema"]
            return schema
    raise ValueError(
        'response_format must be {"type": "json_schema", "json_schema": {"schema": {...}}}, '
        f'{{"type": "json_object"}}, {{"type": "text"}} or a class, not {fmt!r}'
    )


def _name_of(info: Info) -> str:
    """The model's name: its file's (as the HTTP door names it), or its description where the
    daemon shows no paths."""
    return Path(info.model_path).stem if info.model_path else info.model_description
