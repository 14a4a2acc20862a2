"""`kvkeep run` and `kvkeep chat`: a reply in a new session, or a conversation."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

import click

from kvkeep._errors import KvkeepError
from kvkeep._types import Tool
from kvkeep.cli._context import State, describe, error_line, fail
from kvkeep.cli._options import max_tokens_option, sampling_options, sampling_params, token_limit
from kvkeep.cli._output import show_reply


def _has_chat_template(state: State) -> bool:
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


@click.command()
@click.argument("prompt")
@click.option("--system", default="", help="System prompt.")
@max_tokens_option
@sampling_options
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
@click.option(
    "--tools",
    "tools_file",
    type=click.File(),
    help="Tools the model may call: a JSON list of OpenAI function tools, or of "
    "{name, description, parameters} (a file). Each call is printed as a JSON line.",
)
@click.option(
    "--tool-choice",
    default=None,
    help="With --tools: auto (the default), none, required, or a tool's name to call.",
)
@click.pass_obj
def run(
    state: State,
    prompt: str,
    system: str,
    max_tokens: int,
    temperature: float | None,
    seed: int | None,
    stop: tuple[str, ...],
    grammar_file: TextIO | None,
    schema_file: TextIO | None,
    tools_file: TextIO | None,
    tool_choice: str | None,
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
    tools = _tools(tools_file) if tools_file is not None else None
    if tool_choice is not None and tools is None:
        raise click.UsageError("--tool-choice goes with --tools")
    chat = _has_chat_template(state)
    if not chat:
        if tools is not None:
            fail("the model has no chat template: it cannot be given tools")
        click.echo("the model has no chat template: completing the text", err=True)
    session = state.client().create_session(system, sampling=sampling_params(temperature, seed))
    options: dict[str, Any] = {
        "max_tokens": token_limit(max_tokens),
        "stop": stop,
        "grammar": grammar,
        "json_schema": json_schema,
    }
    if tools is not None:
        options.update(tools=tools, tool_choice=tool_choice)
    try:
        show_reply(
            state,
            lambda on_progress: (
                session.chat_stream(prompt, on_progress=on_progress, **options)
                if chat
                else session.generate(prompt, on_progress=on_progress, **options)
            ),
        )
    finally:
        session.close()


@click.command()
@click.argument("session_id", required=False)
@click.option("--system", default="", help="System prompt of the new session.")
@max_tokens_option
@sampling_options
@click.pass_obj
def chat(
    state: State,
    session_id: str | None,
    system: str,
    max_tokens: int,
    temperature: float | None,
    seed: int | None,
) -> None:
    """Chat in SESSION_ID, or in a new session, one line per message.

    Ctrl-C stops a reply; Ctrl-D, or Ctrl-C at the prompt, quits. The session stays open;
    come back with `kvkeep chat SESSION_ID`. The exit status is 1 if any turn failed.
    Messages may be piped in, one a line (then there is no prompt).
    """
    client = state.client()
    if not _has_chat_template(state):
        fail("the model has no chat template, so it cannot chat; `kvkeep run PROMPT` completes text")
    sampling = sampling_params(temperature, seed)
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
            show_reply(
                state,
                lambda on_progress: session.chat_stream(
                    line, max_tokens=token_limit(max_tokens), sampling=sampling, on_progress=on_progress
                ),
            )
        except KeyboardInterrupt:
            click.echo("[interrupted]", err=True)
        except KvkeepError as e:
            error_line(describe(e, state.address))
            failed = True
    if failed:
        raise click.exceptions.Exit(1)


def _tools(file: TextIO) -> list[Tool]:
    """The tools of a --tools file: OpenAI's function tools, or {name, description,
    parameters} objects."""
    try:
        given = json.load(file)
    except ValueError as e:
        raise click.UsageError(f"--tools: {file.name} is not JSON: {e}") from None
    if not isinstance(given, list) or not all(isinstance(t, dict) for t in given):
        raise click.UsageError("--tools takes a JSON list of tools")
    tools = []
    for t in given:
        f = t.get("function", t) if t.get("type") == "function" else t
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise click.UsageError("--tools: every tool needs a name")
        tools.append(Tool(f["name"], str(f.get("description", "")), f.get("parameters")))
    return tools
