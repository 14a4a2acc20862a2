"""A chat turn's plan, without a daemon: the messages it keeps and adds, its prompt as a
delta after the history or a conversation tokenized again, and truncation of earlier turns.

Token ids here are plain ints: the plan only compares and counts them.
"""

from __future__ import annotations

import pytest

from kvkeepd.errors import InvalidRequest
from kvkeepd.sessions.prompting.templates import Segment
from kvkeepd.sessions.prompting.turn_plan import TurnPlan, plan_turn
from kvkeepd.values.messages import ChatMessage, Message

SYSTEM = Message("system", "You keep the harbour's ledgers.")
ASK = Message("user", "Which pier holds the ferry?")
ANSWER = Message("assistant", "Pier 3.")
AGAIN = Message("user", "And the lighthouse keeper's boat?")
HELD = [SYSTEM, ASK, ANSWER]


def check_parts(plan: TurnPlan, held: list[Message]) -> None:
    """What the template renders is what the session keeps, then what the turn adds."""
    assert plan.conversation == (*held[: plan.n_kept], *plan.added)


def test_messages_to_add_keep_the_whole_history() -> None:
    plan = plan_turn(HELD, [AGAIN], whole=False)
    assert (plan.n_kept, plan.added, plan.extends) == (3, (AGAIN,), True)
    assert plan.conversation == (SYSTEM, ASK, ANSWER, AGAIN)
    check_parts(plan, HELD)
    # The first turn of a fresh session.
    first = plan_turn([], [SYSTEM, ASK], whole=False)
    assert (first.n_kept, first.added, first.extends) == (0, (SYSTEM, ASK), True)


def test_a_whole_conversation_that_continues_the_history_adds_its_new_messages() -> None:
    plan = plan_turn(HELD, [*HELD, AGAIN], whole=True)
    assert (plan.n_kept, plan.added, plan.extends) == (3, (AGAIN,), True)
    check_parts(plan, HELD)


def test_a_whole_conversation_that_differs_keeps_only_what_matches() -> None:
    edited = Message("user", "Which pier holds the lighthouse?")
    plan = plan_turn(HELD, [SYSTEM, edited], whole=True)
    assert (plan.n_kept, plan.added, plan.extends) == (1, (edited,), False)
    check_parts(plan, HELD)
    other = plan_turn(HELD, [Message("user", "Hello")], whole=True)
    assert (other.n_kept, other.extends) == (0, False)
    check_parts(other, HELD)
    # Tool calls and call ids are part of a message: a differing id is a differing message.
    answered = Message("tool", "3", tool_call_id="call_1")
    plan = plan_turn([*HELD, answered], [*HELD, Message("tool", "3", tool_call_id="call_2")], whole=True)
    assert plan.n_kept == 3


def test_an_earlier_point_of_the_history_makes_its_reply_again() -> None:
    # The conversation up to the question: the question is kept as added, so it is answered again.
    plan = plan_turn(HELD, [SYSTEM, ASK], whole=True)
    assert (plan.n_kept, plan.added, plan.extends) == (1, (ASK,), False)
    check_parts(plan, HELD)


def test_a_turn_that_adds_nothing_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="adds no message"):
        plan_turn(HELD, list(HELD), whole=True)
    with pytest.raises(InvalidRequest, match="adds no message"):
        plan_turn(HELD, [], whole=False)
    with pytest.raises(InvalidRequest, match="adds no message"):
        plan_turn([], [], whole=True)


def test_the_prompt_is_a_delta_only_where_the_history_is_a_prefix_of_the_rendering() -> None:
    segments = [Segment("<s>system: ledgers\n", False), Segment("user: ferry?", True)]
    extending = plan_turn(HELD, [AGAIN], whole=False)
    assert extending.delta(segments, "<s>system: led") == [
        Segment("gers\n", False),
        Segment("user: ferry?", True),
    ]
    assert extending.delta(segments, "<s>system: ledgers\n") == [Segment("user: ferry?", True)]
    assert extending.delta(segments, "") == segments
    # A stop string left text the template does not write.
    assert extending.delta(segments, "<s>system: ledgers!") is None
    # A turn that drops held messages is tokenized again even where the text would match.
    dropping = plan_turn(HELD, [SYSTEM, AGAIN], whole=True)
    assert dropping.delta(segments, "<s>system: ledgers\n") is None


def test_a_delta_follows_the_whole_history() -> None:
    plan = plan_turn(HELD, [AGAIN], whole=False).placed([1, 2, 3, 4], [7, 8], delta=True)
    assert (plan.start, plan.prompt) == (4, (7, 8))
    fresh = plan_turn([], [ASK], whole=False).placed([], [5, 6], delta=True)
    assert (fresh.start, fresh.prompt) == (0, (5, 6))


