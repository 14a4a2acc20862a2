"""`kvkeep serve`: flags > environment (KVKEEP_*) > config file > defaults -> Settings -> the daemon.

The flags are made from the settings' declarations (kvkeepd.config.settings); every failure before
the daemon serves, a bad setting included, is one `error:` line on stderr and a non-zero exit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from kvkeepd.config import resolution
from kvkeepd.config import settings as config
from kvkeepd.config.sections import SECTIONS
from kvkeepd.config.settings import ConfigError
from kvkeepd.model.choice import hf_ref

F = TypeVar("F", bound=Callable[..., Any])

#: Exit status of a bad command line or setting (click's own for usage errors).
USAGE = 2


def setting_options(f: F) -> F:
    """One flag per setting. Each is None unless given, so that `resolution.resolve` knows which
    came from the command line; click reads no environment variables for them."""
    for option in reversed(config.options()):
        facts = [f"default: {option.shown_default()}", option.bounds(), f"env {option.env}"]
        common: dict[str, Any] = {
            "default": None,
            "allow_from_autoenv": False,
            "show_default": False,
            "help": f"{option.spec.help} [{'; '.join(filter(None, facts))}]",
        }
        if option.kind is bool:
            f = click.option(f"{option.flag}/--no-{option.key}", option.field, **common)(f)
        else:
            f = click.option(option.flag, option.field, type=str, metavar=option.metavar, **common)(f)
    return f


class SectionedCommand(click.Command):
    """--help lists the settings in their sections (kvkeepd.config.sections), the common ones
    first in each, then the flags that are no setting."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        by_key = {o.key: o.field for o in config.options()}
        params = {p.name: p for p in self.get_params(ctx)}
        shown: set[str] = set()
        for section in SECTIONS:
            rows = [_row(ctx, params[by_key[key]]) for key in section.keys if by_key.get(key) in params]
            shown.update(by_key[key] for key in section.keys if key in by_key)
            with formatter.section(section.title):
                formatter.write_dl([r for r in rows if r is not None])
        others = [_row(ctx, p) for name, p in params.items() if name not in shown]
        with formatter.section("Other options"):
            formatter.write_dl([r for r in others if r is not None])


def _row(ctx: click.Context, param: click.Parameter) -> tuple[str, str] | None:
    return param.get_help_record(ctx)


@click.command(cls=SectionedCommand, context_settings={"max_content_width": 110})
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="KVKEEP_CONFIG",
    help="TOML file of settings (keys are the flags' names: slots = 8). [env KVKEEP_CONFIG]",
)
@click.option(
    "--print-config",
    is_flag=True,
    help="Print every setting's effective value and where it came from (flag, environment, file, "
    "default) as TOML, and exit.",
)
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the bound port here once serving (for supervisors and tests).",
)
@setting_options
def serve(config_file: Path | None, print_config: bool, ready_file: Path | None, **flags: Any) -> None:
    """Run the kvkeep daemon.

    Every setting is a flag, an environment variable (--slots: KVKEEP_SLOTS) and a key of the
    --config file; a flag wins over the environment, which wins over the file. Byte sizes take
    KiB, MiB, GiB or TiB suffixes.
    """
    try:
        resolved = resolution.resolve(flags, os.environ, config_file)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if print_config:
        click.echo(resolved.describe())
        return
    settings = resolved.settings
    from kvkeepd import logs
    from kvkeepd.errors import KvkeepError
    from kvkeepd.files import StateDirError
    from kvkeepd.server import serve as run_server
    from kvkeepd.sessions.tenants import AuthFileError

    logs.configure(settings.log_level, settings.log_json)
    names: tuple[str, ...] = ()
    ref = hf_ref(settings.model_path)
    if ref is not None:
        from kvkeepd.model.hub import HubError, fetch

        try:
            path = fetch(ref, settings.model_cache)
        except HubError as e:
            raise click.ClickException(str(e)) from None
        try:
            settings = dataclasses.replace(settings, model_path=path).validate()
        except ConfigError as e:
            raise click.ClickException(f"{ref}: {e.problem}") from None
        names = (f"{ref.repo_id}:{ref.quant}" if ref.quant else ref.repo_id,)
    try:
        asyncio.run(run_server(settings, ready_file, names))
    except ConfigError as e:  # found at start: a file a setting names is not what it should be
        raise click.UsageError(str(e)) from None
    except (OSError, AuthFileError, StateDirError, KvkeepError) as e:
        raise click.ClickException(str(e)) from None


def main(args: Sequence[str] | None = None, prog_name: str | None = None) -> None:
    """Run `kvkeep serve`; a failure is one `error:` line on stderr."""
    try:
        status = serve.main(args=args, prog_name=prog_name, standalone_mode=False)
    except click.ClickException as e:
        # A usage error's message can span lines (a file's TOML error); a failure is one line.
        click.echo(f"error: {' '.join(e.format_message().split())}", err=True)
        sys.exit(e.exit_code)
    except click.Abort:
        sys.exit(130)
    sys.exit(status if isinstance(status, int) else 0)
