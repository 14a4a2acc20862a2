"""The ``kvstash`` command against the shared daemon, through click's CliRunner."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner, Result

import kvstash
from kvstash.cli import main

Invoke = Callable[..., Result]


@pytest.fixture
def kv(daemon_address: str) -> Invoke:
    """Run ``kvstash --address <daemon> ARGS...``; ``input`` feeds stdin."""

    def invoke(*args: str, input: str | None = None) -> Result:
        runner = CliRunner()
        return runner.invoke(main, ["--address", daemon_address, *args], input=input)

    return invoke


def ok_json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def one_error_line(result: Result) -> str:
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    return lines[0]


def test_info_json(kv: Invoke, client: kvstash.Client) -> None:
    info = ok_json(kv("--json", "info"))
    assert info["mode"] == "exact"
    assert info["slots"] == 4
    assert info["ctx_per_session"] == 1024
    assert info["model_fingerprint"] == client.info().model_fingerprint


def test_info_text(kv: Invoke) -> None:
    result = kv("info")
    assert result.exit_code == 0, result.output
    assert "mode: exact" in result.stdout.splitlines()
    assert "slots: 4" in result.stdout.splitlines()


def test_run_answers_in_a_session_it_closes(kv: Invoke, client: kvstash.Client) -> None:
    sessions_before = {s.session_id for s in client.list_sessions()}
    result = kv("run", "Say hello.", "--max-tokens", "8", "--temperature", "0")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    assert result.stderr in ("", "[length]\n")
    assert {s.session_id for s in client.list_sessions()} == sessions_before


def test_run_json(kv: Invoke) -> None:
    completion = ok_json(kv("--json", "run", "Say hello.", "--max-tokens", "8", "--seed", "7"))
    assert completion["finish_reason"] in ("length", "eos")
    assert 1 <= len(completion["token_ids"]) <= 8
    assert completion["usage"]["generated_tokens"] == len(completion["token_ids"])


def test_session_create_list_show_close(kv: Invoke) -> None:
    created = ok_json(
        kv("--json", "session", "create", "--system", "Be brief.", "--seed", "42", "--stop", "\n")
    )
    session_id = created["session_id"]
    assert created["sampling"]["seed"] == 42
    assert created["stop"] == ["\n"]
    assert created["messages"] == [{"role": "system", "content": "Be brief."}]

    listed = ok_json(kv("--json", "session", "list"))
    assert session_id in [s["session_id"] for s in listed]

    shown = ok_json(kv("--json", "session", "show", session_id))
    assert shown["session_id"] == session_id
    assert shown["n_tokens"] == created["n_tokens"] > 0

    text = kv("session", "show", session_id)
    assert text.exit_code == 0, text.output
    assert f"session: {session_id}" in text.stdout
    assert "system: Be brief." in text.stdout

    assert ok_json(kv("--json", "session", "close", session_id)) == {
        "session_id": session_id,
        "closed": True,
    }
    listed = ok_json(kv("--json", "session", "list"))
    assert session_id not in [s["session_id"] for s in listed]


def test_session_create_prints_the_id(kv: Invoke, client: kvstash.Client) -> None:
    result = kv("session", "create")
    assert result.exit_code == 0, result.output
    session_id = result.stdout.strip()
    assert client.session(session_id).info().n_tokens == 0
    client.session(session_id).close()


def test_chat_on_a_new_session(kv: Invoke, client: kvstash.Client) -> None:
    result = kv("chat", "--max-tokens", "8", "--temperature", "0", input="hello\n")
    assert result.exit_code == 0, result.output
    first_line = result.stderr.splitlines()[0]
    assert first_line.startswith("session s_")
    session_id = first_line.split()[1]
    assert result.stdout.strip()
    messages = client.session(session_id).info().messages
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[0].content == "hello"
    assert messages[1].content.strip()

    # Back in the same session: the conversation goes on.
    again = kv("chat", session_id, "--max-tokens", "4", input="and again\n")
    assert again.exit_code == 0, again.output
    assert len(client.session(session_id).info().messages) == 4
    client.session(session_id).close()


def test_unknown_session_is_one_error_line(kv: Invoke) -> None:
    unknown = "s_" + "0" * 24
    assert unknown in one_error_line(kv("session", "show", unknown))
    one_error_line(kv("--json", "session", "close", unknown))
    one_error_line(kv("chat", unknown, input="hello\n"))
    assert "malformed" in one_error_line(kv("session", "show", "../../etc"))
