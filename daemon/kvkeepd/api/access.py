"""The access log: one line per request at INFO, from both doors, on the `kvkeepd.access`
logger. It says who asked for what and how it went, never what was said:

    grpc Chat tenant=anonymous session=s_3f9a... tokens=12+8 0.412s OK
    http POST /v1/chat/completions tenant=alice session=s_77c0... tokens=40+16 1.031s 200

`tokens=P+G`: tokens the request added to its session's prompt, and tokens it generated
(`-` for a request that generates nothing). Prompts and replies are never logged.
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

    def tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens, self.generated_tokens = prompt, generated

    def done(self, status: str) -> None:
        """Log the request's line (only when INFO is on: a line per request costs)."""
        if not log.isEnabledFor(logging.INFO):
            return
        tokens = "-" if self.prompt_tokens < 0 else f"{self.prompt_tokens}+{self.generated_tokens}"
        log.info(
            "%s %s tenant=%s session=%s tokens=%s %.3fs %s",
            self.door,
            self.method,
            self.tenant or "-",  # the anonymous tenant (no auth file) has no name
            self.session or "-",
            tokens,
            time.monotonic() - self.started,
            status,
        )
