"""Generation flows: raw continuation and chat turns, from a request to streamed chunks.

Both run inside an operation holding the session's lock: the prompt is tokenized (chat:
through the model's template, message content never parsed for control tokens), checked
against the context, the session is given a slot, and one engine job streams the reply.
A persistent session's turn is recorded in the journal before the last chunk goes out, so
a client that saw the end of a generation can rely on it surviving a crash; its KV blocks
are saved (a new head) only once the turns since the last head add `--head-interval`
tokens, or a turn truncates the conversation. Tokenizing is tokens.py's; what fits in the
context, and truncation, fitting.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeGuard

from kvkeepd import bulk
from kvkeepd.config.settings import Settings
from kvkeepd.engine.context import ModelInfo
from kvkeepd.engine.engine import Engine
from kvkeepd.engine.job import Job
from kvkeepd.engine.structured_output import Grammars
from kvkeepd.errors import ContextFull, InvalidRequest, KvkeepError, noted
from kvkeepd.request_limits import MAX_LOGPROBS
from kvkeepd.sessions import ops
from kvkeepd.sessions.durability.persistence import Persistence
from kvkeepd.sessions.host import SessionHost
from kvkeepd.sessions.ledger import Ledger
from kvkeepd.sessions.memory.prefix_cache import PrefixCache
from kvkeepd.sessions.memory.residency import Residency
from kvkeepd.sessions.prompting.fitting import Fitting
from kvkeepd.sessions.prompting.templates import ChatTemplate
from kvkeepd.sessions.prompting.tokens import Tokenizer
from kvkeepd.sessions.prompting.turn_plan import TurnPlan, plan_turn
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenants
from kvkeepd.tools import CallStream, call_ids_for
from kvkeepd.values.constraints import Constraint, GrammarSpec, next_constraint
from kvkeepd.values.generation import Chunk, GenerationRequest, Turn, check_stop
from kvkeepd.values.messages import ChatMessage, Message, check_messages
from kvkeepd.values.toolcall import Tool, ToolChoice, check_tools, choice_for, join_deltas

Put = Callable[[Chunk], None]


class Conversations:
    """The generation flows: a prompt or chat messages added to a session, its continuation
    streamed, the turn made durable (persistent sessions)."""

    def __init__(
        self,
        host: SessionHost,
        *,
        settings: Settings,
        model: ModelInfo,
        engine: Engine,
        residency: Residency,
        persistence: Persistence,
        prefixes: PrefixCache,
        grammars: Grammars,
        tenants: Tenants,
        template: ChatTemplate | None,
        ledger: Ledger,
    ) -> None:
        self.host = host
        self.settings = settings
        self.model = model
        self.engine = engine
        self.residency = residency
        self.persistence = persistence
        self.prefixes = prefixes
        self.grammars = grammars
        self.tenants = tenants
        self.template = template
        self.tokens = Tokenizer(engine, model, settings.prompt_limit, template)
        self.fit = Fitting(model.n_ctx_seq, settings.prompt_limit, self.tokens, template)
        # Where each turn's tokens are counted.
        self.ledger = ledger

    async def generate(
        self,
        session: Session,
        put: Put,
        *,
        prompt: str,
        prompt_token_ids: Sequence[int],
        parse_special: bool,
        turn: Turn,
    ) -> None:
        """Extend the session by a prompt (text or token ids) and stream the continuation."""
        if prompt and prompt_token_ids:
            raise InvalidRequest("give the prompt as text or as token ids, not both")
        n_vocab = self.model.n_vocab
        bad = next((t for t in prompt_token_ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {n_vocab})")
        self.tokens.check_bytes(prompt, "prompt")
        request = self._request(session, turn)
        if turn.tools is not None or turn.tool_choice is not None:
            raise InvalidRequest("tools are for chat turns")
        spec = await self._grammar(session, turn)
        async with self.host.use(session):
            # The slot first: waiting for it may be cut short, and nothing has changed yet.
            slot = await self.residency.into_slot(session)
            if prompt:
                tokens = await self.tokens.tokenize(
                    prompt, first=not session.state.tokens, parse_special=parse_special
                )
            else:
                tokens = list(prompt_token_ids)
            request = replace(request, prompt=tuple(tokens))
            self.fit.check_prompt(request)
            n_history = len(session.state.tokens)
            if session.context_policy == "truncate" and not self.fit.fits(n_history, request):
                raise ContextFull(
                    f"history ({n_history}) + prompt ({len(tokens)}) + max_tokens is beyond the session's "
                    f"context of {self.model.n_ctx_seq}: the context policy truncate drops whole "
                    "chat turns (Chat), not raw text (Generate); rewind the session or chat"
                )
            self.fit.check(n_history, request)
            start = len(session.state.tokens) + len(tokens)
            constraint = next_constraint(session.constraint, spec, start, continuing=not tokens)
            reply = None
            if constraint is not None and constraint is session.constraint and session.messages:
                last = session.messages[-1]
                # Continuing a chat reply cut short within its grammar: the text joins that reply.
                reply = last if last.role == "assistant" and last.start == constraint.start else None
            await self._run(session, slot, request, put, reply, constraint)

    async def chat(self, session: Session, put: Put, *, message: str, turn: Turn) -> None:
        """Add a user message through the chat template and stream the assistant's reply."""
        if not message:
            raise InvalidRequest("the message is empty")
        await self.converse(session, put, messages=[Message("user", message)], whole=False, turn=turn)

    async def converse(
        self,
        session: Session,
        put: Put,
        *,
        messages: Sequence[Message],
        whole: bool,
        turn: Turn,
        again: bool = False,
    ) -> None:
        """Add messages (any roles) through the chat template and stream the assistant's reply.

        With `whole`, `messages` is the whole conversation: the session keeps the part of
        its history that matches it (token by token) and evaluates only the rest. With
        `again`, a turn may add no message: the reply is one more after the conversation.
        """
        assert self.template is not None
        request = self._request(session, turn)
        truncating = session.context_policy == "truncate"

        def check() -> None:
            check_messages(messages)
            for given in messages:
                self.tokens.check_bytes(given.content, "message")
            self.fit.check_messages(messages, request, whole=whole, truncating=truncating)

        await bulk.run(check, large=len(messages) > bulk.LARGE_MESSAGES)
        tools = check_tools(turn.tools) if turn.tools is not None else session.tools
        choice = choice_for(tools, turn.tool_choice)
        spec = await self._grammar(session, turn, tools, choice)
        async with self.host.use(session):
            slot = await self.residency.into_slot(session)
            # Put back as it was if the turn adds nothing (it fails, or cannot be made durable).
            before = session.before()
            state = session.state
            held = [m.message() for m in session.messages]
            plan = plan_turn(held, messages, whole=whole, again=again)
            plan = await self._place(session, plan, request, tools, truncating=truncating)
            request = replace(request, prompt=plan.prompt)
            if truncating and not self.fit.fits(plan.start, request, truncating=True):
                # Earlier turns make way; everything is decided before the history changes.
                k = plan.n_system(session.messages, session.system_end)
                first, cut, kept_tokens = await self.fit.truncated(
                    session, plan.conversation, k, plan.n_newest, request, tools
                )
                plan = plan.truncated_to(first, k, cut, kept_tokens)
                request = replace(request, prompt=plan.prompt)
            self.fit.check_prompt(request)
            self.fit.check(plan.start, request)
            if plan.start < len(state.tokens):
                await self._check_stored(session)
                await self.residency.truncate(session, plan.start)
            kept = session.messages[: plan.n_kept]
            for m in kept:
                m.start = min(m.start, plan.start)
            reply = ChatMessage("assistant", "", len(state.tokens) + len(plan.prompt))
            constraint = None
            if spec is not None:
                ids = call_ids_for(request.params.seed, reply.start) if spec.kind == "tools" else ""
                constraint = Constraint(spec, reply.start, ids)
            session.tools = tools
            session.messages = [
                *kept,
                *(
                    ChatMessage(m.role, m.content, plan.start, m.tool_calls, m.tool_call_id)
                    for m in plan.added
                ),
                reply,
            ]
            if plan.truncated:
                session.truncations += 1
                session.dropped_tokens += plan.dropped
            try:
                await self._run(session, slot, request, put, reply, constraint, plan.dropped)
            except BaseException:
                if len(session.state.tokens) <= plan.start:
                    # Nothing was added: the history it cut (another conversation, or turns
                    # dropped to fit) comes back, as tokens to evaluate again past the cells
                    # kept below the cut.
                    session.put_back(before, session.state.n_kv)
                raise

    async def _place(
        self,
        session: Session,
        plan: TurnPlan,
        request: GenerationRequest,
        tools: Sequence[Tool],
        *,
        truncating: bool,
    ) -> TurnPlan:
        """The turn's prompt: what the rendered conversation adds to the session's history,
        or the whole conversation tokenized again past what the history shares with it;
        refused by its fewest tokens first (not truncating: earlier turns cannot make way)."""
        segments = await self.tokens.render(plan.conversation, True, tools)
        history = list(session.state.tokens)
        history_text = await self.tokens.vocab(lambda c: c.detokenize(history, True))
        delta = plan.delta(segments, history_text)
        if delta is not None:
            if not truncating:
                self.fit.check_rendered(len(history), delta, request, prompt=True)
            tokens = await self.tokens.segments(delta, first=not history)
            return plan.placed(history, tokens, delta=True)
        if not truncating:
            self.fit.check_rendered(0, segments, request, prompt=False)
        full = await self.tokens.segments(segments, first=True)
        return plan.placed(history, full, delta=False)

    async def _run(
        self,
        session: Session,
        slot: int,
        request: GenerationRequest,
        put: Put,
        reply: ChatMessage | None = None,
        constraint: Constraint | None = None,
        dropped: int = 0,
    ) -> None:
        """Run one generation on a session in `slot`, whose lock the caller holds, under
        `constraint` (structured output) when there is one; `dropped` tokens of earlier
        turns made room for it (reported in its usage)."""
        await self._check_stored(session)
        matcher, calls = None, None
        if constraint is not None:
            output = session.state.tokens[constraint.start :]
            matcher = await self.grammars.matcher(session.tenant, constraint, output)
            if constraint.spec.kind == "tools":
                calls = await self._calls(constraint, output)
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()

        outbox = self.engine.outbox

        def emit(item: Chunk | BaseException) -> None:
            outbox.post(loop, items.put_nowait, item)

        job = Job(session.state, slot, request, emit, matcher=matcher, calls=calls)
        job.prefix = await self.prefixes.find(session, [*session.state.tokens, *request.prompt])
        job.boundary_at = self.prefixes.boundary_for(session)
        session.job = job
        before, previous = len(session.state.tokens), session.constraint
        draws_before = session.state.draws
        reply_before = (reply.content, reply.tool_calls) if reply is not None else ("", ())
        session.constraint = constraint
        self.host.touch(session)
        self.engine.submit(job)
        # A client that leaves stops the job within one step; the job's end is awaited all
        # the same, so the session's history is settled before anything else touches it.
        ops.current().on_abandon(lambda: setattr(job, "cancelled", True))
        # A chunk taken off the queue that cannot join the one before it: sent next.
        held: Chunk | None = None
        try:
            while True:
                item, held = await _next_chunk(items, held)
                if reply is not None:
                    reply.content += item.text
                    if item.tool_calls:
                        reply.tool_calls = join_deltas(reply.tool_calls, item.tool_calls)
                if item.finish_reason is not None:
                    put(await self._finish(session, job, item, put, before, draws_before, dropped))
                    return
                put(item)
        except BaseException:
            if len(session.state.tokens) == before:  # nothing was added (or it was undone)
                session.constraint = previous
                if reply is not None:
                    reply.content, reply.tool_calls = reply_before
            raise
        finally:
            session.job = None

    async def _finish(
        self,
        session: Session,
        job: Job,
        last: Chunk,
        put: Put,
        n_before: int,
        draws_before: int,
        dropped: int,
    ) -> Chunk:
        """The turn's bookkeeping once its `last` chunk is here (`n_before` tokens and
        `draws_before` draws before it, `dropped` by truncation): the session lets go of the job
        and, where the output is whole, of its constraint; the tokens are counted, the engine's
        snapshot and block boundary kept, and a persistent session's turn made durable (its
        tokens sent first). The chunk that ends the stream."""
        session.job = None
        if last.usage is not None and dropped:
            last = replace(last, usage=replace(last.usage, dropped_tokens=dropped))
        if last.finish_reason in ("eos", "tool_calls"):
            # Allowed only once a grammar accepts: the constrained output is whole.
            session.constraint = None
        if last.usage is not None:
            u = last.usage
            self.ledger.turn(
                session.tenant,
                evaluated=u.decoded_tokens,
                generated=u.generated_tokens,
                reused=u.reused_tokens,
            )
        session.keep_snapshot(job.snapshot)
        if job.boundary is not None:
            session.boundary = job.boundary
        if session.persistent:
            if last.token_ids:
                # NOTE: every token is sent before the turn is made durable, so a
                # stream cut before any token arrived was not kept: a client may
                # send it again (the SDK does) without adding the turn twice.
                put(replace(last, finish_reason=None, usage=None))
                last = replace(last, text="", token_ids=(), logprobs=(), tool_calls=())
            await self._save_turn(session, n_before, draws_before, truncated=dropped > 0)
        return last

    async def _check_stored(self, session: Session) -> None:
        """A persistent session's autosave would store more: refused before anything changes."""
        if session.persistent:
            await self.persistence.check_stored(self.tenants.get(session.tenant))

    async def _save_turn(
        self, session: Session, n_before: int, draws_before: int, *, truncated: bool
    ) -> None:
        """Make a persistent session's turn durable, or undo the turn: a client told that
        its request failed may send it again without finding the first reply in the history.

        Durable is a journal record, or a new head where a crash would otherwise evaluate
        more than `--head-interval` tokens again: the tokens since the head, or the whole
        history after a truncation (its kept turns moved). Such turns evaluated at least
        that many tokens, so the head's cost is small beside theirs. After a head save that
        failed (and may have committed), a head: a record follows the head it names."""
        persistence = self.persistence
        due = len(session.state.tokens) - session.head_n_kv >= self.settings.head_interval
        try:
            if due or truncated or session.head_unsure:
                await self.residency.save_head(session)
            else:
                await persistence.record_turn(session)
        except KvkeepError as e:
            await self.residency.truncate(session, n_before)
            # The sampler's position too: the same request sent again draws the same tokens.
            session.state.draws = draws_before
            raise noted(e, "the reply was not kept: the session is as it was before this request") from None

    def _request(self, session: Session, turn: Turn) -> GenerationRequest:
        if turn.max_tokens is not None and turn.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be > 0, got {turn.max_tokens}")
        if not 0 <= turn.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {turn.logprobs}")
        return GenerationRequest(
            prompt=(),
            max_tokens=turn.max_tokens,
            params=turn.sampling.apply(session.params),
            stop=session.stop + check_stop(turn.stop),
            logprobs=turn.logprobs,
            default_max_tokens=self.settings.default_max_tokens or None,
            progress=turn.progress,
        )

    async def _grammar(
        self, session: Session, turn: Turn, tools: tuple[Tool, ...] = (), choice: ToolChoice | None = None
    ) -> GrammarSpec | None:
        """The request's grammar, or its tool calls' (chat turns whose choice may call, with
        the JSON schema of an answer that is not a call), compiled (or found compiled):
        refused before any wait."""
        spec = GrammarSpec.of(turn.grammar, turn.json_schema)
        if choice is not None and choice.calls():
            if spec is not None and spec.kind != "json_schema":
                raise InvalidRequest("give a grammar or tools to call, not both", "grammar")
            if spec is not None:
                # The answer's schema alone first, so that a wrong one is named as itself.
                await self.grammars.check(session.tenant, spec)
            assert self.template is not None
            answer = spec.text if spec is not None else ""
            spec = self.template.toolkit.grammar(tools, choice, turn.parallel_tool_calls, answer)
        if spec is not None:
            await self.grammars.check(session.tenant, spec)
        return spec

    async def _calls(self, constraint: Constraint, output: Sequence[int]) -> CallStream:
        """The reader of a reply's calls, past what the reply holds already (a reply cut
        short and continued)."""
        assert self.template is not None
        stream = self.template.toolkit.stream(constraint.call_ids)
        if output:
            markers = stream.markers
            text = await self.tokens.vocab(
                lambda c: b"".join(c.piece(t, t in markers) for t in output).decode("utf-8", "replace")
            )
            stream.feed(text)
        return stream


