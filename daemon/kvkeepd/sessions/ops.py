"""Operations that run to their end: what a request starts, its cancellation cannot cut short.

Every request's work runs in a task of its own, and the request only awaits it (shielded).
When a client's deadline expires or it disconnects, the request stops waiting; the
operation goes on to its end, so a session is never left half-moved, half-closed or
half-saved. The one exception is waiting: an operation that is still waiting for its
session or for a slot has changed nothing yet, and is stopped there (`Op.waiting`). A
generation whose client left is told to stop (`Op.on_abandon`) and ends within one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextvars import ContextVar
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Op:
    """One running operation, as the code inside it sees it (`current()`)."""

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.abandoned = False
        self._waiting = 0
        self._on_abandon: list[Callable[[], None]] = []

    @contextlib.asynccontextmanager
    async def waiting(self) -> AsyncIterator[None]:
        """A wait the requester may cut short: nothing may change inside it."""
        if self.abandoned:
            raise asyncio.CancelledError
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    def on_abandon(self, fn: Callable[[], None]) -> None:
        """Call `fn` if the requester leaves (now, if it has already)."""
        if self.abandoned:
            fn()
        else:
            self._on_abandon.append(fn)

    def end(self) -> None:
        """The operation is over: let go of its task and of what it was to call if abandoned.

        NOTE: its task's context holds the op (`current()`), so op and task are a reference
        cycle. Left whole, they and all that the callbacks refer to (a generation's job, and
        the state the job loaded: tens of MB) would wait for Python's cycle collector, whose
        oldest generation runs seldom: a chain of stored responses held hundreds of MB so."""
        self.task = None
        self._on_abandon.clear()

    def abandon(self) -> None:
        if self.abandoned:
            return
        self.abandoned = True
        for fn in self._on_abandon:
            fn()
        if self._waiting and self.task is not None:
            self.task.cancel()


_current: ContextVar[Op | None] = ContextVar("kvkeep_op", default=None)


def current() -> Op:
    """The operation the calling code runs in (a fresh one outside any)."""
    return _current.get() or Op()


class Ops:
    """Starts operations and knows which are running."""

    def __init__(self, on_idle: Callable[[], None] | None = None) -> None:
        self._running: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_idle = on_idle

    @property
    def running(self) -> int:
        return len(self._running)

    def _start(self, coro: Coroutine[Any, Any, T]) -> tuple[Op, asyncio.Task[T]]:
        op = Op()

        async def body() -> T:
            _current.set(op)
            return await coro

        task = asyncio.get_running_loop().create_task(body())
        op.task = task
        self._running.add(task)
        self._idle.clear()
        task.add_done_callback(self._done)
        task.add_done_callback(lambda _: op.end())
        return op, task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        if not self._running:
            self._idle.set()
            if self._on_idle is not None:
                self._on_idle()
        if not task.cancelled() and (e := task.exception()) is not None:
            log.debug("an operation ended with %r", e)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` as an operation and return its result."""
        op, task = self._start(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                op.abandon()
            raise

    async def stream(
        self, body: Callable[[Callable[[T], None]], Coroutine[Any, Any, None]]
    ) -> AsyncIterator[T]:
        """Run `body(put)` as an operation and yield what it puts, until it ends."""
        items: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
        op, task = self._start(body(lambda item: items.put_nowait((False, item))))
        task.add_done_callback(lambda t: items.put_nowait((True, t)))
        try:
            while True:
                end, item = await items.get()
                if not end:
                    yield item
                    continue
                if item.cancelled():
                    raise asyncio.CancelledError
                if (e := item.exception()) is not None:
                    raise e
                return
        finally:
            if not task.done():
                op.abandon()

    async def settle(self, timeout: float | None = None) -> bool:
        """Wait until no operation runs; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
