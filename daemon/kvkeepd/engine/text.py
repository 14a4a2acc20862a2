"""Streaming text: bytes of token pieces to UTF-8 text, and stop-string matching."""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class Utf8Stream:
    """Turns a stream of byte pieces into text, holding back incomplete UTF-8 sequences."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        return self._decoder.decode(piece)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Releases text as it streams, holding back any tail that could begin a stop string.

    `feed` returns the text safe to release; once a stop string matched (`matched` names
    it: the one that begins first, the first given of those that begin there), the text up
    to it has been released and nothing more is.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched = ""

    def feed(self, text: str) -> str:
        if self.matched:
            return ""
        buf = self._held + text
        if not self._stops:
            self._held = ""
            return buf
        cut, matched = -1, ""
        for stop in self._stops:
            at = buf.find(stop)
            if at != -1 and (cut == -1 or at < cut):
                cut, matched = at, stop
        if cut != -1:
            self.matched = matched
            self._held = ""
            return buf[:cut]
        keep = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:n]):
                    keep = max(keep, n)
                    break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched else held
