"""The access log: one line per request at INFO, from both doors, on the `kvkeepd.access`
logger. It says who asked for what and how it went, never what was said:

    grpc Chat tenant=anonymous session=s_3f9a... tokens=12+8 0.412s OK
    http POST /v1/chat/completions tenant=alice session=s_77c0... tokens=40+16 1.031s 200
    http POST /v1/responses tenant=- session=- tokens=- 0.002s 400 invalid_value
    http POST /v1/responses tenant=- session=- tokens=30+9 ignored-tools=web_search 0.390s 200

`tokens=P+G`: tokens the request added to its session's prompt, and tokens it generated
(`-` for a request that generates nothing). A refused request's status is followed by its
reason code (OpenAI's `code`); notes say what the request asked that the door left out.
Prompts and replies are never logged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("kvkeepd.access")


@dataclass
class Access:
    """What one request's line will say, filled in as the request goes."""

    door: str
    method: str
    tenant: str = "-"
    session: str = "-"
    prompt_tokens: int = -1
    generated_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    #: Why the request was refused (OpenAI's error code), "" when it was not.
    reason: str = ""
    #: What the request asked that the door left out, by name (ignored-tools=...).
    notes: dict[str, str] = field(default_factory=dict)

    def tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens, self.generated_tokens = prompt, generated

    def done(self, status: str) -> None:
        """Log the request's line (only when INFO is on: a line per request costs)."""
        if not log.isEnabledFor(logging.INFO):
            return
        tokens = "-" if self.prompt_tokens < 0 else f"{self.prompt_tokens}+{self.generated_tokens}"
        notes = "".join(f" {k}={v}" for k, v in self.notes.items())
        log.info(
            "%s %s tenant=%s session=%s tokens=%s%s %.3fs %s%s",
            self.door,
            self.method,
            self.tenant or "-",  # the anonymous tenant (no auth file) has no name
            self.session or "-",
            tokens,
            notes,
            time.monotonic() - self.started,
            status,
            f" {self.reason}" if self.reason else "",
        )
