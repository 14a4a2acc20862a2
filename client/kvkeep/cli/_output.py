"""How results are printed: JSON, fields, tables, sizes and times, and replies as they arrive."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import click

from kvkeep._convert import join_chunks
from kvkeep._operations import OnProgress
from kvkeep._types import Chunk
from kvkeep.cli._context import State
from kvkeep.cli._progress import evaluating

#: What makes a reply's request: given what takes the prompt's progress (None: none asked).
Start = Callable[[OnProgress | None], Generator[Chunk, None, None]]


def echo_json(value: Any) -> None:
    """A result (dataclasses too) as one line of JSON."""
    click.echo(json.dumps(value, default=dataclasses.asdict, ensure_ascii=False))


def echo_fields(pairs: Sequence[tuple[str, object]]) -> None:
    """One `key: value` line per pair."""
    for key, value in pairs:
        click.echo(f"{key}: {value}")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Rows under headers, in columns as wide as their widest cell."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]
    for row in (headers, *rows):
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def format_time(ts: float) -> str:
    """A timestamp in local time, `-` for none."""
    if not ts:
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def format_age(ts: float, now: float) -> str:
    """How long ago a timestamp was, in its largest whole unit (s, min, h, d); `-` for none."""
    if not ts:
        return "-"
    seconds = max(0, int(now - ts))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


def format_until(ts: float, now: float) -> str:
    """How long until a timestamp, in its largest whole unit (`in 5 min`); `never` for none,
    `now` once it has passed."""
    if not ts:
        return "never"
    seconds = int(ts - now)
    if seconds <= 0:
        return "now"
    return "in " + format_age(now, now + seconds)


def format_size(n: int) -> str:
    """Bytes in B, KiB, MiB or GiB."""
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def one_line(text: str, width: int = 100) -> str:
    """Text on one line (newlines as \\n), cut to `width` characters."""
    flat = text.replace("\n", "\\n")
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _print_stream(stream: Iterator[Chunk], done: Callable[[], None]) -> None:
    """Echo a reply as it arrives, then why it ended unless it ended normally; `done` at its
    first chunk."""
    chunks: list[Chunk] = []
    try:
        for chunk in stream:
            done()
            click.echo(chunk.text, nl=False)
            chunks.append(chunk)
    finally:
        # End the line even when Ctrl-C cut the reply short.
        text = "".join(c.text for c in chunks)
        if text and not text.endswith("\n"):
            click.echo()
    reply = join_chunks(chunks)
    for call in reply.tool_calls:  # one JSON line per call the reply made
        echo_json({"id": call.call_id, "name": call.name, "arguments": call.arguments})
    if reply.finish_reason not in ("eos", "stop", "tool_calls"):
        click.echo(f"[{reply.finish_reason}]", err=True)


def show_reply(state: State, start: Start) -> None:
    """Show the reply of the request `start` makes: streamed as text, or printed whole as JSON.
    Until its first token, stderr shows the prompt's evaluation: how long it has taken, and
    its tokens as the daemon reports them (a line every few seconds when not a terminal)."""
    if state.as_json:
        echo_json(join_chunks(start(None)))
        return
    with evaluating("evaluating the prompt") as prefill:
        stream = start(prefill.report)
        with contextlib.closing(stream):
            _print_stream(stream, prefill.done)
