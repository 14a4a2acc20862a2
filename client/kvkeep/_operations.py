"""Every call the SDK makes, written once: its request, the RPC it goes to, how its answer converts.

Client and Session (blocking) and AsyncClient and AsyncSession (asyncio) are two faces of
these: one calls, the other awaits. An operation here is a value, so building it does no I/O;
each face sends it the way its channel does. The public methods' docstrings live here too,
and each face's method takes its own with ``@described_by``.

An operation about one session names it in ``session_id``, and each face sends that in the
call's ``x-kvkeep-session`` metadata: a proxy in front of several daemons routes by it
(deploy/haproxy.cfg), so all of a session's calls reach the daemon that holds it. A fork
goes where its parent is; calls about no session (create_session, info, list_sessions) or
only a checkpoint carry none and may reach any daemon.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message as PbMessage

from kvkeep._convert import (
    chat_request,
    checkpoint_info_from_pb,
    chunk_from_pb,
    create_session_request,
    generate_request,
    info_from_pb,
    response_page_from_pb,
    session_info_from_pb,
)
from kvkeep._types import (
    CheckpointInfo,
    Chunk,
    Info,
    Message,
    PromptProgress,
    ResponsePage,
    SamplingParams,
    SessionInfo,
    Tool,
)
from kvkeep.v1 import kvkeep_pb2 as pb

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])
#: What a generation's ``on_progress`` is: called with each report of the prompt's evaluation.
OnProgress = Callable[[PromptProgress], object]


@dataclass(frozen=True)
class Unary(Generic[_T]):
    """One request, one answer: ``convert`` turns the response into what the method returns."""

    method: str  # of the KvKeep stub
    request: PbMessage
    convert: Callable[[Any], _T]
    session_id: str | None = None  # what the call is routed by (x-kvkeep-session)
    # Whether it may be sent again after a lost connection (_retry.py): it reads, or sets a
    # state whatever the state was, so that twice does what once does.
    resend: bool = False


@dataclass(frozen=True)
class Stream(Generic[_T]):
    """One request, a stream of answers, each converted by ``convert``."""

    method: str
    request: PbMessage
    convert: Callable[[Any], _T]
    session_id: str | None = None  # what the call is routed by (x-kvkeep-session)
    # Whether it may be sent again after a lost connection while nothing of it has arrived
    # (_retry.py): it reads, or it is a turn (whose tokens are all sent before it is kept).
    resend: bool = False
    # Takes the answers that are not converted and yielded (True): a generation's progress
    # reports, which go to its on_progress.
    aside: Callable[[Any], bool] | None = None


def described_by(source: Callable[..., Any] | str) -> Callable[[_F], _F]:
    """Give a face's method the docstring written here (an operation's, or a text)."""
    text = source if isinstance(source, str) else source.__doc__

    def describe(method: _F) -> _F:
        method.__doc__ = text
        return method

    return describe


# --- the daemon ---------------------------------------------------------------------------------


def info() -> Unary[Info]:
    """What the daemon runs: model, engine mode, limits and counters."""
    return Unary("GetInfo", pb.GetInfoRequest(), info_from_pb, resend=True)


def create_session(
    system_prompt: str,
    sampling: SamplingParams | None,
    stop: Sequence[str],
    persistent: bool,
    cache_salt: str | bytes | None,
    context_policy: str = "error",
    tools: Sequence[Tool] = (),
) -> Unary[str]:
    """Open a session; ``sampling`` and ``stop`` become its defaults for every request.

    A persistent session survives a daemon restart. Prompt prefixes are computed once
    per tenant; ``cache_salt`` (16+ bytes, hard to guess) shares them instead with
    whoever presents the same salt. ``context_policy`` says what a chat turn that does
    not fit the context does: ``"error"`` raises ContextFullError, ``"truncate"`` drops
    the oldest whole turns (the system prompt stays) to make room for it and its reply.
    ``tools`` are the tools its chat turns may call, kept with it (see chat).
    """
    request = create_session_request(
        system_prompt, sampling, stop, persistent, cache_salt, context_policy, tools
    )
    return Unary("CreateSession", request, _session_id)


def session(session_id: str) -> Unary[str]:
    """Open the session ``session_id`` again: one made earlier, by this client or another, and a
    persistent one after the daemon restarted; raises NotFoundError when there is none."""
    return Unary(
        "GetSession", pb.GetSessionRequest(session_id=session_id), _session_id, session_id, resend=True
    )


def list_sessions() -> Unary[list[SessionInfo]]:
    """Every session of the caller's (its tenant's), ephemeral and persistent, each with its
    id (for ``session()``), size, age and last use."""
    return Unary("ListSessions", pb.ListSessionsRequest(), _sessions, resend=True)


def fork_session(session_id: str | None, checkpoint_id: str | None, persistent: bool) -> Unary[str]:
    """A new session copied from a session's current state or from a checkpoint."""
    request = pb.ForkSessionRequest(
        session_id=session_id or "", checkpoint_id=checkpoint_id or "", persistent=persistent
    )
    return Unary("ForkSession", request, _session_id, session_id or None)


