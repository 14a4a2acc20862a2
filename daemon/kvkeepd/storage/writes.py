"""Writes to the state stores from the event loop: run in a worker thread, and a failing disk
or catalog database is one error, StoreWriteFailed (RESOURCE_EXHAUSTED), logged once."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from typing import TypeVar

from kvkeepd.errors import StoreWriteFailed

log = logging.getLogger(__name__)

T = TypeVar("T")


async def store_write(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """A store write in a worker thread; a failing disk is RESOURCE_EXHAUSTED."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except (OSError, sqlite3.Error) as e:
        log.error("the state store failed: %s", e)
        raise StoreWriteFailed("the state store is failing (disk full?); nothing was saved") from None
