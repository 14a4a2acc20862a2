"""What every command gets: the global options and the client made from them (`State`), and
failures shown as one `error:` line with exit status 1 (`Main`, `fail`)."""

from __future__ import annotations

import dataclasses
import errno
from typing import Any, NoReturn

import click

from kvkeep._client import Client
from kvkeep._connection import Tls, resolve_address
from kvkeep._errors import KvkeepError


@dataclasses.dataclass
class State:
    """The global options, and the client made from them on first use."""

    address: str
    timeout: float | None
    as_json: bool
    token: str | None = None
    tls: Tls | None = None
    _client: Client | None = None

    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.address, timeout=self.timeout, token=self.token, tls=self.tls)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def error_line(message: str) -> None:
    """Show a failure as one `error:` line on stderr."""
    # gRPC details can span lines; a failure is always exactly one line.
    click.echo(f"error: {' '.join(message.split())}", err=True)


def fail(message: str) -> NoReturn:
    """Show a failure, and exit with status 1."""
    error_line(message)
    raise click.exceptions.Exit(1)


def describe(e: KvkeepError, address: str) -> str:
    """What a failure's line says."""
    if e.code == "UNAVAILABLE" and not e.cause:  # a daemon that answered named its cause
        return f"cannot reach kvkeep at {address}: {e.message}"
    return e.message


class Main(click.Group):
    """The root group: failures become one ``error:`` line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KvkeepError as e:
            address = ctx.obj.address if isinstance(ctx.obj, State) else resolve_address(None)
            fail(describe(e, address))
        except OSError as e:
            # click itself handles a closed stdout (`kvkeep ... | head`).
            if e.errno == errno.EPIPE:
                raise
            fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
