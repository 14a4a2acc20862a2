"""The daemon's access log as a test reads it.

The HTTP door writes a request's access line after its reply has gone, from the door's own
thread, so a client can hold the whole reply before the line exists: read it with `await_lines`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every access line captured so far, in order."""
    return [r.getMessage() for r in caplog.records if r.name == "kvkeepd.access"]


def await_lines(
    caplog: pytest.LogCaptureFixture, enough: Callable[[list[str]], bool], timeout: float = 30
) -> list[str]:
    """The access lines once `enough` holds of them (or as they are after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while not enough(lines := access_lines(caplog)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return lines