def list_checkpoints(session_id: str | None) -> Unary[list[CheckpointInfo]]:
    """The checkpoints of a session; with none, all of the caller's (imports too)."""
    request = pb.ListCheckpointsRequest(session_id=session_id or "")
    return Unary("ListCheckpoints", request, _checkpoints, session_id or None, resend=True)


def delete_checkpoint(checkpoint_id: str) -> Unary[None]:
    """Delete a checkpoint; blocks that other checkpoints share are kept."""
    return Unary("DeleteCheckpoint", pb.DeleteCheckpointRequest(checkpoint_id=checkpoint_id), _nothing)


def export_checkpoint(checkpoint_id: str) -> Stream[bytes]:
    """Write a checkpoint as one self-contained file; returns the bytes written.

    A path is replaced only once the whole checkpoint has arrived.
    """
    return Stream(
        "ExportCheckpoint", pb.ExportCheckpointRequest(checkpoint_id=checkpoint_id), _data, resend=True
    )


#: ImportCheckpoint streams requests the other way: each face reads the file its own way.
IMPORT_METHOD = "ImportCheckpoint"
IMPORT_CHECKPOINT = "Load an exported checkpoint into the daemon's store."


def import_request(data: bytes) -> pb.ImportCheckpointRequest:
    """One piece of the file being imported."""
    return pb.ImportCheckpointRequest(data=data)


def imported(response: pb.ImportCheckpointResponse) -> CheckpointInfo:
    """The checkpoint an import made."""
    return checkpoint_info_from_pb(response.checkpoint)


def list_responses(limit: int, after: str | None, order: str) -> Unary[ResponsePage]:
    """A page of the caller's stored responses (the HTTP door's ``/v1/responses``), by
    creation: ``order`` ``"desc"`` newest first, ``"asc"`` oldest first; ``limit`` of them
    (1 to 100) after the response ``after`` (None: from the first). For the next page, pass
    the last one's id as ``after`` while ``has_more``; a response deleted since is not found.
    """
    request = pb.ListResponsesRequest(limit=limit, after=after or "", order=order)
    return Unary("ListResponses", request, response_page_from_pb, resend=True)


def delete_response(response_id: str) -> Unary[None]:
    """Delete a stored response; it no longer counts against the tenant's stored bytes (blocks
    that other states share are kept). Another tenant's id is not found, as an unknown one."""
    return Unary("DeleteResponse", pb.DeleteResponseRequest(response_id=response_id), _nothing)


# --- one session --------------------------------------------------------------------------------


def generate(
    session_id: str,
    prompt: str | Sequence[int],
    *,
    max_tokens: int | None,
    stop: Sequence[str],
    sampling: SamplingParams | None,
    logprobs: int,
    grammar: str | None,
    json_schema: str | Mapping[str, Any] | None,
    parse_special: bool,
    on_progress: OnProgress | None = None,
) -> Stream[Chunk]:
    """Append ``prompt`` (text, or token ids) to the session and stream what follows.

    An empty prompt continues from where the session stopped. ``stop`` adds to the
    session's stop strings and ``sampling`` overrides its parameters, for this request
    only. ``logprobs`` asks for that many alternatives per token. Control-token markers in
    the text are parsed only with ``parse_special``. The call starts when the first chunk
    is asked for; stopping the iteration early cancels it.

    Structured output: ``grammar`` (GBNF text) or ``json_schema`` (a dict or JSON text)
    makes the output match it. Output cut short (``max_tokens``, a stop string) leaves the
    constraint open: calling generate again with an empty prompt continues within it.

    ``on_progress`` is called with a PromptProgress as the daemon evaluates the prompt: once
    as it begins, then after each step's chunk of its tokens (``--batch-size`` alone,
    ``--prefill-chunk`` beside other work), all before the first chunk. A long prompt on a
    CPU takes seconds to tens of seconds.
    """
    request = generate_request(
        session_id,
        prompt,
        max_tokens=max_tokens,
        stop=stop,
        sampling=sampling,
        logprobs=logprobs,
        grammar=grammar,
        json_schema=json_schema,
        parse_special=parse_special,
        return_progress=on_progress is not None,
    )
    return Stream("Generate", request, _chunk, session_id, resend=True, aside=_progress_to(on_progress))


COMPLETE = "Like generate, but waits for the whole continuation."


