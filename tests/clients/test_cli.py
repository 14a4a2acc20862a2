"""The ``kvkeep`` command against the shared daemon, through click's CliRunner."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import testmodels
from checkpoint_helpers import own_daemon
from click.testing import CliRunner, Result
from daemons import GREEDY
from tqdm import tqdm

import kvkeep
from kvkeep.cli import DEFAULT_MAX_TOKENS, main
from kvkeep.cli import _progress as progress
from kvkeep.cli._output import format_age, format_until

Invoke = Callable[..., Result]


@pytest.fixture
def kv(daemon_address: str) -> Invoke:
    """Run ``kvkeep --address <daemon> ARGS...``; ``input`` feeds stdin."""

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


def test_info_json(kv: Invoke, client: kvkeep.Client) -> None:
    info = ok_json(kv("--json", "info"))
    assert info["mode"] == "exact"
    assert info["slots"] == 4
    assert info["ctx_per_session"] == 1024
    assert info["model_fingerprint"] == client.info().model_fingerprint


def test_info_text(kv: Invoke) -> None:
    result = kv("info")
    assert result.exit_code == 0, result.output
    assert "mode: exact" in result.stdout.splitlines()
    assert "engine: 4 slots x 1024 tokens" in result.stdout


def test_run_answers_in_a_session_it_closes(kv: Invoke, client: kvkeep.Client) -> None:
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
    assert [(m["role"], m["content"]) for m in created["messages"]] == [("system", "Be brief.")]

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


def test_session_create_takes_a_context_policy(kv: Invoke, client: kvkeep.Client) -> None:
    created = ok_json(kv("--json", "session", "create", "--context-policy", "truncate"))
    assert created["context_policy"] == "truncate"
    assert client.session(created["session_id"]).info().context_policy == "truncate"
    client.session(created["session_id"]).close()
    assert kv("session", "create", "--context-policy", "forget").exit_code == 2


def test_session_create_prints_the_id(kv: Invoke, client: kvkeep.Client) -> None:
    result = kv("session", "create")
    assert result.exit_code == 0, result.output
    session_id = result.stdout.strip()
    assert client.session(session_id).info().n_tokens == 0
    client.session(session_id).close()


def test_chat_on_a_new_session(kv: Invoke, client: kvkeep.Client) -> None:
    result = kv("chat", "--max-tokens", "8", "--temperature", "0", input="hello\n\nbye\n")
    assert result.exit_code == 0, result.output
    first_line = result.stderr.splitlines()[0]
    assert first_line.startswith("session s_")
    session_id = first_line.split()[1]
    assert result.stdout.strip()
    # Piped input: no prompts, which would otherwise pile up at the end of the output.
    assert "> " not in result.stderr
    messages = client.session(session_id).info().messages
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [messages[0].content, messages[2].content] == ["hello", "bye"]
    assert messages[1].content.strip()

    # Back in the same session: the conversation goes on.
    again = kv("chat", session_id, "--max-tokens", "4", input="and again\n")
    assert again.exit_code == 0, again.output
    assert len(client.session(session_id).info().messages) == 6
    client.session(session_id).close()


def test_unknown_session_is_one_error_line(kv: Invoke) -> None:
    unknown = "s_" + "0" * 24
    assert unknown in one_error_line(kv("session", "show", unknown))
    one_error_line(kv("--json", "session", "close", unknown))
    one_error_line(kv("chat", unknown, input="hello\n"))
    assert "malformed" in one_error_line(kv("session", "show", "../../etc"))


def test_session_list_says_where_each_is_how_old_and_how_it_ends(kv: Invoke, client: kvkeep.Client) -> None:
    kept = client.create_session("Be brief.", persistent=True)
    used = client.create_session(sampling=GREEDY)
    try:
        used.complete("Bees build", max_tokens=2)
        slot = used.info().location
        assert re.fullmatch(r"slot \d", slot), slot
        listed = kv("session", "list")
        assert listed.exit_code == 0, listed.output
        header, *rows = listed.stdout.splitlines()
        assert header.split()[:2] == ["SESSION", "WHERE"]
        assert header.split()[-3:] == ["AGE", "IDLE", "EXPIRES"]
        (row,) = [r for r in rows if r.startswith(kept.session_id)]
        # Not evaluated yet, and kept until closed (the daemon's --persistent-ttl is 0).
        assert re.fullmatch(rf"{kept.session_id}\s+history only\s+.*\byes\s+\d+ s\s+\d+ s\s+never", row), row
        (row,) = [r for r in rows if r.startswith(used.session_id)]
        # Closed once idle for the daemon's --idle-ttl (an hour).
        assert re.fullmatch(rf"{used.session_id}\s+{slot}\s+.*\bno\s+\d+ s\s+\d+ s\s+in 59 min", row), row
        assert "kvkeep session close ID" in listed.stderr and "--persistent-ttl" in listed.stderr
        shown = kv("session", "show", used.session_id).stdout.splitlines()
        assert f"where: {slot}" in shown and "forked from: -" in shown
    finally:
        kept.close()
        used.close()
    assert format_age(1_000.0, 1_000.0 + 2 * 3600 + 59) == "2 h"
    assert format_age(1_000.0, 1_000.0 + 3 * 86400) == "3 d" and format_age(0.0, 5.0) == "-"
    assert format_until(1_000.0 + 2 * 3600 + 59, 1_000.0) == "in 2 h"
    assert format_until(0.0, 5.0) == "never" and format_until(4.0, 5.0) == "now"


def test_checkpoint_restore_says_what_the_session_holds_now(kv: Invoke, client: kvkeep.Client) -> None:
    s = client.create_session("Be brief.", sampling=GREEDY)
    try:
        s.chat("Name a prime.", max_tokens=4)
        saved = s.checkpoint()
        s.chat("Another?", max_tokens=4)
        restored = kv("checkpoint", "restore", s.session_id, saved.checkpoint_id)
        assert restored.exit_code == 0, restored.output
        info = s.info()
        assert len(info.messages) == 3 and info.n_tokens == saved.n_tokens
        first, last = restored.stdout.splitlines()
        assert (
            first == f"restored {s.session_id} to {saved.checkpoint_id}: {info.n_tokens} tokens, 3 messages"
        )
        assert last.startswith("  last: assistant: ")
    finally:
        s.close()


def test_off_a_terminal_a_long_prompt_gets_a_progress_line_every_few_seconds(
    kv: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "LINE_EVERY", 0.2)  # a few seconds' lines, in a fraction of it
    prompt = "Summarise: " + " ".join(f"item {i}," for i in range(150))
    result = kv("run", "--max-tokens", "1", "--temperature", "0", prompt)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    *lines, end = result.stderr.splitlines()
    assert end == "[length]"
    assert len(lines) >= 2, result.stderr
    for line in lines:
        assert re.fullmatch(r"evaluating the prompt: \d+ s(, \d+/\d+ tokens(, \d+ tokens/s)?)?", line), line


def test_replies_have_a_default_length(kv: Invoke) -> None:
    for command in ("run", "chat"):
        help_text = kv(command, "--help")
        assert help_text.exit_code == 0, help_text.output
        assert f"[default: {DEFAULT_MAX_TOKENS};" in " ".join(help_text.stdout.split())
    # Greedy counting goes on and on: the reply stops at the default, not at the context's end.
    completion = ok_json(kv("--json", "run", "--temperature", "0", "Count from 1 to 2000: 1, 2, 3,"))
    assert completion["finish_reason"] == "length"
    assert len(completion["token_ids"]) == DEFAULT_MAX_TOKENS


def test_run_on_a_model_without_a_chat_template_completes_the_text(tmp_path: Path) -> None:
    prompt = "The three primary colours are"
    gemma = testmodels.gemma3_270m()
    with (
        own_daemon(tmp_path, model=gemma, slots=1, ctx_per_session=512) as d,
        kvkeep.Client(d.address, timeout=60) as client,
    ):
        assert not client.info().has_chat_template
        session = client.create_session(sampling=GREEDY)
        expected = session.complete(prompt, max_tokens=8).text
        session.close()
        runner = CliRunner()
        result = runner.invoke(
            main, ["--address", d.address, "run", "--max-tokens", "8", "--temperature", "0", prompt]
        )
        assert result.exit_code == 0, result.output
        assert result.stdout == expected + ("" if expected.endswith("\n") else "\n")
        said = "the model has no chat template: completing the text"
        assert result.stderr.splitlines()[0] == said
        assert result.stderr.count(said) == 1
        assert client.list_sessions() == []

        chat = runner.invoke(main, ["--address", d.address, "chat"], input="hello\n")
        assert "kvkeep run" in one_error_line(chat)
        assert client.list_sessions() == []


def test_fork_an_imported_checkpoint_without_a_session(
    kv: Invoke, client: kvkeep.Client, tmp_path: Path
) -> None:
    source = client.create_session(sampling=GREEDY)
    source.complete("Once upon a time", max_tokens=4)
    checkpoint = source.checkpoint()
    path = tmp_path / "story.kvkeep"
    client.export_checkpoint(checkpoint.checkpoint_id, path)
    source.close()

    imported = ok_json(kv("--json", "checkpoint", "import", str(path)))
    assert imported["session_id"] == ""
    forked = kv("session", "fork", "--checkpoint", imported["checkpoint_id"])
    assert forked.exit_code == 0, forked.output
    fork = client.session(forked.stdout.strip())
    assert fork.info().n_tokens == checkpoint.n_tokens

    neither = kv("session", "fork")
    assert neither.exit_code == 2
    assert "SESSION_ID or --checkpoint" in neither.stderr
    fork.close()
    client.delete_checkpoint(imported["checkpoint_id"])


def _cli_on_a_terminal(*args: str) -> tuple[int, str, str]:
    """Run the CLI in a subprocess whose stderr is a terminal: (status, stdout, terminal output)."""
    controller, terminal = pty.openpty()
    # A terminal as a person has one: 100 columns (a pty starts with none).
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "from kvkeep.cli import main; main()", *args],
            stdout=subprocess.PIPE,
            stderr=terminal,
            stdin=subprocess.DEVNULL,
            timeout=120,
        )
    finally:
        os.close(terminal)
    seen = b""
    while True:
        try:
            data = os.read(controller, 65536)
        except OSError:  # the terminal's other end is closed: all is read
            break
        if not data:
            break
        seen += data
    os.close(controller)
    return proc.returncode, proc.stdout.decode(), seen.decode()


def test_export_and_import_show_progress_on_a_terminal(
    kv: Invoke, daemon_address: str, client: kvkeep.Client, tmp_path: Path
) -> None:
    session = client.create_session(sampling=GREEDY)
    session.complete("Once upon a time", max_tokens=4)
    checkpoint = session.checkpoint()
    path = tmp_path / "progress.kvkeep"

    rc, out, terminal = _cli_on_a_terminal(
        "--address", daemon_address, "checkpoint", "export", checkpoint.checkpoint_id, str(path)
    )
    assert rc == 0, terminal
    size = path.stat().st_size
    assert out.startswith("wrote ")
    assert "exporting" in terminal and "100%" in terminal

    rc, out, terminal = _cli_on_a_terminal("--address", daemon_address, "checkpoint", "import", str(path))
    assert rc == 0, terminal
    imported = out.strip()
    assert imported.startswith("c_")
    assert "importing" in terminal and "100%" in terminal
    # The total is the file's size, known before the import: 0 of it, then all of it.
    human = tqdm.format_sizeof(size, divisor=1024)
    assert f"0.00/{human}" in terminal and f"{human}/{human}" in terminal

    # Not on a terminal: no bar, only the result.
    again = kv("checkpoint", "export", checkpoint.checkpoint_id, str(tmp_path / "quiet.kvkeep"))
    assert again.exit_code == 0, again.output
    assert again.stderr == ""
    assert again.stdout.startswith("wrote ")
    session.close()
    client.delete_checkpoint(imported)


_BLOCK_LLAMA_CPP = """
import sys


