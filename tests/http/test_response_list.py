"""A tenant's stored responses listed and deleted: `GET /v1/responses` (OpenAI has no such
route; its list endpoints' shape), ListResponses and DeleteResponse over gRPC through the SDK
(sync and async), and `kvkeep response list|delete`.

- Each tenant lists its own and only its own, a page at a time, newest or oldest first;
  another tenant's id, as a cursor or to delete, is the 404 an unknown id is.
- A tenant that lost its ids frees its stored-bytes quota by listing and deleting them.
- The catalogs (sqlite and Redis) page by an index of the tenant's responses, in the same
  order, ties in creation time included; a Redis catalog written before that index gets it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from auth import write_auth
from click.testing import CliRunner
from daemons import InProcessDaemon, model_path

import kvkeep
from kvkeep.cli import main as cli_main
from kvkeepd.storage.catalog import Catalog, CheckpointRow
from kvkeepd.storage.catalog.sqlite import SqliteCatalog

MODEL = model_path().stem
TOKENS = {
    "alice": "alice-token-0123456789",
    "bob": "bob-token-0123456789abc",
    "carol": "carol-token-0123456789",
}
THIRTY_DAYS = 30 * 24 * 3600
NO_RESPONSE = "no response 'ID'"


@pytest.fixture(params=["sqlite", "redis"])
def tenants(
    request: pytest.FixtureRequest, tmp_path: Path, start_daemon: Callable[..., InProcessDaemon]
) -> InProcessDaemon:
    """A daemon with three tenants and the HTTP door, on either catalog."""
    shared: dict[str, Any] = {}
    if request.param == "redis":
        redis = request.getfixturevalue("redis_server")
        shared = {
            "catalog": f"{redis}?prefix=listing-{secrets.token_hex(6)}",
            "store": redis,
            "store_key": secrets.token_hex(32),
        }
    auth = write_auth(tmp_path / "auth.toml", TOKENS)
    return start_daemon(http_address="127.0.0.1:0", auth_file=auth, **shared)


def url(d: InProcessDaemon) -> str:
    assert d.daemon is not None
    return f"http://127.0.0.1:{d.daemon.http_port}/v1"


def oai(d: InProcessDaemon, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url(d), api_key=TOKENS[tenant], max_retries=0, timeout=120)


def http(d: InProcessDaemon, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=url(d), headers={"authorization": f"Bearer {TOKENS[tenant]}"}, timeout=60)


def respond(c: openai.OpenAI, text: str, previous: str | None = None) -> str:
    kw: dict[str, Any] = {"previous_response_id": previous} if previous else {}
    return c.responses.create(model=MODEL, input=text, max_output_tokens=2, temperature=0, **kw).id


def stored_bytes(d: InProcessDaemon, tenant: str) -> int:
    assert d.daemon is not None
    return int(d.daemon.manager.stores.durable.catalog.stored_bytes(tenant))


def pages(h: httpx.Client, limit: int, order: str = "desc") -> list[dict[str, Any]]:
    """Every page of the tenant's listing, each checked against the one before."""
    found: list[dict[str, Any]] = []
    after = None
    while True:
        params: dict[str, Any] = {"limit": limit, "order": order, **({"after": after} if after else {})}
        page = h.get("/responses", params=params)
        assert page.status_code == 200, page.text
        body = page.json()
        assert body["object"] == "list" and len(body["data"]) <= limit
        if body["data"]:
            assert (body["first_id"], body["last_id"]) == (body["data"][0]["id"], body["data"][-1]["id"])
        found += body["data"]
        if not body["has_more"]:
            return found
        assert len(body["data"]) == limit
        after = body["last_id"]


