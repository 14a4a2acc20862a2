"""The ``kvstash`` command: talk to a daemon, or start one with ``kvstash serve``."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import importlib
import json
import os
import sys
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, BinaryIO, NoReturn, TextIO, TypeVar, cast

import click

from kvstash import __version__
from kvstash._client import Client, Session
from kvstash._connection import Tls, resolve_address
from kvstash._convert import join_chunks
from kvstash._errors import KvstashError
from kvstash._files import open_destination
from kvstash._types import Chunk, SamplingParams

_F = TypeVar("_F", bound=Callable[..., Any])

#: Tokens a reply may take unless --max-tokens says otherwise: a chatty model would otherwise
#: talk to the end of the session's context, after which every turn is refused.
DEFAULT_MAX_TOKENS = 512


@dataclasses.dataclass
class _State:
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


def _error_line(message: str) -> None:
    # gRPC details can span lines; a failure is always exactly one line.
    click.echo(f"error: {' '.join(message.split())}", err=True)


def _fail(message: str) -> NoReturn:
    _error_line(message)
    raise click.exceptions.Exit(1)


def _describe(e: KvstashError, address: str) -> str:
    if e.code == "UNAVAILABLE" and not e.cause:  # a daemon that answered named its cause
        return f"cannot reach kvstash at {address}: {e.message}"
    return e.message


class _Main(click.Group):
    """The root group: failures become one ``error:`` line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KvstashError as e:
            address = ctx.obj.address if isinstance(ctx.obj, _State) else resolve_address(None)
            _fail(_describe(e, address))
        except OSError as e:
            # click itself handles a closed stdout (`kvstash ... | head`).
            if e.errno == errno.EPIPE:
                raise
            _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))


def _sampling_options(f: _F) -> _F:
    f = click.option("--seed", type=int, help="Sampling seed, for repeatable output.")(f)
    return click.option("--temperature", type=float, help="Sampling temperature; 0 is greedy.")(f)


def _max_tokens_option(f: _F) -> _F:
    return click.option(
        "--max-tokens",
        type=click.IntRange(min=0),
        metavar="N",
        default=DEFAULT_MAX_TOKENS,
        show_default=True,
        help="Stop each reply after N tokens (0: only at the end of the session's context).",
    )(f)


def _limit(max_tokens: int) -> int | None:
    return max_tokens or None


def _sampling(temperature: float | None, seed: int | None) -> SamplingParams | None:
    if temperature is None and seed is None:
        return None
    return SamplingParams(temperature=temperature, seed=seed)


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, default=dataclasses.asdict, ensure_ascii=False))


def _echo_fields(pairs: Sequence[tuple[str, object]]) -> None:
    for key, value in pairs:
        click.echo(f"{key}: {value}")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]
    for row in (headers, *rows):
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _time(ts: float) -> str:
    if not ts:
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _one_line(text: str, width: int = 100) -> str:
    flat = text.replace("\n", "\\n")
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _print_stream(stream: Iterator[Chunk]) -> None:
    """Echo a reply as it arrives, then why it ended unless it ended normally."""
    chunks: list[Chunk] = []
    try:
        for chunk in stream:
            click.echo(chunk.text, nl=False)
            chunks.append(chunk)
    finally:
        # End the line even when Ctrl-C cut the reply short.
        text = "".join(c.text for c in chunks)
        if text and not text.endswith("\n"):
            click.echo()
    finish_reason = join_chunks(chunks).finish_reason
    if finish_reason not in ("eos", "stop"):
        click.echo(f"[{finish_reason}]", err=True)


def _show(state: _State, stream: Generator[Chunk, None, None]) -> None:
    """Show a reply: streamed as text, or printed whole as JSON."""
    if state.as_json:
        _echo_json(join_chunks(stream))
        return
    with contextlib.closing(stream):
        _print_stream(stream)


def _has_chat_template(state: _State) -> bool:
    return state.client().info().has_chat_template


def _read_line(interactive: bool) -> str | None:
    """The next message, None at the end of input; the prompt only where someone types."""
    if not interactive:
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None
    try:
        return str(click.prompt("", prompt_suffix="> ", default="", show_default=False, err=True))
    except click.Abort:  # Ctrl-D, or Ctrl-C at the prompt
        click.echo(err=True)
        return None


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


