"""Progress where people wait, on stderr: the prompt's evaluation until a reply's first token
(on a terminal ticking, then a bar of its tokens as the daemon reports them; elsewhere, as in
a log, a line every few seconds), and, on a terminal, bars of bytes for exports and imports.

tqdm draws them (see pyproject.toml for why): it keeps rates and times, and clears its line.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO, cast

from tqdm import tqdm

from kvkeep._types import PromptProgress

# The prompt's bar once the daemon reports its tokens (until then, the label and the time).
PROMPT_BAR = "{desc} {percentage:3.0f}%|{bar:20}| {n}/{total} tokens{postfix} {elapsed}"

#: Seconds between two lines of the prompt's progress when stderr is not a terminal: a wait
#: shorter than this says nothing.
LINE_EVERY = 5.0


def on_terminal() -> bool:
    return sys.stderr.isatty()


class _Ticking:
    """A line of `label` and the seconds spent so far, redrawn four times a second by a
    thread of its own until `done`, which clears it."""

    def __init__(self, label: str) -> None:
        self.bar = tqdm(desc=label, bar_format="{desc} {elapsed}", file=sys.stderr, leave=False)
        # The ticker and the caller both draw the bar.
        self.lock = threading.Lock()
        self._stopped = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="kvkeep-progress", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stopped.wait(0.25):
            with self.lock:
                self.bar.refresh()

    def done(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self._ticker.join()
            self.bar.close()

    def report(self, p: PromptProgress) -> None:
        """Show the prompt's tokens evaluated (the cached ones included), and the rate of
        those this request evaluated."""
        with self.lock:
            if self._stopped.is_set():
                return
            bar = self.bar
            bar.bar_format = PROMPT_BAR
            bar.total = p.total
            bar.n = p.processed
            rate = f"{p.evaluated / p.elapsed:.0f} tokens/s" if p.elapsed > 0 and p.evaluated else ""
            bar.set_postfix_str(rate, refresh=False)
            bar.refresh()


class _Lines:
    """`label`, the seconds spent so far and the prompt's tokens as last reported, one line
    every LINE_EVERY seconds, by a thread of its own until `done`."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.latest: PromptProgress | None = None
        self._began = time.monotonic()
        self._stopped = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="kvkeep-progress", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stopped.wait(LINE_EVERY):
            line = f"{self.label}: {time.monotonic() - self._began:.0f} s"
            p = self.latest
            if p is not None:
                line += f", {p.processed}/{p.total} tokens"
                if p.elapsed > 0 and p.evaluated:
                    line += f", {p.evaluated / p.elapsed:.0f} tokens/s"
            print(line, file=sys.stderr, flush=True)

    def report(self, p: PromptProgress) -> None:
        self.latest = p

    def done(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self._ticker.join()


class Prefill:
    """What `evaluating` yields: `report` takes each PromptProgress the daemon sends, `done`
    ends the wait (the reply's first chunk)."""

    def __init__(self, report: Callable[[PromptProgress], None], done: Callable[[], None]) -> None:
        self.report = report
        self.done = done


@contextlib.contextmanager
def evaluating(label: str) -> Iterator[Prefill]:
    """`label` and the seconds spent so far, ticking; once the daemon reports the prompt's
    progress, a bar of its tokens with the rate they are evaluated at. The line is cleared
    at `done()` (or the block's end). Off a terminal, a line every LINE_EVERY seconds."""
    shown = _Ticking(label) if on_terminal() else _Lines(label)
    try:
        yield Prefill(shown.report, shown.done)
    finally:
        shown.done()


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
