"""`kvkeep session`: create, list, show, fork and close sessions."""

from __future__ import annotations

import dataclasses
import json
import time

import click

from kvkeep._client import Session
from kvkeep.cli._context import State
from kvkeep.cli._options import sampling_options, sampling_params
from kvkeep.cli._output import (
    echo_fields,
    echo_json,
    format_age,
    format_time,
    format_until,
    one_line,
    table,
)


@click.group("session")
def session_group() -> None:
    """Create, list, show, fork and close sessions."""


@session_group.command("create")
@click.option("--system", default="", help="System prompt.")
@click.option("--persistent", is_flag=True, help="Keep the session across daemon restarts.")
@sampling_options
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
    state: State,
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
        sampling=sampling_params(temperature, seed),
        stop=stop,
        persistent=persistent,
        context_policy=context_policy,
    )
    if state.as_json:
        echo_json(session.info())
    else:
        click.echo(session.session_id)


@session_group.command("list")
@click.pass_obj
def session_list(state: State) -> None:
    """List your sessions: the daemon's, and with daemons sharing a catalog, the persistent
    ones of every daemon (HELD BY: which daemon holds each, `-` while none does). WHERE is
    where its state is now: `slot N`, `dock`, `ram`, `disk`, `shared store` or `history only`.
    AGE is the time since each was created, IDLE since its last use, EXPIRES when it is ended
    idle at the earliest (the daemon's --idle-ttl, or --persistent-ttl for a persistent
    session: `never` when 0)."""
    sessions = state.client().list_sessions()
    if state.as_json:
        echo_json(sessions)
        return
    shared = any(s.holder for s in sessions)
    now = time.time()
    headers = ("SESSION", "WHERE", "TOKENS", "CHECKPOINTS", "PERSISTENT", "AGE", "IDLE", "EXPIRES")
    table(
        headers + (("HELD BY",) if shared else ()),
        [
            (
                s.session_id,
                s.location,
                f"{s.n_tokens}/{s.n_ctx}",
                str(s.n_checkpoints),
                "yes" if s.persistent else "no",
                format_age(s.created_at, now),
                format_age(s.last_used_at, now),
                format_until(s.expires_at, now),
            )
            + ((s.holder or "-",) if shared else ())
            for s in sessions
        ],
    )
    persistent = sum(s.persistent for s in sessions)
    if persistent:
        # They outlive restarts, so they pile up unless something ends them.
        click.echo(
            f"{persistent} persistent: kept until `kvkeep session close ID`, or deleted once idle "
            "for the daemon's --persistent-ttl SECONDS (0, the default: never)",
            err=True,
        )


@session_group.command("show")
@click.argument("session_id")
@click.pass_obj
def session_show(state: State, session_id: str) -> None:
    """Show a session's state and conversation."""
    s = Session(state.client(), session_id).info()
    if state.as_json:
        echo_json(s)
        return
    sampling = dataclasses.asdict(s.sampling)
    echo_fields(
        [
            ("session", s.session_id),
            ("persistent", "yes" if s.persistent else "no"),
            ("tokens", f"{s.n_tokens}/{s.n_ctx}"),
            ("residency", s.residency),
            ("where", s.location),
            ("created", format_time(s.created_at)),
            ("last used", format_time(s.last_used_at)),
            ("expires", format_time(s.expires_at) if s.expires_at else "never"),
            ("forked from", s.forked_from or "-"),
            ("checkpoints", s.n_checkpoints),
            ("head checkpoint", s.head_checkpoint_id or "-"),
            ("sampling", " ".join(f"{k}={v}" for k, v in sampling.items() if v is not None) or "-"),
            ("stop", ", ".join(json.dumps(x, ensure_ascii=False) for x in s.stop) or "-"),
            ("messages", len(s.messages)),
        ]
    )
    for m in s.messages:
        click.echo(f"  {m.role}: {one_line(m.content)}")


@session_group.command("close")
@click.argument("session_id")
@click.pass_obj
def session_close(state: State, session_id: str) -> None:
    """Close a session: its history, head and checkpoints are deleted."""
    Session(state.client(), session_id).close()
    if state.as_json:
        echo_json({"session_id": session_id, "closed": True})


@session_group.command("fork")
@click.argument("session_id", required=False)
@click.option(
    "--checkpoint", "checkpoint_id", help="Fork this checkpoint (an imported one too), not a session's state."
)
@click.option("--persistent", is_flag=True, help="Keep the new session across daemon restarts.")
@click.pass_obj
def session_fork(state: State, session_id: str | None, checkpoint_id: str | None, persistent: bool) -> None:
    """Copy SESSION_ID's current state, or a checkpoint, into a new session; print its id."""
    client = state.client()
    if checkpoint_id is not None:
        fork = client.fork_session(checkpoint_id=checkpoint_id, persistent=persistent)
    elif session_id is not None:
        fork = client.fork_session(session_id, persistent=persistent)
    else:
        raise click.UsageError("give a SESSION_ID or --checkpoint ID")
    if state.as_json:
        echo_json(fork.info())
    else:
        click.echo(fork.session_id)
