"""The engine's Outbox: output posted from the engine thread reaches each event loop in
order, only once flushed, in one wake-up per loop; a closed loop loses only its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvkeepd.engine.job import Outbox


@contextmanager
def running_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def settled(schedule: Callable[..., object]) -> None:
    """Wait until a loop has run everything scheduled on it so far (`schedule`: its
    call_soon_threadsafe)."""
    done = threading.Event()
    schedule(done.set)
    assert done.wait(timeout=10)


def test_posts_arrive_in_order_once_flushed_one_wakeup_per_loop() -> None:
    outbox = Outbox()
    with running_loop() as a, running_loop() as b:
        got: dict[str, list[tuple[int, str]]] = {"a": [], "b": []}
        wakeups = {"a": 0, "b": 0}
        originals = {"a": a.call_soon_threadsafe, "b": b.call_soon_threadsafe}
        for name, loop in (("a", a), ("b", b)):

            def counting(*args: Any, name: str = name) -> object:
                wakeups[name] += 1
                return originals[name](*args)

            loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

        def engine() -> None:  # posts as the engine thread does during a step
            for step in range(3):
                for n in range(5):
                    outbox.post(a, got["a"].append, (step, f"a{n}"))
                    outbox.post(b, got["b"].append, (step, f"b{n}"))
                if step < 2:
                    outbox.flush()

        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()
        for schedule in originals.values():
            settled(schedule)
        # Step 2 was posted but not flushed: it has not been delivered.
        assert got["a"] == [(s, f"a{n}") for s in range(2) for n in range(5)]
        assert got["b"] == [(s, f"b{n}") for s in range(2) for n in range(5)]
        assert wakeups == {"a": 2, "b": 2}
        outbox.flush()
        outbox.flush()  # nothing left: no wake-up
        for schedule in originals.values():
            settled(schedule)
        assert got["a"] == [(s, f"a{n}") for s in range(3) for n in range(5)]
        assert wakeups == {"a": 3, "b": 3}


def test_a_closed_loop_loses_only_its_own_output() -> None:
    outbox = Outbox()
    closed = asyncio.new_event_loop()
    closed.close()
    got: list[int] = []
    with running_loop() as live:
        outbox.post(closed, got.append, -1)
        outbox.post(live, got.append, 1)
        outbox.flush()
        settled(live.call_soon_threadsafe)
    assert got == [1]