def test_each_tenant_lists_pages_of_its_own_and_deletes_only_its_own_over_http(
    tenants: InProcessDaemon,
) -> None:
    alice, bob = oai(tenants, "alice"), oai(tenants, "bob")
    first = respond(alice, "Name a harbour.")
    chain = [first, respond(alice, "And a ship?", first)]
    chain.append(respond(alice, "And its captain?", chain[-1]))
    others = [respond(alice, f"Count to {n}.") for n in (2, 3)]
    made = [*chain, *others]  # in the order they were made
    bobs = [respond(bob, "Name a tide.")]
    with http(tenants, "alice") as ha, http(tenants, "bob") as hb:
        listed = pages(ha, 100)
        assert [r["id"] for r in listed] == made[::-1]  # newest first by default
        for limit in (1, 2, 4):
            assert [r["id"] for r in pages(ha, limit)] == made[::-1]
            assert [r["id"] for r in pages(ha, limit, "asc")] == made
        assert [r["id"] for r in pages(hb, 2)] == bobs
        by_id = {r["id"]: r for r in listed}
        assert [by_id[r]["previous_response_id"] for r in chain] == [None, *chain[:-1]]
        assert {by_id[r]["previous_response_id"] for r in others} == {None}
        for r in listed:
            assert r["object"] == "response"
            assert r["n_tokens"] > 0 and r["bytes_referenced"] >= r["bytes_written"] >= 0
            assert abs(r["expires_at"] - r["created_at"] - THIRTY_DAYS) <= 1
        # A chain's responses hold ever longer conversations.
        assert [by_id[r]["n_tokens"] for r in chain] == sorted(by_id[r]["n_tokens"] for r in chain)

        # Another tenant's id is an unknown one: as a cursor, to delete, to retrieve.
        unknown = "resp_" + secrets.token_hex(12)
        for rid in (made[0], unknown):
            answers = [hb.get("/responses", params={"after": rid}), hb.delete(f"/responses/{rid}")]
            assert [a.status_code for a in answers] == [404, 404]
            assert {a.json()["error"]["message"].replace(rid, "ID") for a in answers} == {NO_RESPONSE}
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(made[0])
        for params, says in (
            ({"limit": 0}, "limit must be in [1, 100]"),
            ({"limit": 101}, "limit must be in [1, 100]"),
            ({"limit": "x"}, "limit must be an integer"),
            ({"order": "newest"}, "order must be asc or desc"),
        ):
            refused = ha.get("/responses", params=params)
            assert refused.status_code == 400 and refused.json()["error"]["message"] == says

        # Deleted as listed, page after page (each page begins again: its cursor is gone).
        while listed := ha.get("/responses", params={"limit": 2}).json()["data"]:
            for r in listed:
                alice.responses.delete(r["id"])
        assert stored_bytes(tenants, "alice") == 0
        assert [r["id"] for r in pages(hb, 10)] == bobs and stored_bytes(tenants, "bob") > 0
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(first)


def test_a_tenant_that_lost_its_ids_frees_its_quota_by_listing_them(
    tmp_path: Path, start_daemon: Callable[..., InProcessDaemon]
) -> None:
    auth = write_auth(tmp_path / "auth.toml", TOKENS)
    d = start_daemon(http_address="127.0.0.1:0", auth_file=auth)
    assert d.daemon is not None
    carol = oai(d, "carol")
    for n in range(3):
        respond(carol, f"Name {n + 2} colours.")  # ids not kept: lost
    held = stored_bytes(d, "carol")
    # The quota is what she holds now: nothing more is stored.
    write_auth(auth, TOKENS, {"carol": {"max_stored_bytes": held}})
    d.run(d.daemon.reload_tenants())
    with pytest.raises(openai.RateLimitError, match="quota"):
        respond(carol, "Name a bird.")
    with http(d, "carol") as h:
        lost = [r["id"] for r in pages(h, 2)]
    assert len(lost) == 3
    for rid in lost:
        carol.responses.delete(rid)
    assert stored_bytes(d, "carol") == 0
    assert respond(carol, "Name a bird.")


