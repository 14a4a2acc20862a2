"""The ``kvkeep`` command: talk to a daemon, or start one with ``kvkeep serve``.

The root group and its global options are here; each command group is a module of its own:
`_chat` (run, chat), `_session`, `_checkpoint`, `_daemon` (info, serve).
"""

from __future__ import annotations

import click

from kvkeep import __version__
from kvkeep._connection import Tls, resolve_address
from kvkeep.cli._chat import chat, run
from kvkeep.cli._checkpoint import checkpoint_group
from kvkeep.cli._context import Main, State
from kvkeep.cli._daemon import info, serve
from kvkeep.cli._options import DEFAULT_MAX_TOKENS
from kvkeep.cli._session import session_group

__all__ = ["DEFAULT_MAX_TOKENS", "main"]


@click.group(cls=Main, context_settings={"auto_envvar_prefix": "KVKEEP"})
@click.option(
    "--address",
    envvar="KVKEEP_ADDRESS",
    metavar="TARGET",
    help="Daemon address, host:port or unix:PATH.  [default: 127.0.0.1:50051]",
)
@click.option("--timeout", type=float, metavar="SECONDS", help="Deadline of each call that is not a stream.")
@click.option(
    "--token",
    envvar="KVKEEP_TOKEN",
    metavar="TOKEN",
    help="Bearer token of your tenant (daemons with --auth-file).",
)
@click.option("--tls", "use_tls", is_flag=True, help="Connect with TLS (implied by the --tls-* files).")
@click.option(
    "--tls-ca", type=click.Path(dir_okay=False), help="CA certificate (PEM) of the daemon's certificate."
)
@click.option("--tls-cert", type=click.Path(dir_okay=False), help="Client certificate (PEM), for mutual TLS.")
@click.option("--tls-key", type=click.Path(dir_okay=False), help="Client key (PEM), for mutual TLS.")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
@click.version_option(__version__, prog_name="kvkeep")
@click.pass_context
def main(
    ctx: click.Context,
    address: str | None,
    timeout: float | None,
    token: str | None,
    use_tls: bool,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    as_json: bool,
) -> None:
    """kvkeep: one llama.cpp model, many chat sessions, and their checkpoints."""
    tls = Tls(tls_ca, tls_cert, tls_key) if use_tls or tls_ca or tls_cert or tls_key else None
    state = State(resolve_address(address), timeout, as_json, token, tls)
    ctx.obj = state
    ctx.call_on_close(state.close)


for command in (info, run, chat, session_group, checkpoint_group, serve):
    main.add_command(command)
