"""Progress where people wait, on stderr and only when it is a terminal: a ticking wait for a
reply's first token (the prompt is being evaluated), and bars of bytes for exports and imports.

tqdm draws them (see pyproject.toml for why): it keeps rates and times, and clears its line.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import BinaryIO, cast

from tqdm import tqdm


def on_terminal() -> bool:
    return sys.stderr.isatty()


@contextlib.contextmanager
def waiting(label: str) -> Iterator[Callable[[], None]]:
    """`label` and the seconds spent so far, ticking until the returned `done()` is called
    (or the block ends); the line is cleared then. Nothing off a terminal."""
    if not on_terminal():
        yield lambda: None
        return
    bar = tqdm(desc=label, bar_format="{desc} {elapsed}", file=sys.stderr, leave=False)
    stopped = threading.Event()

    def tick() -> None:
        while not stopped.wait(0.25):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="kvkeep-progress", daemon=True)
    ticker.start()

    def done() -> None:
        if not stopped.is_set():
            stopped.set()
            ticker.join()
            bar.close()

    try:
        yield done
    finally:
        done()


@contextlib.contextmanager
def moving_bytes(label: str, total: int | None) -> Iterator[Callable[[int], None] | None]:
    """A bar of bytes moved (`update(n)`), of `total` when known; None off a terminal. Where
    the total was an estimate, the bar ends at what was moved."""
    if not on_terminal():
        yield None
        return
    bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)

    def update(n: int) -> None:
        bar.update(n)

    try:
        yield update
        if bar.total != bar.n:
            bar.total = bar.n
            bar.refresh()
    finally:
        bar.close()


class _Counted:
    """A binary file whose reads and writes report their sizes."""

    def __init__(self, f: BinaryIO, update: Callable[[int], None]) -> None:
        self._f = f
        self._update = update

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._update(len(data))
        return data

    def write(self, data: bytes) -> int:
        written = self._f.write(data)
        self._update(written)
        return written


def counted(f: BinaryIO, update: Callable[[int], None]) -> BinaryIO:
    """`f`, reporting each read's and write's size to `update`."""
    # The SDK only reads or writes the file it is given; a counting wrapper is enough.
    return cast(BinaryIO, _Counted(f, update))
