"""`kvkeep checkpoint`: save, list, restore, delete, export and import checkpoints."""

from __future__ import annotations

import os

import click

from kvkeep._client import Session
from kvkeep._files import open_destination
from kvkeep.cli._context import State
from kvkeep.cli._output import echo_json, format_size, format_time, one_line, table
from kvkeep.cli._progress import counted, moving_bytes


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
    """Put a session back in the state a checkpoint saved, and say what it holds now."""
    restored = Session(state.client(), session_id).restore(checkpoint_id)
    if state.as_json:
        echo_json(restored)
        return
    click.echo(
        f"restored {session_id} to {checkpoint_id}: {restored.n_tokens} tokens, "
        f"{len(restored.messages)} messages"
    )
    if restored.messages:
        last = restored.messages[-1]
        click.echo(f"  last: {last.role}: {one_line(last.content)}")


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
    client = state.client()
    # The export's size is known at its end only; the blocks it carries are most of it.
    total = next(
        (c.bytes_referenced for c in client.list_checkpoints() if c.checkpoint_id == checkpoint_id), None
    )
    with moving_bytes("exporting", total or None) as update:
        if update is None:
            written = client.export_checkpoint(checkpoint_id, file)
        else:
            with open_destination(file) as f:
                written = client.export_checkpoint(checkpoint_id, counted(f, update))
    if state.as_json:
        echo_json({"checkpoint_id": checkpoint_id, "path": file, "bytes": written})
    else:
        click.echo(f"wrote {format_size(written)} to {file}")


@checkpoint_group.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.pass_obj
def checkpoint_import(state: State, file: str) -> None:
    """Load an exported checkpoint and print its id."""
    with moving_bytes("importing", os.path.getsize(file)) as update, open(file, "rb") as f:
        checkpoint = state.client().import_checkpoint(f if update is None else counted(f, update))
    if state.as_json:
        echo_json(checkpoint)
    else:
        click.echo(checkpoint.checkpoint_id)
