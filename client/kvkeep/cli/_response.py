"""`kvkeep response`: list and delete your stored responses (the HTTP door's /v1/responses)."""

from __future__ import annotations

import click

from kvkeep._types import ResponseInfo, ResponsePage
from kvkeep.cli._context import State
from kvkeep.cli._output import echo_json, format_size, format_time, table

#: The most responses the daemon gives in one page.
MAX_PAGE = 100


@click.group("response")
def response_group() -> None:
    """List and delete your stored responses."""


@response_group.command("list")
@click.option(
    "--limit",
    type=click.IntRange(1, MAX_PAGE),
    metavar="N",
    help="Responses in the page (1 to 100)  [default: 20; 100 a page with --all]",
)
@click.option("--after", metavar="ID", help="Begin after this response (the last of the page before).")
@click.option(
    "--order",
    type=click.Choice(["desc", "asc"]),
    default="desc",
    show_default=True,
    help="By creation: newest first, or oldest first.",
)
@click.option("--all", "every", is_flag=True, help="Every page, one after another.")
@click.pass_obj
def response_list(state: State, limit: int | None, after: str | None, order: str, every: bool) -> None:
    """List your stored responses, a page at a time: id, the response it continues, tokens,
    bytes, when it was made and when it expires."""
    client = state.client()
    page = client.list_responses(limit=limit or (MAX_PAGE if every else 20), after=after, order=order)
    listed = list(page.responses)
    while every and page.has_more:
        page = client.list_responses(limit=limit or MAX_PAGE, after=listed[-1].response_id, order=order)
        listed += page.responses
    if state.as_json:
        echo_json(ResponsePage(tuple(listed), page.has_more))
        return
    table(("RESPONSE", "CONTINUES", "TOKENS", "WRITTEN", "REFERENCED", "CREATED", "EXPIRES"), _rows(listed))
    if page.has_more:
        click.echo(f"more: kvkeep response list --after {listed[-1].response_id}", err=True)


def _rows(listed: list[ResponseInfo]) -> list[tuple[str, ...]]:
    return [
        (
            r.response_id,
            r.previous_response_id or "-",
            str(r.n_tokens),
            format_size(r.bytes_written),
            format_size(r.bytes_referenced),
            format_time(r.created_at),
            format_time(r.expires_at),
        )
        for r in listed
    ]


@response_group.command("delete")
@click.argument("response_id")
@click.pass_obj
def response_delete(state: State, response_id: str) -> None:
    """Delete a stored response: its bytes no longer count against your quota."""
    state.client().delete_response(response_id)
    if state.as_json:
        echo_json({"response_id": response_id, "deleted": True})
