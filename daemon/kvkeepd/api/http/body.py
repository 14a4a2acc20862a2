"""Request bodies' common ground: the base of their typed models, and the roles of OpenAI's
messages."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Roles of OpenAI's messages and the template role each becomes (a Responses input message
# has no tool role: a tool's result is an item of its own there).
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class Body(BaseModel):
    """A request body's model: a field given the wrong JSON type is refused ("1" is no number
    and 1 is no boolean; ints are still accepted as floats), and fields it does not name are
    ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class ClosedBody(Body):
    """A body whose fields it does not name are refused, as OpenAI's Responses API refuses
    them ("unknown parameter")."""

    model_config = ConfigDict(strict=True, extra="forbid")