def test_a_conversation_tokenized_again_keeps_what_it_shares_with_the_history() -> None:
    plan = plan_turn(HELD, [SYSTEM, AGAIN], whole=True)
    # The history's first three tokens match; the rest of it is cut, the rest of the
    # conversation's tokens are the prompt.
    cut = plan.placed([1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9], delta=False)
    assert (cut.start, cut.prompt) == (3, (9, 9, 9))
    # Nothing in common: the whole conversation is the prompt, the whole history goes.
    other = plan.placed([1, 2, 3], [4, 5], delta=False)
    assert (other.start, other.prompt) == (0, (4, 5))
    # The history is a prefix of the tokens (a stop string's text tokenized apart).
    longer = plan.placed([1, 2], [1, 2, 3], delta=False)
    assert (longer.start, longer.prompt) == (2, (3,))
    # Placing changes where the prompt goes, not the messages.
    assert (cut.n_kept, cut.added, cut.truncated, cut.dropped) == (plan.n_kept, plan.added, False, 0)


def test_the_system_prompt_is_the_kept_messages_that_start_in_it() -> None:
    held = [ChatMessage("system", "s", 0), ChatMessage("user", "u", 10), ChatMessage("assistant", "a", 20)]
    plan = plan_turn([m.message() for m in held], [AGAIN], whole=False)
    assert plan.n_system(held, system_end=10) == 1
    assert plan.n_system(held, system_end=0) == 0  # a conversation without a system prompt
    # Only the kept messages count: a turn that keeps none has no system prompt to keep.
    other = plan_turn([m.message() for m in held], [Message("user", "Hello")], whole=True)
    assert other.n_system(held, system_end=10) == 0


def test_truncation_keeps_the_newest_turn() -> None:
    # Messages added: all of them are kept.
    assert plan_turn(HELD, [AGAIN], whole=False).n_newest == 1
    assert plan_turn([], [SYSTEM, ASK, ANSWER, AGAIN], whole=False).n_newest == 4
    # A whole conversation: the messages after its last reply.
    tool = Message("tool", "3", tool_call_id="call_1")
    assert plan_turn([], [SYSTEM, ASK, ANSWER, tool, AGAIN], whole=True).n_newest == 2
    assert plan_turn([], [SYSTEM, ASK], whole=True).n_newest == 2  # no reply in it
    # A conversation that ends on a reply (to continue): at least one message stays.
    assert plan_turn([], [SYSTEM, ASK, ANSWER], whole=True).n_newest == 1


def test_truncation_drops_earlier_turns() -> None:
    conversation = [SYSTEM, ASK, ANSWER, AGAIN]
    plan = plan_turn(HELD, [AGAIN], whole=False).placed([1] * 50, [2] * 10, delta=True)
    # The system prompt (one message, 5 tokens) and the newest question (10 tokens) kept.
    cut = plan.truncated_to(3, 1, 5, [2] * 10)
    assert cut.truncated and (cut.n_kept, cut.added) == (1, (AGAIN,))
    assert (cut.start, cut.prompt) == (5, (2,) * 10)
    assert cut.dropped == 50 + 10 - 5 - 10
    assert cut.conversation == (SYSTEM, AGAIN)
    check_parts(cut, conversation)
    # The last answer kept with the question before it.
    some = plan.truncated_to(1, 1, 5, [3] * 30)
    assert not some.truncated and some == plan  # every turn kept: nothing changes
    fewer = plan.truncated_to(2, 1, 5, [3] * 30)
    assert fewer.truncated and fewer.added == (ANSWER, AGAIN) and fewer.dropped == 60 - 35
    # Kept turns that render longer than they did in the history: the context is not shorter.
    longer = plan.truncated_to(2, 1, 5, [3] * 80)
    assert longer.truncated and longer.dropped == 0


def test_truncating_a_whole_conversation_adds_again_the_turns_it_keeps() -> None:
    thanks = Message("user", "Thanks.")
    conversation = [*HELD, AGAIN, Message("assistant", "Pier 7."), thanks]
    plan = plan_turn(HELD, conversation, whole=True).placed([1] * 30, [2] * 25, delta=True)
    assert (plan.n_kept, plan.n_newest) == (3, 1)
    # The system prompt and the newest message: the session keeps one message of those it held.
    cut = plan.truncated_to(5, 1, 5, [2] * 8)
    assert (cut.n_kept, cut.added, cut.start, cut.dropped) == (1, (thanks,), 5, 30 + 25 - 5 - 8)
    check_parts(cut, conversation)
    # Kept turns the session held come after the cut: the history there is rewritten.
    later = plan.truncated_to(2, 1, 5, [2] * 20)
    assert later.added == (ANSWER, *conversation[3:]) and later.n_kept == 1
    check_parts(later, conversation)
