"""Chat turns that add messages of any roles, or give the whole conversation (`whole`)."""

from __future__ import annotations

import pytest
from daemons import GREEDY

import kvkeep
from kvkeep import Message


def roles(session: kvkeep.Session) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in session.info().messages]


def test_messages_of_any_roles_are_added_in_order(client: kvkeep.Client) -> None:
    told = client.create_session("You are terse.", sampling=GREEDY)
    given = [Message("user", "Name a colour."), Message("assistant", "Teal."), Message("user", "Another.")]
    reply = told.chat(given, max_tokens=8)
    assert roles(told) == [
        ("system", "You are terse."),
        *((m.role, m.content) for m in given),
        ("assistant", reply.text),
    ]
    # The same conversation built turn by turn from a session that said "Teal." itself
    # renders to the same tokens, so the replies agree.
    replayed = client.create_session(sampling=GREEDY)
    again = replayed.chat([Message("system", "You are terse."), *given], max_tokens=8)
    assert again.text == reply.text
    for s in (told, replayed):
        s.close()


def test_a_whole_conversation_keeps_what_matches(client: kvkeep.Client) -> None:
    session = client.create_session("You are terse.", sampling=GREEDY)
    first = session.chat("Name a colour.", max_tokens=8)
    after_first = session.info().n_tokens
    session.chat("Name an animal.", max_tokens=8)

    # The second question edited: the history up to the first reply is kept, the rest redone.
    edited = [
        Message("system", "You are terse."),
        Message("user", "Name a colour."),
        Message("assistant", first.text),
        Message("user", "Name a city."),
    ]
    redo = session.chat(edited, whole=True, max_tokens=8)
    assert redo.usage.reused_tokens >= after_first - 1
    assert roles(session) == [*((m.role, m.content) for m in edited), ("assistant", redo.text)]
    fresh = client.create_session(sampling=GREEDY)
    assert fresh.chat(edited, whole=True, max_tokens=8).text == redo.text

    # Resending what the session holds plus one message evaluates only that message.
    more = [*edited, Message("assistant", redo.text), Message("user", "Another city.")]
    before = session.info().n_tokens
    cont = session.chat(more, whole=True, max_tokens=4)
    assert cont.usage.reused_tokens >= before - 1
    with pytest.raises(kvkeep.InvalidRequestError, match="adds no message"):
        session.chat([*more, Message("assistant", cont.text)], whole=True)
    # An earlier point of the conversation: its reply is made again, as a fresh session's.
    again = session.chat(list(more[:2]), whole=True, max_tokens=8)
    assert again.text == first.text and again.usage.reused_tokens > 0
    assert roles(session) == [*((m.role, m.content) for m in more[:2]), ("assistant", first.text)]
    for s in (session, fresh):
        s.close()


def test_bad_messages_are_refused(client: kvkeep.Client) -> None:
    session = client.create_session(sampling=GREEDY)
    with pytest.raises(kvkeep.InvalidRequestError, match="role"):
        session.chat([Message("robot", "x")])
    with pytest.raises(kvkeep.InvalidRequestError, match="names the call it answers"):
        session.chat([Message("tool", "x")])
    with pytest.raises(ValueError, match="whole"):
        session.chat("Hi", whole=True)
    assert session.info().n_tokens == 0
    session.close()