def test_the_sdk_lists_and_deletes_over_grpc_sync_and_async(tenants: InProcessDaemon) -> None:
    made = [respond(oai(tenants, "alice"), f"Name {n} ships.") for n in range(2, 5)]
    with (
        kvkeep.Client(tenants.address, timeout=60, token=TOKENS["alice"]) as alice,
        kvkeep.Client(tenants.address, timeout=60, token=TOKENS["bob"]) as bob,
    ):
        page = alice.list_responses()
        assert [r.response_id for r in page.responses] == made[::-1] and not page.has_more
        first = alice.list_responses(limit=2, order="asc")
        assert [r.response_id for r in first.responses] == made[:2] and first.has_more
        rest = alice.list_responses(limit=2, order="asc", after=made[1])
        assert [r.response_id for r in rest.responses] == made[2:] and not rest.has_more
        info = page.responses[0]
        assert isinstance(info, kvkeep.ResponseInfo) and info.previous_response_id == ""
        assert info.n_tokens > 0 and info.bytes_referenced > 0
        assert info.expires_at == pytest.approx(info.created_at + THIRTY_DAYS)
        assert bob.list_responses().responses == ()

        unknown = "resp_" + secrets.token_hex(12)

        def refused(call: Callable[[], object], rid: str) -> str:
            with pytest.raises(kvkeep.NotFoundError) as e:
                call()
            return e.value.message.replace(rid, "ID")

        for rid in (made[0], unknown):
            assert refused(lambda rid=rid: bob.delete_response(rid), rid) == NO_RESPONSE
            assert refused(lambda rid=rid: bob.list_responses(after=rid), rid) == NO_RESPONSE
        with pytest.raises(kvkeep.InvalidRequestError, match="limit"):
            alice.list_responses(limit=101)
        with pytest.raises(kvkeep.InvalidRequestError, match="order"):
            alice.list_responses(order="up")
        alice.delete_response(made[0])
        assert [r.response_id for r in alice.list_responses().responses] == made[:0:-1]

    async def run() -> list[str]:
        async with kvkeep.AsyncClient(tenants.address, timeout=60, token=TOKENS["alice"]) as a:
            page = await a.list_responses(limit=1, order="asc")
            assert page.has_more
            await a.delete_response(page.responses[0].response_id)
            return [r.response_id for r in (await a.list_responses()).responses]

    assert asyncio.run(run()) == [made[2]]


def test_the_cli_lists_and_deletes(tenants: InProcessDaemon) -> None:
    made = [respond(oai(tenants, "alice"), f"Name {n} tides.") for n in range(2, 5)]

    def kv(tenant: str, *args: str) -> Any:
        return CliRunner().invoke(cli_main, ["--address", tenants.address, "--token", TOKENS[tenant], *args])

    shown = kv("alice", "response", "list", "--limit", "2")
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert lines[0].split() == [
        "RESPONSE",
        "CONTINUES",
        "TOKENS",
        "WRITTEN",
        "REFERENCED",
        "CREATED",
        "EXPIRES",
    ]
    assert [line.split()[0] for line in lines[1:]] == made[:0:-1]
    assert shown.stderr.strip() == f"more: kvkeep response list --after {made[1]}"
    every = json.loads(kv("alice", "--json", "response", "list", "--all", "--limit", "1").stdout)
    assert [r["response_id"] for r in every["responses"]] == made[::-1] and not every["has_more"]
    oldest = json.loads(kv("alice", "response", "list", "--order", "asc", "--json").stdout)
    assert [r["response_id"] for r in oldest["responses"]] == made

    theirs = kv("bob", "response", "delete", made[0])
    assert theirs.exit_code == 1 and theirs.stderr.strip() == f"error: no response {made[0]!r}"
    assert json.loads(kv("bob", "--json", "response", "list").stdout)["responses"] == []
    gone = kv("alice", "--json", "response", "delete", made[0])
    assert json.loads(gone.stdout) == {"response_id": made[0], "deleted": True}
    left = json.loads(kv("alice", "--json", "response", "list").stdout)
    assert [r["response_id"] for r in left["responses"]] == made[:0:-1]