def chat(
    session_id: str,
    message: str | Sequence[Message],
    *,
    max_tokens: int | None,
    stop: Sequence[str],
    sampling: SamplingParams | None,
    logprobs: int,
    grammar: str | None,
    json_schema: str | Mapping[str, Any] | None,
    whole: bool,
    tools: Sequence[Tool] | None = None,
    tool_choice: str | Tool | None = None,
    parallel_tool_calls: bool | None = None,
    on_progress: OnProgress | None = None,
) -> Stream[Chunk]:
    """Send a user message through the model's chat template and stream the reply.

    ``message`` may instead be a sequence of Message of any roles, added in order before
    the reply. With ``whole``, that sequence is the whole conversation: the session keeps
    the part of its history that matches it, token for token, and evaluates only the
    rest (an edited or shortened conversation rewinds the session). The other arguments
    work as in generate, ``on_progress`` too: its ``cached`` tokens are the history the
    session holds already.

    Tool calls: ``tools`` replaces the session's tools for this turn and the next ones
    (``[]``: none; None: keep the session's). The model sees them through its template and
    writes calls in its own syntax, which the daemon reads back: chunks carry the calls'
    pieces in ``tool_calls`` (their ``text`` the content only) and a reply that called ends
    with finish reason ``"tool_calls"``. ``tool_choice`` holds the reply to ``"auto"`` (text
    or calls; the default with tools), ``"none"``, ``"required"`` (one call or more), or one
    call to the tool given (a Tool, or its name); every call's arguments validate against its
    tool's parameters. ``parallel_tool_calls=False`` allows one call at most. A result goes
    back as a Message of role ``"tool"`` naming its call's ``tool_call_id``.
    """
    request = chat_request(
        session_id,
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
        return_progress=on_progress is not None,
    )
    return Stream("Chat", request, _chunk, session_id, resend=True, aside=_progress_to(on_progress))


CHAT = "Like chat_stream, but waits for the whole reply."


def session_info(session_id: str) -> Unary[SessionInfo]:
    """The session's current state."""
    return Unary("GetSession", pb.GetSessionRequest(session_id=session_id), _session, session_id, resend=True)


def close_session(session_id: str) -> Unary[None]:
    """End the session: its history, head and checkpoints are deleted (export first to keep one)."""
    return Unary("CloseSession", pb.CloseSessionRequest(session_id=session_id), _nothing, session_id)


def rewind(session_id: str, n_tokens: int) -> Unary[SessionInfo]:
    """Keep only the first ``n_tokens`` tokens of the session's history."""
    request = pb.RewindRequest(session_id=session_id, n_tokens=n_tokens)
    return Unary("Rewind", request, _session, session_id, resend=True)


def checkpoint(session_id: str, label: str | None) -> Unary[CheckpointInfo]:
    """Save the session's current state."""
    request = pb.CheckpointRequest(session_id=session_id, label=label or "")
    return Unary("Checkpoint", request, _checkpoint, session_id)


CHECKPOINTS = "The session's checkpoints."


def restore(session_id: str, checkpoint_id: str) -> Unary[SessionInfo]:
    """Put the session back in the state a checkpoint saved."""
    request = pb.RestoreCheckpointRequest(session_id=session_id, checkpoint_id=checkpoint_id)
    return Unary("RestoreCheckpoint", request, _session, session_id, resend=True)


def fork(session_id: str, checkpoint_id: str | None, persistent: bool) -> Unary[str]:
    """A new session copied from this one's current state, or from ``checkpoint_id``."""
    if checkpoint_id is not None:
        # The request names only the checkpoint; routed by this session, whose daemon has it.
        return replace(fork_session(None, checkpoint_id, persistent), session_id=session_id)
    return fork_session(session_id, None, persistent)


# --- responses ----------------------------------------------------------------------------------


def _session_id(
    response: pb.CreateSessionResponse | pb.GetSessionResponse | pb.ForkSessionResponse,
) -> str:
    return response.session.session_id


def _session(
    response: pb.GetSessionResponse | pb.RewindResponse | pb.RestoreCheckpointResponse,
) -> SessionInfo:
    return session_info_from_pb(response.session)


def _sessions(response: pb.ListSessionsResponse) -> list[SessionInfo]:
    return [session_info_from_pb(s) for s in response.sessions]


def _checkpoint(response: pb.CheckpointResponse) -> CheckpointInfo:
    return checkpoint_info_from_pb(response.checkpoint)


def _checkpoints(response: pb.ListCheckpointsResponse) -> list[CheckpointInfo]:
    return [checkpoint_info_from_pb(c) for c in response.checkpoints]


def _chunk(response: pb.GenerateResponse | pb.ChatResponse) -> Chunk:
    return chunk_from_pb(response.chunk)


def _progress_to(on_progress: OnProgress | None) -> Callable[[Any], bool] | None:
    """What takes a generation's progress reports to ``on_progress``."""
    if on_progress is None:
        return None

    def aside(response: pb.GenerateResponse | pb.ChatResponse) -> bool:
        if not response.chunk.HasField("prompt_progress"):
            return False
        p = response.chunk.prompt_progress
        on_progress(PromptProgress(p.total, p.cached, p.processed, p.time_ms / 1000.0))
        return True

    return aside


def _data(response: pb.ExportCheckpointResponse) -> bytes:
    return response.data


def _nothing(response: PbMessage) -> None:
    return None
