"""What fits in a session's context: the checks on a turn's prompt and room for its reply,
and the context policy "truncate", which keeps the system prompt and the most recent whole
chat turns that fit.

Every check runs before the session's history changes, so a turn refused here leaves the
session as it was. A turn that cannot fit is refused as early as its lower bound shows it:
before its messages are rendered, then before the rendering is tokenized
(Tokenizer.least_of, Tokenizer.least).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

from kvkeepd.errors import ContextFull, InvalidRequest
from kvkeepd.sessions.prompting.templates import ChatTemplate, Segment, after_prefix
from kvkeepd.sessions.prompting.tokens import Tokenizer
from kvkeepd.sessions.session import Session
from kvkeepd.values.generation import GenerationRequest
from kvkeepd.values.messages import Message
from kvkeepd.values.toolcall import Tool

T = TypeVar("T")

# Under the context policy "truncate", a turn without max_tokens keeps room for a reply of
# at least 1/TRUNCATE_ROOM of the session's context.
TRUNCATE_ROOM = 4


class Fitting:
    """Context checks and truncation for the generation flows, in a context of `n_ctx`."""

    def __init__(
        self, n_ctx: int, prompt_limit: int, tokens: Tokenizer, template: ChatTemplate | None
    ) -> None:
        self.n_ctx = n_ctx
        self.prompt_limit = prompt_limit
        self.template = template
        self.tokens = tokens

    def check_prompt(self, request: GenerationRequest) -> None:
        """InvalidRequest for a prompt over the prompt limit."""
        limit = self.prompt_limit
        if len(request.prompt) > limit:
            raise InvalidRequest(f"the prompt has {len(request.prompt)} tokens; the limit is {limit}")

    def check_messages(
        self, messages: Sequence[Message], request: GenerationRequest, *, whole: bool, truncating: bool
    ) -> None:
        """Before rendering: InvalidRequest for messages to add that take more tokens than the
        prompt limit, ContextFull for a whole conversation (not truncated) that cannot fit the
        context with its reply, by the fewest tokens they can take (Tokenizer.least_of)."""
        if whole and truncating:
            return  # earlier turns may make way
        least = self.tokens.least_of(messages)
        what = f"the {len(messages)} messages take at least {least} tokens"
        if not whole and least > self.prompt_limit:
            raise InvalidRequest(f"{what}; the prompt limit is {self.prompt_limit}")
        self._check_least(0, least, request, what)

    def check_rendered(
        self, n_history: int, segments: Sequence[Segment], request: GenerationRequest, *, prompt: bool
    ) -> None:
        """Before tokenizing, by the fewest tokens the rendered `segments` can take
        (Tokenizer.least) after `n_history` tokens: InvalidRequest for a prompt over the prompt
        limit (`prompt`: the segments are the prompt, not the whole context), ContextFull for
        one without room for its reply."""
        least = self.tokens.least(segments)
        what = f"the rendered conversation takes at least {least} tokens"
        if prompt and least > self.prompt_limit:
            raise InvalidRequest(f"{what}; the prompt limit is {self.prompt_limit}")
        self._check_least(n_history, least, request, what)

    def _check_least(self, n_history: int, least: int, request: GenerationRequest, what: str) -> None:
        room = request.max_tokens or 1
        if n_history + least + room > self.n_ctx:
            raise ContextFull(
                f"{what}: with history ({n_history}) and max_tokens ({room}), more than the "
                f"session's context of {self.n_ctx}"
            )

    def fits(self, n_history: int, request: GenerationRequest, *, truncating: bool = False) -> bool:
        """Whether a prompt after `n_history` tokens leaves room for the reply: max_tokens,
        or without it one token (truncating: a quarter of the context, so that a turn after
        a truncation has room to answer; and the prompt, kept turns and all, within the
        prompt limit)."""
        n_ctx, n_prompt = self.n_ctx, len(request.prompt)
        if truncating and n_prompt > self.prompt_limit:
            return False
        room = request.max_tokens or (n_ctx // TRUNCATE_ROOM if truncating else 1)
        return n_history + n_prompt + room <= n_ctx

    def check(self, n_history: int, request: GenerationRequest) -> None:
        """InvalidRequest for an empty turn with nothing to continue; ContextFull unless
        the prompt after `n_history` tokens leaves room for the reply (`fits`)."""
        n_prompt = len(request.prompt)
        if not n_prompt and not n_history:
            raise InvalidRequest("the prompt is empty and the session has nothing to continue")
        if not self.fits(n_history, request):
            needed = n_history + n_prompt + (request.max_tokens or 1)
            raise ContextFull(
                f"history ({n_history}) + prompt ({n_prompt}) + max_tokens "
                f"({request.max_tokens or 1}) is {needed} tokens; the session's context is "
                f"{self.n_ctx}"
            )

    async def truncated(
        self,
        session: Session,
        conversation: Sequence[Message],
        k: int,
        n_added: int,
        request: GenerationRequest,
        tools: Sequence[Tool] = (),
    ) -> tuple[int, int, list[int]]:
        """The context policy "truncate": the system prompt (`conversation[:k]`, the history's
        first `session.system_end` tokens) and the most recent whole turns that fit with room
        for the reply. Returns the index of the first message kept after the system prompt,
        where the history is cut, and the tokens that follow (kept turns and new messages).
        ContextFull if the new messages alone do not fit."""
        template = self.template
        assert template is not None
        history = session.state.tokens[: session.system_end]
        system_text = await self.tokens.vocab(lambda c: c.detokenize(history, True))
        head = list(conversation[:k])
        # A kept part begins with a user message (templates may require roles to alternate),
        # or with the new messages.
        last = len(conversation) - n_added
        starts = [i for i in range(k, last) if conversation[i].role == "user"] + [last]

        async def render(first: int) -> tuple[int, list[int]]:
            segments = await self.tokens.render([*head, *conversation[first:]], True, tools)
            delta = after_prefix(segments, system_text)
            if delta is not None:
                return len(history), await self.tokens.segments(delta, first=not history)
            # A template that renders the system prompt otherwise once turns follow it.
            full = await self.tokens.segments(segments, first=True)
            cut = common_prefix(full, history)
            return cut, full[cut:]

        # The new messages alone must fit; fewer turns never render longer, so the first
        # start that fits is found by bisection.
        lo, hi = 0, len(starts) - 1
        best = (starts[hi], *await render(starts[hi]))
        self.check(best[1], replace(request, prompt=tuple(best[2])))
        while lo < hi:
            mid = (lo + hi) // 2
            cut, tokens = await render(starts[mid])
            if self.fits(cut, replace(request, prompt=tuple(tokens)), truncating=True):
                best, hi = (starts[mid], cut, tokens), mid
            else:
                lo = mid + 1
        return best


def common_prefix(a: Sequence[T], b: Sequence[T]) -> int:
    """How many items a and b have in common from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
