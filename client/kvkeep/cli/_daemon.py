"""`kvkeep info` and `kvkeep serve`: what the daemon says of itself, and running one."""

from __future__ import annotations

import dataclasses
import importlib

import click

from kvkeep.cli._context import State, fail
from kvkeep.cli._output import echo_fields, echo_json


@click.command()
@click.pass_obj
def info(state: State) -> None:
    """Show the daemon's model, limits and counters."""
    result = state.client().info()
    if state.as_json:
        echo_json(result)
    else:
        echo_fields([(f.name, getattr(result, f.name)) for f in dataclasses.fields(result)])


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.pass_context
def serve(ctx: click.Context) -> None:
    """Run the daemon (from kvkeep[daemon]); `kvkeep serve --help` lists its options."""
    # Imported here: the client must work where the daemon and llama.cpp are not installed.
    # The server module imports every dependency of the daemon, so a missing one shows here;
    # the options alone (kvkeepd.cli) need none of them, so --help works everywhere.
    daemon_cli = importlib.import_module("kvkeepd.cli")
    try:
        importlib.import_module("kvkeepd.server")
    except ImportError as e:
        missing = f"no module {e.name!r}" if e.name else str(e)
        needs = f"kvkeep serve needs the daemon's dependencies ({missing}): pip install 'kvkeep[daemon]'"
        if "--help" not in ctx.args:
            fail(needs)
        click.echo(f"note: {needs}", err=True)
    daemon_cli.main(ctx.args, prog_name="kvkeep serve")