@click.group(cls=_Main, context_settings={"auto_envvar_prefix": "KVSTASH"})
@click.option(
    "--address",
    envvar="KVSTASH_ADDRESS",
    metavar="TARGET",
    help="Daemon address, host:port or unix:PATH.  [default: 127.0.0.1:50051]",
)
@click.option("--timeout", type=float, metavar="SECONDS", help="Deadline of each call that is not a stream.")
@click.option(
    "--token",
    envvar="KVSTASH_TOKEN",
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
@click.version_option(__version__, prog_name="kvstash")
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
    """kvstash: one llama.cpp model, many chat sessions, and their checkpoints."""
    tls = Tls(tls_ca, tls_cert, tls_key) if use_tls or tls_ca or tls_cert or tls_key else None
    state = _State(resolve_address(address), timeout, as_json, token, tls)
    ctx.obj = state
    ctx.call_on_close(state.close)


@main.command()
@click.pass_obj
def info(state: _State) -> None:
    """Show the daemon's model, limits and counters."""
    result = state.client().info()
    if state.as_json:
        _echo_json(result)
    else:
        _echo_fields([(f.name, getattr(result, f.name)) for f in dataclasses.fields(result)])


@main.command()
@click.argument("prompt")
@click.option("--system", default="", help="System prompt.")
@_max_tokens_option
@_sampling_options
@click.option("--stop", multiple=True, help="Stop the reply at this string; repeatable.")
@click.option(
    "--grammar", "grammar_file", type=click.File(), help="The reply matches this GBNF grammar (a file)."
)
@click.option(
    "--json-schema",
    "schema_file",
    type=click.File(),
    help="The reply is JSON valid under this schema (a file).",
)
@click.pass_obj
def run(
    state: _State,
    prompt: str,
    system: str,
    max_tokens: int,
    temperature: float | None,
    seed: int | None,
    stop: tuple[str, ...],
    grammar_file: TextIO | None,
    schema_file: TextIO | None,
) -> None:
    """Answer PROMPT (- reads it from stdin) in a new session, closed afterwards.

    On a model without a chat template (a base model) the text is completed instead, after
    the --system text if any.
    """
    if prompt == "-":
        prompt = sys.stdin.read()
    if grammar_file is not None and schema_file is not None:
        raise click.UsageError("give --grammar or --json-schema, not both")
    grammar = grammar_file.read() if grammar_file is not None else None
    json_schema = schema_file.read() if schema_file is not None else None
    chat = _has_chat_template(state)
    if not chat:
        click.echo("the model has no chat template: completing the text", err=True)
    session = state.client().create_session(system, sampling=_sampling(temperature, seed))
    options: dict[str, Any] = {
        "max_tokens": _limit(max_tokens),
        "stop": stop,
        "grammar": grammar,
        "json_schema": json_schema,
    }
    try:
        _show(state, session.chat_stream(prompt, **options) if chat else session.generate(prompt, **options))
    finally:
        session.close()


@main.command()
@click.argument("session_id", required=False)
@click.option("--system", default="", help="System prompt of the new session.")
@_max_tokens_option
@_sampling_options
@click.pass_obj
def chat(
    state: _State,
    session_id: str | None,
    system: str,
    max_tokens: int,
    temperature: float | None,
    seed: int | None,
) -> None:
    """Chat in SESSION_ID, or in a new session, one line per message.

    Ctrl-C stops a reply; Ctrl-D, or Ctrl-C at the prompt, quits. The session stays open;
    come back with `kvstash chat SESSION_ID`. The exit status is 1 if any turn failed.
    Messages may be piped in, one a line (then there is no prompt).
    """
    client = state.client()
    if not _has_chat_template(state):
        _fail("the model has no chat template, so it cannot chat; `kvstash run PROMPT` completes text")
    sampling = _sampling(temperature, seed)
    if session_id is None:
        session = client.create_session(system, sampling=sampling)
        sampling = None  # the new session keeps it as its default
        click.echo(f"session {session.session_id}", err=True)
    elif system:
        raise click.UsageError("--system applies only to a new session")
    else:
        session = client.session(session_id)

    failed = False
    interactive = sys.stdin.isatty()
    while (line := _read_line(interactive)) is not None:
        if not line.strip():
            continue
        try:
            _show(state, session.chat_stream(line, max_tokens=_limit(max_tokens), sampling=sampling))
        except KeyboardInterrupt:
            click.echo("[interrupted]", err=True)
        except KvstashError as e:
            _error_line(_describe(e, state.address))
            failed = True
    if failed:
        raise click.exceptions.Exit(1)


@main.group("session")
def session_group() -> None:
    """Create, list, show, fork and close sessions."""


@session_group.command("create")
@click.option("--system", default="", help="System prompt.")
@click.option("--persistent", is_flag=True, help="Keep the session across daemon restarts.")
@_sampling_options
@click.option("--stop", multiple=True, help="Default stop string; repeatable.")
@click.option(
    "--context-policy",
    type=click.Choice(["error", "truncate"]),
    default="error",
    show_default=True,
    help="A chat turn that does not fit the context: refuse it, or drop the oldest turns.",
)
@click.pass_obj
def session_create(
    state: _State,
    system: str,
    persistent: bool,
    temperature: float | None,
    seed: int | None,
    stop: tuple[str, ...],
    context_policy: str,
) -> None:
    """Open a session and print its id."""
    session = state.client().create_session(
        system,
        sampling=_sampling(temperature, seed),
        stop=stop,
        persistent=persistent,
        context_policy=context_policy,
    )
    if state.as_json:
        _echo_json(session.info())
    else:
        click.echo(session.session_id)


@session_group.command("list")
@click.pass_obj
def session_list(state: _State) -> None:
    """List the daemon's sessions."""
    sessions = state.client().list_sessions()
    if state.as_json:
        _echo_json(sessions)
        return
    _table(
        ("SESSION", "RESIDENCY", "TOKENS", "CHECKPOINTS", "PERSISTENT", "LAST USED"),
        [
            (
                s.session_id,
                s.residency,
                f"{s.n_tokens}/{s.n_ctx}",
                str(s.n_checkpoints),
                "yes" if s.persistent else "no",
                _time(s.last_used_at),
            )
            for s in sessions
        ],
    )


@session_group.command("show")
@click.argument("session_id")
@click.pass_obj
def session_show(state: _State, session_id: str) -> None:
    """Show a session's state and conversation."""
    s = Session(state.client(), session_id).info()
    if state.as_json:
        _echo_json(s)
        return
    sampling = dataclasses.asdict(s.sampling)
    _echo_fields(
        [
            ("session", s.session_id),
            ("persistent", "yes" if s.persistent else "no"),
            ("tokens", f"{s.n_tokens}/{s.n_ctx}"),
            ("residency", s.residency),
            ("created", _time(s.created_at)),
            ("last used", _time(s.last_used_at)),
            ("checkpoints", s.n_checkpoints),
            ("head checkpoint", s.head_checkpoint_id or "-"),
            ("sampling", " ".join(f"{k}={v}" for k, v in sampling.items() if v is not None) or "-"),
            ("stop", ", ".join(json.dumps(x, ensure_ascii=False) for x in s.stop) or "-"),
            ("messages", len(s.messages)),
        ]
    )
    for m in s.messages:
        click.echo(f"  {m.role}: {_one_line(m.content)}")


@session_group.command("close")
@click.argument("session_id")
@click.pass_obj
def session_close(state: _State, session_id: str) -> None:
    """Close a session: its history, head and checkpoints are deleted."""
    Session(state.client(), session_id).close()
    if state.as_json:
        _echo_json({"session_id": session_id, "closed": True})


@session_group.command("fork")
@click.argument("session_id", required=False)
@click.option(
    "--checkpoint", "checkpoint_id", help="Fork this checkpoint (an imported one too), not a session's state."
)
@click.option("--persistent", is_flag=True, help="Keep the new session across daemon restarts.")
@click.pass_obj
def session_fork(state: _State, session_id: str | None, checkpoint_id: str | None, persistent: bool) -> None:
    """Copy SESSION_ID's current state, or a checkpoint, into a new session; print its id."""
    client = state.client()
    if checkpoint_id is not None:
        fork = client.fork_session(checkpoint_id=checkpoint_id, persistent=persistent)
    elif session_id is not None:
        fork = client.fork_session(session_id, persistent=persistent)
    else:
        raise click.UsageError("give a SESSION_ID or --checkpoint ID")
    if state.as_json:
        _echo_json(fork.info())
    else:
        click.echo(fork.session_id)


@main.group("checkpoint")
def checkpoint_group() -> None:
    """Save, list, restore, delete, export and import checkpoints."""


@checkpoint_group.command("create")
@click.argument("session_id")
@click.option("--label", help="A name to remember the checkpoint by.")
@click.pass_obj
def checkpoint_create(state: _State, session_id: str, label: str | None) -> None:
    """Save a session's state and print the checkpoint id."""
    checkpoint = Session(state.client(), session_id).checkpoint(label)
    if state.as_json:
        _echo_json(checkpoint)
    else:
        click.echo(checkpoint.checkpoint_id)


@checkpoint_group.command("list")
@click.argument("session_id")
@click.pass_obj
def checkpoint_list(state: _State, session_id: str) -> None:
    """List a session's checkpoints."""
    checkpoints = state.client().list_checkpoints(session_id)
    if state.as_json:
        _echo_json(checkpoints)
        return
    _table(
        ("CHECKPOINT", "LABEL", "TOKENS", "WRITTEN", "REFERENCED", "CREATED"),
        [
            (
                c.checkpoint_id,
                c.label or "-",
                str(c.n_tokens),
                _size(c.bytes_written),
                _size(c.bytes_referenced),
                _time(c.created_at),
            )
            for c in checkpoints
        ],
    )


@checkpoint_group.command("restore")
@click.argument("session_id")
@click.argument("checkpoint_id")
@click.pass_obj
def checkpoint_restore(state: _State, session_id: str, checkpoint_id: str) -> None:
    """Put a session back in the state a checkpoint saved."""
    restored = Session(state.client(), session_id).restore(checkpoint_id)
    if state.as_json:
        _echo_json(restored)


@checkpoint_group.command("delete")
@click.argument("checkpoint_id")
@click.pass_obj
def checkpoint_delete(state: _State, checkpoint_id: str) -> None:
    """Delete a checkpoint."""
    state.client().delete_checkpoint(checkpoint_id)
    if state.as_json:
        _echo_json({"checkpoint_id": checkpoint_id, "deleted": True})


@checkpoint_group.command("export")
@click.argument("checkpoint_id")
@click.argument("file", type=click.Path(dir_okay=False))
@click.pass_obj
def checkpoint_export(state: _State, checkpoint_id: str, file: str) -> None:
    """Write a checkpoint to FILE, self-contained, for import elsewhere."""
    with _progress("exporting", None) as update:
        if update is None:
            written = state.client().export_checkpoint(checkpoint_id, file)
        else:
            with open_destination(file) as f:
                written = state.client().export_checkpoint(checkpoint_id, _counted(f, update))
    if state.as_json:
        _echo_json({"checkpoint_id": checkpoint_id, "path": file, "bytes": written})
    else:
        click.echo(f"wrote {_size(written)} to {file}")


@checkpoint_group.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.pass_obj
def checkpoint_import(state: _State, file: str) -> None:
    """Load an exported checkpoint and print its id."""
    with _progress("importing", os.path.getsize(file)) as update, open(file, "rb") as f:
        checkpoint = state.client().import_checkpoint(f if update is None else _counted(f, update))
    if state.as_json:
        _echo_json(checkpoint)
    else:
        click.echo(checkpoint.checkpoint_id)


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.pass_context
def serve(ctx: click.Context) -> None:
    """Run the daemon (from kvstash[daemon]); `kvstash serve --help` lists its options."""
    # Imported here: the client must work where the daemon and llama.cpp are not installed.
    # The server module imports every dependency of the daemon, so a missing one shows here.
    try:
        importlib.import_module("kvstashd.server")
        daemon_cli = importlib.import_module("kvstashd.cli")
    except ImportError as e:
        missing = f"no module {e.name!r}" if e.name else str(e)
        _fail(f"kvstash serve needs the daemon's dependencies ({missing}): pip install 'kvstash[daemon]'")
    daemon_cli.main(ctx.args, prog_name="kvstash serve")