async def _next_chunk(
    items: asyncio.Queue[Chunk | BaseException], held: Chunk | None
) -> tuple[Chunk, Chunk | None]:
    """The next chunk to send, `held` (taken off the queue before, not sent yet) or the
    queue's, and a chunk taken after it that could not join it. Chunks that queued up while
    the client was being served go out as one; a progress report stays a chunk of its own
    (each says where the prompt was). An error the engine sent is raised."""
    item = held if held is not None else await items.get()
    while _joins(item) and not items.empty():
        following = items.get_nowait()
        if not isinstance(following, Chunk):
            raise following
        if following.progress is not None:
            return item, following
        item = _merge(item, following)
    if isinstance(item, BaseException):
        raise item
    return item, None


def _joins(item: Chunk | BaseException) -> TypeGuard[Chunk]:
    """Whether chunks queued after this item may join it: text or tokens that do not end."""
    return isinstance(item, Chunk) and item.finish_reason is None and item.progress is None


def _merge(a: Chunk, b: Chunk) -> Chunk:
    """One chunk for two consecutive ones; the later one's end and usage are kept."""
    return Chunk(
        text=a.text + b.text,
        token_ids=a.token_ids + b.token_ids,
        logprobs=a.logprobs + b.logprobs,
        finish_reason=b.finish_reason,
        usage=b.usage,
        tool_calls=a.tool_calls + b.tool_calls,
        stop_sequence=b.stop_sequence,
    )
