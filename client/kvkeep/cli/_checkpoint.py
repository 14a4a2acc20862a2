"""`kvkeep checkpoint`: save, list, restore, delete, export and import checkpoints."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import BinaryIO, cast

import click

from kvkeep._client import Session
from kvkeep._files import open_destination
from kvkeep.cli._context import State
from kvkeep.cli._output import echo_json, format_size, format_time, table


@contextlib.contextmanager
def _progress(label: str, total: int | None) -> Iterator[Callable[[int], None] | None]:
    """A bar of bytes moved on stderr when it is a terminal (None otherwise): update(n)."""
    if not sys.stderr.isatty():
        yield None
        return
    # Without a length (an export's size is known only at its end) the bar pulses.
    unknown: Iterator[int] = iter(int, 1)
    with click.progressbar(
        unknown if total is None else None,
        length=total,
        label=label,
        file=sys.stderr,
        show_pos=True,
        show_percent=total is not None,
        show_eta=total is not None,
    ) as bar:
        yield bar.update


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


def _counted(f: BinaryIO, update: Callable[[int], None]) -> BinaryIO:
    # The SDK only reads or writes the file it is given; a counting wrapper is enough.
    return cast(BinaryIO, _Counted(f, update))


@click.group("checkpoint")
def checkpoint_group() -> None:
    """Save, list, restore, delete, export and import checkpoints."""


@checkpoint_group.command("create")
@click.argument("session_id")
@click.option("--label", help="A name to remember the checkpoint by.")
@click.pass_obj
def checkpoint_create(state: State, session_id: str, label: str | None) -> None:
    """Save a session's state and print the checkpoint id."""
    checkpoint = Session(state.client(), session_id).checkpoint(label)
    if state.as_json:
        echo_json(checkpoint)
    else:
        click.echo(checkpoint.checkpoint_id)


@checkpoint_group.command("list")
@click.argument("session_id")
@click.pass_obj
def checkpoint_list(state: State, session_id: str) -> None:
    """List a session's checkpoints."""
    checkpoints = state.client().list_checkpoints(session_id)
    if state.as_json:
        echo_json(checkpoints)
        return
    table(
        ("CHECKPOINT", "LABEL", "TOKENS", "WRITTEN", "REFERENCED", "CREATED"),
        [
            (
                c.checkpoint_id,
                c.label or "-",
                str(c.n_tokens),
                format_size(c.bytes_written),
                format_size(c.bytes_referenced),
                format_time(c.created_at),
            )
            for c in checkpoints
        ],
    )


@checkpoint_group.command("restore")
@click.argument("session_id")
@click.argument("checkpoint_id")
@click.pass_obj
def checkpoint_restore(state: State, session_id: str, checkpoint_id: str) -> None:
    """Put a session back in the state a checkpoint saved."""
    restored = Session(state.client(), session_id).restore(checkpoint_id)
    if state.as_json:
        echo_json(restored)


@checkpoint_group.command("delete")
@click.argument("checkpoint_id")
@click.pass_obj
def checkpoint_delete(state: State, checkpoint_id: str) -> None:
    """Delete a checkpoint."""
    state.client().delete_checkpoint(checkpoint_id)
    if state.as_json:
        echo_json({"checkpoint_id": checkpoint_id, "deleted": True})


@checkpoint_group.command("export")
@click.argument("checkpoint_id")
@click.argument("file", type=click.Path(dir_okay=False))
@click.pass_obj
def checkpoint_export(state: State, checkpoint_id: str, file: str) -> None:
    """Write a checkpoint to FILE, self-contained, for import elsewhere."""
    with _progress("exporting", None) as update:
        if update is None:
            written = state.client().export_checkpoint(checkpoint_id, file)
        else:
            with open_destination(file) as f:
                written = state.client().export_checkpoint(checkpoint_id, _counted(f, update))
    if state.as_json:
        echo_json({"checkpoint_id": checkpoint_id, "path": file, "bytes": written})
    else:
        click.echo(f"wrote {format_size(written)} to {file}")


@checkpoint_group.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.pass_obj
def checkpoint_import(state: State, file: str) -> None:
    """Load an exported checkpoint and print its id."""
    with _progress("importing", os.path.getsize(file)) as update, open(file, "rb") as f:
        checkpoint = state.client().import_checkpoint(f if update is None else _counted(f, update))
    if state.as_json:
        echo_json(checkpoint)
    else:
        click.echo(checkpoint.checkpoint_id)
