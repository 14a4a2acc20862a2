"""LangChain on kvkeep sessions (`pip install 'kvkeep[langchain]'`).

- `ChatKvkeep`, a chat model whose conversation lives in a kvkeep session: each call sends
  only the messages the session does not hold yet, so the history is neither sent again nor
  evaluated again. It calls tools (`bind_tools`) in the model's own format, every call held
  to its tool's schema, and gives structured output (`with_structured_output`) by tool call
  or by JSON schema.
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

from kvkeep.integrations.langchain._chat import ChatKvkeep
from kvkeep.integrations.langchain._history import KvkeepChatMessageHistory
from kvkeep.integrations.langchain._messages import from_langchain, to_langchain

__all__ = ["ChatKvkeep", "KvkeepChatMessageHistory", "from_langchain", "to_langchain"]
