"""KvkeepChatMessageHistory: a LangChain chat-message history kept in a persistent session."""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.chat_history import BaseChatMessageHistory
from langchain_core.messages import BaseMessage

from kvkeep._client import Client
from kvkeep._connection import Tls
from kvkeep.integrations.langchain._messages import from_langchain, to_langchain


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
        """Append messages to the session (system, human, AI and tool messages)."""
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
