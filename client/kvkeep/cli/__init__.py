"""The ``kvkeep`` command: talk to a daemon, or start one with ``kvkeep serve``.

The root group and its global options are here; each command group is a module of its own:
`_chat` (run, chat), `_session`, `_checkpoint`, `_response`, `_daemon` (info, serve).
"""

from __future__ import annotations

import click

from kvkeep import __version__
from kvkeep.cli._chat import chat, run
from kvkeep.cli._checkpoint import checkpoint_group
from kvkeep.cli._context import Main, State, global_options, with_global_options
from kvkeep.cli._daemon import info, pull, serve
from kvkeep.cli._options import DEFAULT_MAX_TOKENS
from kvkeep.cli._response import response_group
from kvkeep.cli._session import session_group

__all__ = ["DEFAULT_MAX_TOKENS", "main"]


@click.group(cls=Main, context_settings={"auto_envvar_prefix": "KVKEEP"})
@global_options
@click.version_option(__version__, prog_name="kvkeep")
@click.pass_context
def main(
    ctx: click.Context,
    address_option: str | None,
    timeout: float | None,
    token: str | None,
    use_tls: bool,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    as_json: bool,
) -> None:
    """kvkeep: one llama.cpp model, many chat sessions, and their checkpoints.

    Its options go before the command or after it (`kvkeep session create --json`).

    \b
    Shell completion, in ~/.bashrc (or zsh_source in ~/.zshrc):
      eval "$(_KVKEEP_COMPLETE=bash_source kvkeep)"
    and for fish, in ~/.config/fish/completions/kvkeep.fish:
      _KVKEEP_COMPLETE=fish_source kvkeep | source
    """
    state = State(address_option, timeout, as_json, token, use_tls, tls_ca, tls_cert, tls_key)
    ctx.obj = state
    ctx.call_on_close(state.close)


for command in (info, run, chat, session_group, checkpoint_group, response_group):
    with_global_options(command)
    main.add_command(command)
# `kvkeep serve` takes the daemon's own options (its --address is where it listens); `kvkeep
# pull` talks to the Hub, not to a daemon.
main.add_command(serve)
main.add_command(pull)
