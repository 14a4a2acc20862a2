"""When the SDK sends a call again, and how long it waits before it does.

Several daemons behind a proxy serve one population of sessions: a session's daemon may be
handing it over, or may have died, and another one continues it once its lease lapses. A
client rides that out by sending its call again, but only where the first try cannot have
done anything that a second would do twice:

- a call refused with SessionElsewhereError: the daemon answers so only for a call whose
  effect it did not keep, and gives a hint of when to try again;
- after a lost connection, or a daemon that is stopping (UnavailableError without a cause,
  what a proxy answers when its daemon is gone; InternalError without one, what gRPC
  reports when a proxy cut a stream short): a call that reads, or that sets a state
  whatever the state was (rewind, restore), and a stream of which nothing has arrived (a
  daemon sends every token of a turn before it makes the turn durable) — once the client
  has been answered at its address at least once: until then nothing may be listening
  there, and the error is raised at once.

Never a call whose outcome is unknown: a deadline that passed, a stream that had answered,
a call that creates something.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from kvkeep._errors import InternalError, KvkeepError, SessionElsewhereError, UnavailableError


@dataclass(frozen=True)
class Retry:
    """How a client sends again a call that the daemons could not serve yet.

    ``wait``: seconds a call is tried for in all (0: never sent again); ``first``: the pause
    before the second try, doubled after each one up to ``most`` (each pause drawn between
    half of it and all of it, so that many clients do not come back at once). A daemon's
    hint (SessionElsewhereError.retry_after) is waited at least.
    """

    wait: float = 30.0
    first: float = 0.05
    most: float = 2.0

    def __post_init__(self) -> None:
        if not (self.wait >= 0 and self.first > 0 and self.most >= self.first):
            raise ValueError("Retry takes wait >= 0, first > 0 and most >= first")


def lost_connection(error: KvkeepError) -> bool:
    """Whether the error says the connection broke (or the daemon is stopping), rather than
    what the daemon made of the call: the daemon names a cause for each error of its own."""
    if error.cause:
        return False
    if isinstance(error, UnavailableError):
        return error.code == "UNAVAILABLE"
    return isinstance(error, InternalError) and error.code in ("INTERNAL", "UNKNOWN")


#: What a client does unless told otherwise.
DEFAULT_RETRY = Retry()
#: No call is sent again: every error is raised at once.
NO_RETRY = Retry(wait=0)


class Attempts:
    """One call's tries under a Retry: ``pause`` says how long to wait before the next one."""

    def __init__(self, policy: Retry | None, resend: bool) -> None:
        """``resend``: whether the call may be sent again after a lost connection (see the
        module docstring)."""
        self.policy = policy or NO_RETRY
        self.resend = resend
        self.deadline = time.monotonic() + self.policy.wait
        self.tries = 0

    def pause(self, error: KvkeepError, *, answered: bool = False) -> float | None:
        """Seconds to wait before sending the call again after `error`, or None to raise it
        (not retryable, or the pause would end past the call's `wait`). ``answered``: part
        of a stream had arrived (then it is never sent again)."""
        if answered:
            return None
        if isinstance(error, SessionElsewhereError):
            least = error.retry_after or 0.0
        elif self.resend and lost_connection(error):
            least = 0.0
        else:
            return None
        backoff = min(self.policy.most, self.policy.first * 2**self.tries)
        pause = max(least, random.uniform(backoff / 2, backoff))
        if time.monotonic() + pause > self.deadline:
            return None
        self.tries += 1
        return pause
