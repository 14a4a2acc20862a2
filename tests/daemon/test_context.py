"""Context policies: what a chat turn that does not fit the session's context does.

- "truncate": a conversation goes on past its context; each turn that drops earlier turns
  gives the same tokens and logprobs as a fresh session given the conversation it kept,
  and says what it dropped (usage, session info); so does a whole conversation resent;
- "error" (the default) keeps refusing with OUT_OF_RANGE, and changes nothing;
- raw Generate is not truncated; a bad policy is INVALID_ARGUMENT;
- the policy and its counts survive kill -9, and forks keep them;
- a truncating turn whose autosave fails puts the history back as it was; one cancelled
  mid-reply keeps the truncated conversation, and the session goes on.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from daemons import GREEDY, DaemonProcess, InProcessDaemon
from faults import FailingFsync

import kvkeep
from kvkeepd import files

SYSTEM = "You are a patient assistant who answers in full sentences."
QUESTIONS = [
    "Tell me about the moon and its phases.",
    "What makes the tides rise and fall every day?",
    "Why is the sky blue in the afternoon?",
    "How do bees find their way back to the hive?",
    "What is the tallest mountain on Earth?",
    "Why do leaves change colour in autumn?",
    "How does a rainbow form after the rain?",
    "What do whales eat in the deep ocean?",
    "Why does bread rise in a warm oven?",
]
REPLY = 24


def _fresh_reply(client: kvkeep.Client, kept: tuple[kvkeep.Message, ...]) -> kvkeep.Completion:
    """The reply of a new session given the conversation a truncated session kept."""
    fresh = client.create_session(SYSTEM, sampling=GREEDY)
    try:
        return fresh.chat(list(kept), max_tokens=REPLY, logprobs=2)
    finally:
        fresh.close()


def test_truncate_keeps_the_system_prompt_and_recent_turns(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    small = start_daemon(slots=2, ctx_per_session=256)
    with kvkeep.Client(small.address, timeout=120) as client:
        s = client.create_session(SYSTEM, sampling=GREEDY, context_policy="truncate")
        dropped_total, truncating = 0, 0
        for question in QUESTIONS:
            reply = s.chat(question, max_tokens=REPLY, logprobs=2)
            info = s.info()
            assert info.n_tokens <= 256
            assert info.messages[0] == kvkeep.Message("system", SYSTEM)
            assert info.messages[-2] == kvkeep.Message("user", question)
            assert info.messages[-1] == kvkeep.Message("assistant", reply.text)
            if info.truncations > truncating:
                truncating += 1
                assert reply.usage.dropped_tokens > 0
                dropped_total += reply.usage.dropped_tokens
                # The kept conversation starts with a user turn, right after the system prompt.
                assert info.messages[1].role == "user"
                fresh = _fresh_reply(client, info.messages[1:-1])
                assert fresh.token_ids == reply.token_ids
                assert fresh.logprobs == reply.logprobs
                assert fresh.finish_reason == reply.finish_reason
            else:
                assert reply.usage.dropped_tokens == 0
            assert info.truncations == truncating
            assert info.dropped_tokens == dropped_total
        assert truncating >= 3
        assert s.info().context_policy == "truncate"
        assert len(s.info().messages) < 2 * len(QUESTIONS) + 1


def test_error_policy_refuses_and_changes_nothing(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    small = start_daemon(slots=1, ctx_per_session=256)
    long_question = " ".join(QUESTIONS[:4])
    with kvkeep.Client(small.address, timeout=120) as client:
        s = client.create_session(SYSTEM, sampling=GREEDY)
        assert s.info().context_policy == "error"
        with pytest.raises(kvkeep.ContextFullError):
            for _ in range(8):
                s.chat(long_question, max_tokens=REPLY)
        before = s.info()
        with pytest.raises(kvkeep.ContextFullError):
            s.chat(long_question, max_tokens=REPLY)
        after = s.info()
        assert (after.n_tokens, after.messages, after.truncations) == (before.n_tokens, before.messages, 0)

        # Truncating cannot make room for new messages that do not fit on their own.
        t = client.create_session(SYSTEM, sampling=GREEDY, context_policy="truncate")
        with pytest.raises(kvkeep.ContextFullError):
            t.chat(long_question, max_tokens=200)
        assert t.info().messages == (kvkeep.Message("system", SYSTEM),)


def test_generate_is_not_truncated_and_bad_policies_are_refused(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    small = start_daemon(slots=1, ctx_per_session=256)
    with kvkeep.Client(small.address, timeout=120) as client:
        s = client.create_session(sampling=GREEDY, context_policy="truncate")
        s.complete("Once upon a time " * 30, max_tokens=8)
        n = s.info().n_tokens
        with pytest.raises(kvkeep.ContextFullError, match="truncate"):
            s.complete("and then " * 80, max_tokens=8)
        assert s.info().n_tokens == n
        for bad in ("drop", "TRUNCATE", "x" * 500):
            with pytest.raises(kvkeep.InvalidRequestError, match="context_policy"):
                client.create_session(context_policy=bad)


def test_policy_survives_kill_and_forks(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    proc = spawn_daemon("--ctx-per-session", "256", "--slots", "2")
    with kvkeep.Client(proc.address, timeout=120) as client:
        s = client.create_session(SYSTEM, sampling=GREEDY, persistent=True, context_policy="truncate")
        for question in QUESTIONS:
            s.chat(question, max_tokens=REPLY)
            if s.info().truncations >= 1:
                break
        before = s.info()
        assert before.truncations >= 1
    proc.restart(kill=True)
    with kvkeep.Client(proc.address, timeout=120) as client:
        s = client.session(before.session_id)
        after = s.info()
        assert (after.context_policy, after.truncations, after.dropped_tokens) == (
            "truncate",
            before.truncations,
            before.dropped_tokens,
        )
        assert after.messages == before.messages
        fork = client.fork_session(s.session_id)
        assert fork.info().context_policy == "truncate"
        # Both go on past the context, from the state the restart kept.
        for session in (s, fork):
            for question in QUESTIONS[:4]:
                session.chat(question, max_tokens=REPLY)
            assert session.info().truncations > before.truncations
        fork.close()


def _to_the_edge(s: kvkeep.Session) -> str:
    """Chat until the next question would truncate (a fork tries it); that question."""
    for question in QUESTIONS:
        probe = s.fork()
        probe.chat(question, max_tokens=REPLY)
        truncates = probe.info().truncations > s.info().truncations
        probe.close()
        if truncates:
            return question
        s.chat(question, max_tokens=REPLY)
    raise AssertionError("no question truncated")


def test_a_truncating_turn_cancelled_mid_reply_keeps_the_kept_conversation(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    small = start_daemon(slots=2, ctx_per_session=256)
    with kvkeep.Client(small.address, timeout=120) as client:
        s = client.create_session(SYSTEM, sampling=GREEDY, context_policy="truncate")
        question = _to_the_edge(s)
        stream = s.chat_stream(question, max_tokens=REPLY)
        first = next(stream)
        stream.close()
        assert first.finish_reason is None
        assert small.check_invariant() == []  # settles first: the cancelled turn has ended
        info = s.info()
        assert info.truncations == 1 and info.n_tokens <= 256
        assert info.messages[0] == kvkeep.Message("system", SYSTEM)
        assert info.messages[1].role == "user"
        assert info.messages[-2] == kvkeep.Message("user", question)
        assert info.messages[-1].role == "assistant"
        # The conversation goes on; a turn that truncates again is a fresh session's.
        for question in QUESTIONS[-3:]:
            reply = s.chat(question, max_tokens=REPLY, logprobs=2)
            after = s.info()
            if reply.usage.dropped_tokens:
                fresh = _fresh_reply(client, after.messages[1:-1])
                assert (fresh.token_ids, fresh.logprobs) == (reply.token_ids, reply.logprobs)
            info = after
        assert info.truncations > 1


def test_a_truncating_turn_whose_autosave_fails_is_undone(
    start_daemon: Callable[..., InProcessDaemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    faulty = FailingFsync()
    monkeypatch.setattr(files, "os", faulty)  # the block store writes through files.write_new
    small = start_daemon(slots=2, ctx_per_session=256)
    with kvkeep.Client(small.address, timeout=120) as client:
        s = client.create_session(SYSTEM, sampling=GREEDY, persistent=True, context_policy="truncate")
        question = _to_the_edge(s)
        before = s.info()
        faulty.failing = True
        with pytest.raises(kvkeep.BusyError, match="state store is failing"):
            s.chat(question, max_tokens=REPLY)
        faulty.failing = False
        after = s.info()
        assert (after.n_tokens, after.messages, after.truncations) == (
            before.n_tokens,
            before.messages,
            before.truncations,
        )
        again = s.chat(question, max_tokens=REPLY)
        assert again.usage.dropped_tokens > 0
        assert s.info().truncations == before.truncations + 1


def test_a_whole_conversation_resent_is_truncated_the_same_way(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    small = start_daemon(slots=2, ctx_per_session=256)
    with kvkeep.Client(small.address, timeout=120) as client:
        s = client.create_session(SYSTEM, sampling=GREEDY, context_policy="truncate")
        conversation = [kvkeep.Message("system", SYSTEM)]
        for question in QUESTIONS[:7]:
            conversation.append(kvkeep.Message("user", question))
            reply = s.chat(conversation, whole=True, max_tokens=REPLY, logprobs=2)
            kept = s.info().messages[1:-1]
            assert kept[-1] == conversation[-1] and len(kept) < len(conversation)
            if reply.usage.dropped_tokens:
                fresh = _fresh_reply(client, kept)
                assert (fresh.token_ids, fresh.logprobs) == (reply.token_ids, reply.logprobs)
            conversation.append(kvkeep.Message("assistant", reply.text))
        assert s.info().truncations >= 1
