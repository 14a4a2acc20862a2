"""The plan of a chat turn: which of a session's messages it keeps and which it adds, where
its prompt goes in the history, and which earlier turns truncation drops.

Pure: the generation flow renders and tokenizes (through the engine), and asks this module
what to make of the results; nothing here touches a session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvkeepd.errors import InvalidRequest
from kvkeepd.sessions.prompting.fitting import common_prefix
from kvkeepd.sessions.prompting.templates import Segment, after_prefix
from kvkeepd.values.messages import ChatMessage, Message


@dataclass(frozen=True)
class TurnPlan:
    """What a chat turn does to a session's history.

    The session keeps its first `n_kept` messages and adds `added` after them: the
    template renders `conversation`, which is those kept and those added. The prompt's
    tokens go at `start` in the history (cut there first); `truncated` when earlier turns
    were dropped to make room, `dropped` the tokens by which the context is shorter for it.
    """

    conversation: tuple[Message, ...]
    n_kept: int
    added: tuple[Message, ...]
    #: A whole conversation given (not messages to add): it may be cut before its newest turn.
    whole: bool
    #: The turn keeps every message the session holds: its prompt may be what the rendering
    #: adds to the history's text.
    extends: bool
    start: int = 0
    prompt: tuple[int, ...] = ()
    truncated: bool = False
    dropped: int = 0

    def delta(self, segments: Sequence[Segment], history_text: str) -> list[Segment] | None:
        """What the rendered conversation adds to the history (`history_text`), to tokenize
        after it; None where the whole conversation is to be tokenized again: the turn drops
        held messages, or the history is no prefix of the rendering (raw generation, a stop
        string left text the template does not have, or another conversation)."""
        return after_prefix(segments, history_text) if self.extends else None

    def placed(self, history: Sequence[int], tokens: Sequence[int], *, delta: bool) -> TurnPlan:
        """The plan with its prompt: a `delta`'s tokens follow the whole history; a
        conversation tokenized again keeps what it shares with the history from the start,
        and its prompt is the rest."""
        if delta:
            return replace(self, start=len(history), prompt=tuple(tokens))
        start = common_prefix(tokens, history)
        return replace(self, start=start, prompt=tuple(tokens[start:]))

    def n_system(self, held: Sequence[ChatMessage], system_end: int) -> int:
        """How many of the kept messages are the system prompt (the history's first
        `system_end` tokens), which truncation never drops."""
        return sum(1 for m in held[: self.n_kept] if m.start < system_end)

    @property
    def n_newest(self) -> int:
        """How many of the last messages truncation must keep (at least one): a whole
        conversation may be cut anywhere before its newest turn (the messages after its last
        reply); otherwise only before the messages this turn adds."""
        n = len(self.added)
        if self.whole:
            n = next((i for i, m in enumerate(reversed(self.added)) if m.role == "assistant"), n)
        return max(n, 1)

    def truncated_to(self, first: int, n_system: int, cut: int, tokens: Sequence[int]) -> TurnPlan:
        """The plan once truncation kept the system prompt (the first `n_system` messages)
        and `conversation[first:]`, the history cut at `cut` and `tokens` after it; the plan
        as it was where truncation kept every turn (`first` is `n_system`)."""
        if first <= n_system:
            return self
        return replace(
            self,
            conversation=(*self.conversation[:n_system], *self.conversation[first:]),
            n_kept=n_system,
            added=self.conversation[first:],
            start=cut,
            prompt=tuple(tokens),
            truncated=True,
            dropped=max(self.start + len(self.prompt) - cut - len(tokens), 0),
        )


def plan_turn(
    held: Sequence[Message], messages: Sequence[Message], *, whole: bool, again: bool = False
) -> TurnPlan:
    """The messages a turn keeps of those the session `held` and those it adds: `messages`
    after them, or with `whole` the whole conversation, of which the session keeps what
    matches its history (an earlier point of the history: its reply is made again).
    InvalidRequest for a turn that adds no message, unless `again`: then it is one more
    reply after the conversation (a stored response continued with no input)."""
    if whole:
        n_same = common_prefix(held, messages)
        if n_same == len(messages) < len(held):
            n_same -= 1
        conversation, added = tuple(messages), tuple(messages[n_same:])
    else:
        n_same = len(held)
        conversation, added = (*held, *messages), tuple(messages)
    if not added and not again:
        raise InvalidRequest("the conversation adds no message to what the session holds")
    return TurnPlan(conversation, n_same, added, whole=whole, extends=n_same == len(held))
