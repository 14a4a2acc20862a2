"""What every command gets: the global options and the client made from them (`State`), and
failures shown as one `error:` line with exit status 1 (`Main`, `fail`).

The global options (`--json`, `--address`, `--token`, ...) go before the command or after it:
`kvkeep --json session create` and `kvkeep session create --json` are the same. `Main` gives
each command a copy of them that, when given, overrides the value before the command.
"""

from __future__ import annotations

import dataclasses
import errno
import signal
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from kvkeep._client import Client
from kvkeep._connection import Tls, resolve_address
from kvkeep._errors import KvkeepError

_F = TypeVar("_F", bound=Callable[..., Any])

#: The exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 128 + signal.SIGINT


@dataclasses.dataclass
class State:
    """The global options, and the client made from them on first use."""

    address_option: str | None = None
    timeout: float | None = None
    as_json: bool = False
    token: str | None = None
    use_tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    _client: Client | None = None

    @property
    def address(self) -> str:
        """Where the daemon is: --address, else $KVKEEP_ADDRESS, else the default."""
        return resolve_address(self.address_option)

    @property
    def tls(self) -> Tls | None:
        if self.use_tls or self.tls_ca or self.tls_cert or self.tls_key:
            return Tls(self.tls_ca, self.tls_cert, self.tls_key)
        return None

    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.address, timeout=self.timeout, token=self.token, tls=self.tls)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def global_options(f: _F) -> _F:
    """The global options, as the root group takes them (with their environment variables)."""
    for option in reversed(_global_options(at_root=True)):
        f = option(f)
    return f


def _global_options(*, at_root: bool) -> list[Callable[[_F], _F]]:
    """The global options; after a command (`at_root` False) they set the State the root made
    and, but for --json, stay out of the command's --help."""
    common: dict[str, Any] = {}
    if not at_root:
        common = {"expose_value": False, "callback": _override, "hidden": True, "allow_from_autoenv": False}
    shown = {**common, "hidden": False}

    def env(name: str) -> dict[str, Any]:
        return {"envvar": name} if at_root else {}

    return [
        click.option(
            "--address",
            "address_option",
            metavar="TARGET",
            help="Daemon address, host:port or unix:PATH.  [default: 127.0.0.1:50051; env KVKEEP_ADDRESS]",
            **env("KVKEEP_ADDRESS"),
            **common,
        ),
        click.option(
            "--timeout",
            type=float,
            metavar="SECONDS",
            help="Deadline of each call that is not a stream.",
            **common,
        ),
        click.option(
            "--token",
            metavar="TOKEN",
            help="Bearer token of your tenant (daemons with --auth-file).  [env KVKEEP_TOKEN]",
            **env("KVKEEP_TOKEN"),
            **common,
        ),
        click.option(
            "--tls",
            "use_tls",
            is_flag=True,
            help="Connect with TLS (implied by the --tls-* files).",
            **common,
        ),
        click.option(
            "--tls-ca",
            type=click.Path(dir_okay=False),
            help="CA certificate (PEM) of the daemon's certificate.",
            **common,
        ),
        click.option(
            "--tls-cert",
            type=click.Path(dir_okay=False),
            help="Client certificate (PEM), for mutual TLS.",
            **common,
        ),
        click.option(
            "--tls-key", type=click.Path(dir_okay=False), help="Client key (PEM), for mutual TLS.", **common
        ),
        click.option(
            "--json",
            "as_json",
            is_flag=True,
            help="Print results as JSON (before or after the command).",
            **(shown if not at_root else {}),
        ),
    ]


def _override(ctx: click.Context, param: click.Parameter, value: object) -> None:
    """A global option given after the command: it wins over the one before."""
    if value is None or value is False:
        return
    state = ctx.find_object(State)
    if state is not None and param.name is not None:
        setattr(state, param.name, value)


def with_global_options(command: click.Command) -> None:
    """Let `command` (and every command under it) take the global options too."""
    for option in _global_options(at_root=False):
        option(command)
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            with_global_options(sub)


def error_line(message: str) -> None:
    """Show a failure as one `error:` line on stderr."""
    # gRPC details can span lines; a failure is always exactly one line.
    click.echo(f"error: {' '.join(message.split())}", err=True)


def fail(message: str) -> NoReturn:
    """Show a failure, and exit with status 1."""
    error_line(message)
    raise click.exceptions.Exit(1)


def describe(e: KvkeepError, address: str) -> str:
    """What a failure's line says, with what to do next where that is known."""
    if e.code == "UNAVAILABLE" and not e.cause:  # a daemon that answered named its cause
        # gRPC's text ends with the socket's own reason ("...: Connection refused").
        reason = e.message.rsplit(": ", 1)[-1].strip() or e.message
        return (
            f"cannot reach kvkeep at {address} ({reason}): start a daemon with `kvkeep serve`, "
            "or give its address with --address or KVKEEP_ADDRESS"
        )
    return e.message


class Main(click.Group):
    """The root group: failures become one ``error:`` line on stderr and exit status 1;
    Ctrl-C ends a command quietly with status 130."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KvkeepError as e:
            address = ctx.obj.address if isinstance(ctx.obj, State) else resolve_address(None)
            fail(describe(e, address))
        except KeyboardInterrupt:
            # click would print "Aborted!" and exit 1; a shell reports Ctrl-C as 130.
            raise click.exceptions.Exit(INTERRUPTED) from None
        except OSError as e:
            # click itself handles a closed stdout (`kvkeep ... | head`).
            if e.errno == errno.EPIPE:
                raise
            fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