# ---- the catalogs ----------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "redis"])
def catalog(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Catalog]:
    made: Catalog
    if request.param == "sqlite":
        made = SqliteCatalog(tmp_path / "catalog.db")
    else:
        made = redis_catalog(request.getfixturevalue("redis_server"))
    yield made
    made.close()


def redis_catalog(url: str, prefix: str | None = None) -> Catalog:
    from kvkeepd.storage.catalog.redis import RedisCatalog

    return RedisCatalog(f"{url}?prefix={prefix or 'test-' + secrets.token_hex(6)}")


def add_response(catalog: Catalog, tenant: str, at: float, previous: str = "") -> CheckpointRow:
    row = CheckpointRow("c_" + secrets.token_hex(12), "s_x", "", "response", 7, 100, 200, at, tenant)
    body = {"previous_response_id": previous, "instructions": None, "document": {"x": "y" * 500}}
    catalog.add_checkpoint(
        row, b"manifest", [], now=at, response=json.dumps(body, separators=(",", ":")).encode()
    )
    return row


def page_through(catalog: Catalog, tenant: str, limit: int, descending: bool) -> list[CheckpointRow]:
    found: list[CheckpointRow] = []
    while True:
        page = catalog.tenant_responses(tenant, found[-1].checkpoint_id if found else "", limit, descending)
        assert page is not None and len(page) <= limit
        found += [row for row, _ in page]
        if len(page) < limit:
            return found


def test_catalogs_page_a_tenants_responses_by_creation_then_id(catalog: Catalog) -> None:
    # Creation times with ties: the id orders them, in both catalogs alike.
    mine = [add_response(catalog, "acme", float(n // 3)) for n in range(40)]
    theirs = [add_response(catalog, "other", float(n)) for n in range(5)]
    catalog.add_checkpoint(
        CheckpointRow("c_" + "1" * 24, "s_x", "", "explicit", 1, 1, 1, 2.0, "acme"), b"m", [], 2.0
    )
    oldest_first = sorted(mine, key=lambda r: (r.created_at, r.checkpoint_id))
    for limit in (1, 7, 40, 100):
        assert page_through(catalog, "acme", limit, False) == oldest_first
        assert page_through(catalog, "acme", limit, True) == oldest_first[::-1]
    page = catalog.tenant_responses("acme", "", 1, False)
    assert page is not None and page[0][1].startswith(b'{"previous_response_id":""')
    assert len(page[0][1]) == 64  # the record's head, not the record
    assert catalog.tenant_responses("other", mine[0].checkpoint_id, 10, True) is None
    assert catalog.tenant_responses("acme", "c_" + "0" * 24, 10, True) is None
    assert catalog.tenant_responses("nobody", "", 10, True) == []
    assert page_through(catalog, "other", 2, True) == theirs[::-1]
    catalog.delete(oldest_first[0].checkpoint_id)
    assert catalog.tenant_responses("acme", oldest_first[0].checkpoint_id, 10, False) is None
    assert page_through(catalog, "acme", 9, False) == oldest_first[1:]
    catalog.delete_session("s_x")
    assert catalog.tenant_responses("acme", "", 10, False) == []
    assert catalog.tenant_responses("other", "", 10, False) == []


def test_responses_of_a_redis_catalog_written_before_their_index_are_indexed_at_open(
    redis_server: str,
) -> None:
    import redis

    prefix = "test-" + secrets.token_hex(6)
    old = redis_catalog(redis_server, prefix)
    rows = [add_response(old, "acme", float(n)) for n in range(3)]
    raw = redis.Redis.from_url(redis_server)
    # As a catalog written by a daemon without the index left it.
    raw.delete(f"{prefix}:responses-indexed", f"{prefix}:tenant-responses:acme")
    assert old.tenant_responses("acme", "", 10, False) == []
    opened = redis_catalog(redis_server, prefix)
    page = opened.tenant_responses("acme", "", 10, False)
    assert page is not None and [row for row, _ in page] == rows