class _NoLlamaCpp:
    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoLlamaCpp())
"""


def test_without_the_daemon_extra_the_client_works_and_serve_says_what_to_install(
    daemon_address: str, tmp_path: Path
) -> None:
    # A sitecustomize makes llama-cpp-python unimportable, as in `pip install kvkeep`.
    (tmp_path / "sitecustomize.py").write_text(_BLOCK_LLAMA_CPP)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", "from kvkeep.cli import main; main()", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)

    blocked = subprocess.run(
        [sys.executable, "-c", "import llama_cpp"], env=env, capture_output=True, text=True, timeout=60
    )
    assert blocked.returncode != 0 and "No module named 'llama_cpp'" in blocked.stderr

    info = cli("--address", daemon_address, "--json", "info")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["mode"] == "exact"

    needs = (
        "kvkeep serve needs the daemon's dependencies (no module 'llama_cpp'): pip install 'kvkeep[daemon]'"
    )
    serve = cli("serve")
    assert serve.returncode == 1, serve.stdout + serve.stderr
    assert serve.stdout == ""
    assert serve.stderr.splitlines() == [f"error: {needs}"]
    # The options are there to read before installing.
    helped = cli("serve", "--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stderr.splitlines() == [f"note: {needs}"]
    assert "--ctx-per-session" in helped.stdout


def test_ctrl_c_stops_a_reply_quietly_with_status_130(daemon_address: str, client: kvkeep.Client) -> None:
    sessions_before = {s.session_id for s in client.list_sessions()}
    run = ["run", "--address", daemon_address, "--max-tokens", "0", "--temperature", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kvkeep.cli import main; main()", *run, "Count from 1 to 2000: 1, 2, 3,"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(1)  # the reply has begun
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    assert proc.stderr.read() == b""
    # The reply's session was closed all the same.
    assert {s.session_id for s in client.list_sessions()} == sessions_before


def test_a_terminal_sees_the_prompt_evaluated_until_the_first_token(daemon_address: str) -> None:
    rc, out, terminal = _cli_on_a_terminal(
        "--address", daemon_address, "run", "--max-tokens", "2", "--temperature", "0", "Hello"
    )
    assert rc == 0, terminal
    assert out.strip()  # the reply, on stdout
    assert "evaluating the prompt 00:0" in terminal
    # Then the daemon's reports: the prompt's tokens, all of them evaluated before the reply.
    shown = re.findall(r"(\d+)/(\d+) tokens", terminal)
    assert shown and shown[-1][0] == shown[-1][1], terminal
    assert re.search(r"\d+ tokens/s", terminal)
    # The line is cleared once the reply begins (spaces over it), before what follows.
    *_, last, cleared, after, end = terminal.split("\r")
    assert last.startswith("evaluating the prompt 100%")
    assert (cleared, after, end) == (" " * len(last), "[length]", "\n")
