"""Reading a reply's calls back as it is generated: its text split into content and the pieces
of its calls, in a family's syntax (formats.py).

The grammar holds the reply to the syntax, so the parser reads literal pieces as they come
and only ever waits for more text, never guesses. Content that may be the beginning of the
calls' opening is held back until the text tells (as stop strings are), and so is the
whitespace before it: the content of a reply that calls is its text before the calls, without
the whitespace that templates put back between the two. Calls are named with ids derived from
the reply's `call_ids` (kept with its constraint), except Mistral's, whose model writes them
after the arguments: their first piece, with the id and name, comes once the id is written,
then the arguments in the pieces they came in.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from kvkeepd.tools.formats import Syntax
from kvkeepd.values.toolcall import CallDelta

# What the parser reads next. Text the syntax does not allow (only unconstrained output could
# have it) ends the reading: what was read stands.
State = Literal["content", "literal", "name", "arguments", "id", "between", "done"]


def call_id(call_ids: str, index: int) -> str:
    """The id of a reply's `index`-th call."""
    return "call_" + hashlib.sha256(f"{call_ids}:{index}".encode()).hexdigest()[:24]


class CallStream:
    """One reply's text, fed as it is generated: `feed` returns the content to release and the
    calls' pieces, `finish` what was held back once the reply ends. Used by one thread at a
    time (the engine's, while its job runs)."""

    def __init__(self, syntax: Syntax, call_ids: str, markers: frozenset[int]) -> None:
        self.syntax = syntax
        self.call_ids = call_ids
        #: Token ids whose text the parser must see although they are control tokens.
        self.markers = markers
        self.calls = 0
        self._state: State = "content"
        self._pending = ""  # content held back, or call text not read yet
        self._started = False  # content released (llama3: the reply is not a call)
        self._expect = ""  # the rest of the literal being read, and what follows it
        self._then: State = "done"
        self._name = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._id = ""
        self._held_args: list[str] = []  # Mistral: arguments until the id is written

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Content to release, and the calls' pieces, after `text`."""
        self._pending += text
        if self._state == "content":
            content = self._content()
            return content, self._read() if self._state != "content" else []
        return "", self._read()

    def finish(self) -> str:
        """The content held back, once the reply has ended."""
        if self._state != "content":
            return ""
        rest, self._pending = self._pending, ""
        return rest

    def _content(self) -> str:
        syntax = self.syntax
        if not syntax.trigger:
            # llama3: a reply that calls is a call from its first character on.
            if not self._started and self._pending:
                if self._pending.startswith("{"):
                    self._literal(syntax.call_start, "name")
                    return ""
                self._started = True
            out, self._pending = self._pending, ""
            return out
        at = self._pending.find(syntax.trigger)
        if at >= 0:
            content = self._pending[:at].rstrip()
            self._pending = self._pending[at + len(syntax.trigger) :]
            self._literal(syntax.head + syntax.call_start, "name")
            return content
        keep = len(self._pending[: _partial(self._pending, syntax.trigger)].rstrip())
        out, self._pending = self._pending[:keep], self._pending[keep:]
        return out

    # ---- calls ---------------------------------------------------------------------------

    def _literal(self, text: str, then: State) -> None:
        self._state, self._expect, self._then = "literal", text, then

    def _read(self) -> list[CallDelta]:
        out: list[CallDelta] = []
        syntax = self.syntax
        while self._pending and self._state not in ("content", "done"):
            state = self._state
            if state == "literal":
                n = min(len(self._expect), len(self._pending))
                if self._pending[:n] != self._expect[:n]:
                    self._state, self._pending = "done", ""
                    break
                self._expect, self._pending = self._expect[n:], self._pending[n:]
                if not self._expect:
                    self._state = self._then
            elif state in ("name", "id"):
                end = self._pending.find('"')
                got = self._pending if end < 0 else self._pending[:end]
                self._pending = "" if end < 0 else self._pending[end:]
                if state == "name":
                    self._name += got
                else:
                    self._id += got
                if end < 0:
                    break
                if state == "name":
                    if not syntax.call_id:
                        out.append(CallDelta(self.calls, call_id(self.call_ids, self.calls), self._name))
                    self._literal(syntax.call_mid, "arguments")
                else:
                    out.append(CallDelta(self.calls, self._id, self._name))
                    out += [CallDelta(self.calls, arguments=a) for a in self._held_args]
                    self._end_call()
            elif state == "arguments":
                out += self._arguments()
            else:  # between: another call (its separator) or the tail
                if syntax.sep and self._pending[0] == syntax.sep[0]:
                    self._literal(syntax.sep + syntax.call_start, "name")
                else:
                    self._literal(syntax.tail, "done")
        return out

    def _arguments(self) -> list[CallDelta]:
        """Read the arguments' JSON object up to its closing brace."""
        text, n, closed = self._pending, 0, False
        for ch in text:
            n += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    closed = True
                    break
        piece, self._pending = text[:n], text[n:]
        out: list[CallDelta] = []
        if self.syntax.call_id:
            self._held_args.append(piece)
            if closed:
                self._literal(self.syntax.call_id, "id")
        else:
            out.append(CallDelta(self.calls, arguments=piece))
            if closed:
                self._end_call()
        return out

    def _end_call(self) -> None:
        """The call is whole (its end literal still to read): it counts from now."""
        self.calls += 1
        self._name, self._id, self._held_args = "", "", []
        self._literal(self.syntax.call_end, "between")


def _partial(text: str, marker: str) -> int:
    """Where the longest suffix of `text` that begins `marker` starts (len(text): none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)
