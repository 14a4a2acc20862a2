"""Bad requests get the right error, and the daemon keeps serving after each."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from checkpoint_helpers import own_daemon
from daemons import InProcessDaemon, check_serving, model_path

import kvkeep
from kvkeepd.errors import StoreReadFailed
from kvkeepd.storage.catalog import CheckpointRow
from kvkeepd.storage.catalog.sqlite import SqliteCatalog
from kvkeepd.storage.statedir import MARK, MARK_TEXT


@pytest.fixture
def session(client: kvkeep.Client) -> Iterator[kvkeep.Session]:
    s = client.create_session()
    yield s
    s.close()


@pytest.fixture
def token(client: kvkeep.Client) -> int:
    """Some valid token id."""
    probe = client.create_session()
    try:
        return probe.complete("The", max_tokens=1).token_ids[0]
    finally:
        probe.close()


def test_empty_prompt_on_a_fresh_session(client: kvkeep.Client, session: kvkeep.Session) -> None:
    with pytest.raises(kvkeep.InvalidRequestError, match="empty"):
        session.complete("", max_tokens=4)
    assert session.info().n_tokens == 0
    check_serving(client)


def test_empty_chat_message(client: kvkeep.Client, session: kvkeep.Session) -> None:
    with pytest.raises(kvkeep.InvalidRequestError):
        session.chat("", max_tokens=4)
    check_serving(client)


def test_prompt_longer_than_the_context(client: kvkeep.Client, session: kvkeep.Session, token: int) -> None:
    # More tokens than the whole context (1024) is a bad argument, not a full context.
    with pytest.raises(kvkeep.InvalidRequestError) as e:
        session.complete([token] * 1100, max_tokens=1)
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(kvkeep.InvalidRequestError):
        session.complete(" hello" * 1100, max_tokens=1)
    assert session.info().n_tokens == 0
    check_serving(client)
    assert session.complete("Hello", max_tokens=1).usage.generated_tokens == 1


def test_prompt_plus_max_tokens_beyond_the_context(
    client: kvkeep.Client, session: kvkeep.Session, token: int
) -> None:
    with pytest.raises(kvkeep.ContextFullError) as e:
        session.complete([token] * 1000, max_tokens=100)
    assert e.value.code == "OUT_OF_RANGE"
    # A prompt that fills the context exactly leaves no room for one token either.
    with pytest.raises(kvkeep.ContextFullError):
        session.complete([token] * 1024)
    assert session.info().n_tokens == 0
    check_serving(client)


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_max_tokens_not_positive(client: kvkeep.Client, session: kvkeep.Session, max_tokens: int) -> None:
    with pytest.raises(kvkeep.InvalidRequestError, match="max_tokens"):
        session.complete("Hello", max_tokens=max_tokens)
    assert session.info().n_tokens == 0
    check_serving(client)


@pytest.mark.parametrize(
    "sampling",
    [
        kvkeep.SamplingParams(temperature=-0.5),
        kvkeep.SamplingParams(temperature=math.nan),
        kvkeep.SamplingParams(temperature=math.inf),
        kvkeep.SamplingParams(top_p=0.0),
        kvkeep.SamplingParams(top_k=-1),
        kvkeep.SamplingParams(min_p=1.5),
        kvkeep.SamplingParams(repeat_penalty=0.0),
        kvkeep.SamplingParams(penalty_last_n=-2),
    ],
    ids=[
        "negative-temperature",
        "nan-temperature",
        "inf-temperature",
        "top_p-0",
        "negative-top_k",
        "min_p-above-1",
        "repeat_penalty-0",
        "penalty_last_n-below-minus-1",
    ],
)
def test_bad_sampling_parameters(
    client: kvkeep.Client, session: kvkeep.Session, sampling: kvkeep.SamplingParams
) -> None:
    with pytest.raises(kvkeep.InvalidRequestError):
        session.complete("Hello", max_tokens=2, sampling=sampling)
    with pytest.raises(kvkeep.InvalidRequestError):
        session.chat("Hello", max_tokens=2, sampling=sampling)
    with pytest.raises(kvkeep.InvalidRequestError):
        client.create_session(sampling=sampling)
    assert session.info().n_tokens == 0
    check_serving(client)


@pytest.mark.parametrize("logprobs", [-1, 21])
def test_logprobs_out_of_range(client: kvkeep.Client, session: kvkeep.Session, logprobs: int) -> None:
    with pytest.raises(kvkeep.InvalidRequestError, match="logprobs"):
        session.complete("Hello", max_tokens=2, logprobs=logprobs)
    check_serving(client)


def test_token_ids_outside_the_vocabulary(client: kvkeep.Client, session: kvkeep.Session) -> None:
    for bad in (-1, 49152, 2**31 - 1):
        with pytest.raises(kvkeep.InvalidRequestError, match="vocabulary"):
            session.complete([1, bad], max_tokens=1)
    check_serving(client)


def test_bad_stop_strings(client: kvkeep.Client, session: kvkeep.Session) -> None:
    with pytest.raises(kvkeep.InvalidRequestError):
        session.complete("Hello", max_tokens=2, stop=[""])
    with pytest.raises(kvkeep.InvalidRequestError):
        session.complete("Hello", max_tokens=2, stop=["x" * 1000])
    with pytest.raises(kvkeep.InvalidRequestError):
        session.complete("Hello", max_tokens=2, stop=[str(n) for n in range(100)])
    check_serving(client)


def test_unknown_session_id(client: kvkeep.Client) -> None:
    unknown = "s_" + "0" * 24
    with pytest.raises(kvkeep.NotFoundError):
        client.session(unknown)
    ghost = kvkeep.Session(client, unknown)
    with pytest.raises(kvkeep.NotFoundError):
        ghost.complete("Hello", max_tokens=2)
    with pytest.raises(kvkeep.NotFoundError):
        ghost.chat("Hello", max_tokens=2)
    with pytest.raises(kvkeep.NotFoundError):
        ghost.close()
    check_serving(client)


@pytest.mark.parametrize("session_id", ["../../etc", "", "s_XYZ", "s_" + "0" * 200, "s_\x00"])
def test_malformed_session_id(client: kvkeep.Client, session_id: str) -> None:
    with pytest.raises(kvkeep.InvalidRequestError, match="malformed"):
        client.session(session_id)
    with pytest.raises(kvkeep.InvalidRequestError):
        kvkeep.Session(client, session_id).complete("Hello", max_tokens=2)
    check_serving(client)


def test_closed_session(client: kvkeep.Client) -> None:
    session = client.create_session()
    session.complete("Hello", max_tokens=2)
    session.close()
    with pytest.raises(kvkeep.NotFoundError):
        session.info()
    with pytest.raises(kvkeep.NotFoundError):
        session.complete("Hello", max_tokens=2)
    with pytest.raises(kvkeep.NotFoundError):
        session.close()
    assert session.session_id not in {s.session_id for s in client.list_sessions()}
    check_serving(client)


def test_message_over_the_size_limit(start_daemon: Callable[..., InProcessDaemon]) -> None:
    small = start_daemon(slots=1, max_message_bytes=64 * 1024)
    with kvkeep.Client(small.address, timeout=30) as client:
        session = client.create_session()
        with pytest.raises(kvkeep.BusyError) as e:
            session.complete("a" * (100 * 1024), max_tokens=1)
        assert e.value.code == "RESOURCE_EXHAUSTED"
        with pytest.raises(kvkeep.BusyError):
            client.create_session("a" * (100 * 1024))
        check_serving(client)
        assert session.complete("Hello", max_tokens=2).usage.generated_tokens >= 1


# ---- causes that share a status, and a state store that fails ------------------------------

LONG = "Once upon a time, in a small village by the sea, there lived an old fisherman. " * 6


def without_chat_template(dst: Path) -> Path:
    """The default model with its chat template's metadata key renamed (same length, so the
    file stays a valid GGUF): llama.cpp finds no template in it."""
    data = model_path().read_bytes()
    key = b"tokenizer.chat_template"
    assert data.count(key) == 1
    dst.write_bytes(data.replace(key, b"tokenizer.chat_templatX"))
    return dst


def test_chat_without_a_template_is_its_own_error(tmp_path: Path) -> None:
    model = without_chat_template(tmp_path / "no-template.gguf")
    with (
        own_daemon(tmp_path / "state", model=model, slots=1, http_address="127.0.0.1:0") as d,
        kvkeep.Client(d.address, timeout=60) as client,
    ):
        assert not client.info().has_chat_template
        session = client.create_session()
        with pytest.raises(kvkeep.NoChatTemplateError) as e:
            session.chat("Hello", max_tokens=2)
        assert isinstance(e.value, kvkeep.FailedPreconditionError)
        assert not isinstance(e.value, kvkeep.IncompatibleCheckpointError)
        assert (e.value.code, e.value.cause) == ("FAILED_PRECONDITION", "no-chat-template")
        assert "chat template" in e.value.message
        assert session.complete("Hello", max_tokens=2).usage.generated_tokens >= 1
        session.close()
        # The HTTP door says the same: 409, and the cause as the error's code.
        assert d.daemon is not None
        door = f"http://127.0.0.1:{d.daemon.http_port}/v1"
        model_id = httpx.get(f"{door}/models", timeout=60).json()["data"][0]["id"]
        body = {"model": model_id, "messages": [{"role": "user", "content": "Hello"}]}
        reply = httpx.post(f"{door}/chat/completions", json=body, timeout=60)
        assert reply.status_code == 409
        assert reply.json()["error"]["code"] == "no-chat-template"


def test_deleting_a_live_sessions_head_is_its_own_error(client: kvkeep.Client) -> None:
    session = client.create_session(persistent=True)
    session.complete("Hello", max_tokens=2)
    head = session.info().head_checkpoint_id
    assert head
    with pytest.raises(kvkeep.CheckpointInUseError) as e:
        client.delete_checkpoint(head)
    assert not isinstance(e.value, kvkeep.IncompatibleCheckpointError)
    assert (e.value.code, e.value.cause) == ("FAILED_PRECONDITION", "checkpoint-in-use")
    assert session.info().head_checkpoint_id == head
    session.close()
    check_serving(client)


def test_a_block_store_that_cannot_be_read_or_written(
    start_daemon: Callable[..., InProcessDaemon], tmp_path: Path
) -> None:
    d = start_daemon(slots=2)
    blocks = d.settings.state_dir / "blocks"
    with kvkeep.Client(d.address, timeout=60) as client:
        session = client.create_session(persistent=True)
        session.complete(LONG, max_tokens=2)
        checkpoint = session.checkpoint()
        # Cells taken away (a rewind), so that the restore below reads the checkpoint's blocks
        # instead of cutting the session's own cells.
        session.complete(" More.", max_tokens=2)
        session.rewind(checkpoint.n_tokens)
        # Each block file becomes a directory: it exists, and reading or replacing it fails.
        aside = tmp_path / "aside"
        aside.mkdir()
        files = [p for p in blocks.rglob("*") if p.is_file() and p.parent.name != "tmp"]
        assert files
        for f in files:
            f.rename(aside / f.name)
            f.mkdir()

        with pytest.raises(kvkeep.StoreReadError) as read:
            session.restore(checkpoint.checkpoint_id)
        assert (read.value.code, read.value.cause) == ("UNAVAILABLE", "store-read-failed")
        assert "cannot be read" in read.value.message
        with pytest.raises(kvkeep.StoreReadError):
            client.export_checkpoint(checkpoint.checkpoint_id, tmp_path / "out.kvs")
        assert not (tmp_path / "out.kvs").exists()
        with pytest.raises(kvkeep.StoreWriteError) as write:
            session.checkpoint()
        assert isinstance(write.value, kvkeep.BusyError)
        assert (write.value.code, write.value.cause) == ("RESOURCE_EXHAUSTED", "store-write-failed")
        assert [c.checkpoint_id for c in session.checkpoints()] == [checkpoint.checkpoint_id]
        assert not any((blocks / "tmp").iterdir())  # the failed write left no temp file
        check_serving(client)

        for f in files:
            f.rmdir()
            (aside / f.name).rename(f)
        assert session.restore(checkpoint.checkpoint_id).n_tokens == checkpoint.n_tokens
        assert client.export_checkpoint(checkpoint.checkpoint_id, tmp_path / "out.kvs") > 0
        session.close()


def test_a_catalog_that_cannot_be_read_stops_the_start_with_one_line(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / MARK).write_bytes(MARK_TEXT)  # a state directory of this format
    catalog = SqliteCatalog(state_dir / "catalog.db")
    row = CheckpointRow("c_" + "0" * 24, "s_" + "0" * 24, "", "explicit", 1, 1, 1, 0.0)
    catalog.add_checkpoint(row, b"manifest", [("ab" * 32, 10)], now=0.0)
    catalog.close()
    # Every page but the first (the schema) overwritten: the tables cannot be read.
    page = 4096
    data = (state_dir / "catalog.db").read_bytes()
    assert len(data) > page
    (state_dir / "catalog.db").write_bytes(data[:page] + b"\xff" * (len(data) - page))
    with pytest.raises(StoreReadFailed, match="cannot be read"):
        SqliteCatalog(state_dir / "catalog.db")
    args = [
        "--state-dir",
        str(state_dir),
        "--address",
        "127.0.0.1:0",
        "--http",
        "off",
        "--threads",
        "1",
        "--log-level",
        "error",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "kvkeepd", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "cannot read the catalog: database disk image is malformed" in result.stderr  # the log
    assert result.stderr.splitlines()[-1] == "error: the state store cannot be read (see the daemon's log)"
