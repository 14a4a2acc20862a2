"""Agent CLIs run against the HTTP door as their users run them: OpenAI's Codex CLI
(`codex exec`, with a model provider at the door's /v1 speaking the Responses API) and
Anthropic's Claude Code (`claude -p`, with ANTHROPIC_BASE_URL at the door), both from npm.
scripts/agent-clis installs them into .agent-clis/ (scripts/test runs it where node is);
without node or them, their tests skip and say why.

What is checked: each CLI completes a turn on the embedded model (exit status 0, an answer
printed) and every request it sent was served 200 (the access log); its second run, on a
daemon restarted on the same state directory, reads part of its long prompt (instructions
and tools) instead of evaluating it, as the CLI's own usage report says. Each CLI also
completes a task that needs a tool call, on the scripted model of
tests/support/scriptedmodels.py (weights chosen so that it calls a command tool, then
answers once the result is in its context): the CLI runs the command the model asked for,
sends its output back, and prints the model's answer. Without node: the scripted model makes
that round trip through the door with the `openai` client, and the Messages API takes a
system message among the messages, after the user's, as Claude Code sends its environment.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import scriptedmodels
from accesslog import await_lines
from checkpoint_helpers import own_daemon
from daemons import InProcessDaemon

import kvkeep

BIN = Path(__file__).resolve().parents[2] / ".agent-clis" / "node_modules" / ".bin"
CODEX = BIN / "codex"
CLAUDE = BIN / "claude"
# Codex's instructions and tools are 9,190 tokens of the default model's, Claude Code's system
# prompt with its Bash tool 3,380 (20,600 with all its tools).
CTX = 12288
# Both CLIs take a reply cut short for a failed turn (Claude Code asks for more first), so
# their replies have room for the one word asked; Codex asks for no limit: the daemon's
# default caps it, CLAUDE_CODE_MAX_OUTPUT_TOKENS Claude Code's.
MAX_TOKENS = 256
PROMPT = "Reply with the single word: hello."
# Each CLI is given time for its prompt on a loaded machine's CPU, and gives up long after.
RUN_SECONDS = 900


def needs(cli: Path) -> pytest.MarkDecorator:
    """Skip unless node and the installed CLI are here, saying which is missing."""
    if shutil.which("node") is None:
        return pytest.mark.skip(reason="node is not installed: the agent CLIs are npm packages")
    return pytest.mark.skipif(not cli.exists(), reason=f"{cli.name} is not installed: run scripts/agent-clis")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


def start(state: Path) -> InProcessDaemon:
    return InProcessDaemon.with_settings(
        state, http_address="127.0.0.1:0", ctx_per_session=CTX, default_max_tokens=MAX_TOKENS, slots=1
    )


@pytest.fixture
def door(state: Path) -> Iterator[InProcessDaemon]:
    d = start(state)
    try:
        yield d
    finally:
        d.stop()


def url(d: InProcessDaemon) -> str:
    assert d.daemon is not None
    return f"http://127.0.0.1:{d.daemon.http_port}"


def served(caplog: pytest.LogCaptureFixture, route: str = "", at_least: int = 0) -> list[str]:
    """The access log's lines of the HTTP door, in order, once `at_least` of them name `route`
    (the door writes a line after its reply has gone, so a client can be done before it)."""

    def door(lines: list[str]) -> list[str]:
        return [line for line in lines if "http " in line]

    return door(await_lines(caplog, lambda ls: len([x for x in door(ls) if route in x]) >= at_least))


def quiet_env(home: Path) -> dict[str, str]:
    """The environment a CLI runs in: its own home, and nothing phoned home."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def run(
    args: list[str], env: dict[str, str], cwd: Path, *, check: bool = True
) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        args, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_SECONDS
    )
    assert done.returncode == 0 or not check, (
        f"{args[0]} exited {done.returncode}: {done.stdout[-3000:]} {done.stderr[-3000:]}"
    )
    return done


def codex_events(door: str, home: Path, prompt: str, *, check: bool = True) -> list[dict[str, Any]]:
    """The events of `codex exec --json` on one prompt, with a model provider at `door`
    (`check`: that it exits 0)."""
    codex_home = home / "codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        'model = "smollm2"\n'
        'model_provider = "kvkeep"\n'
        "[model_providers.kvkeep]\n"
        'name = "kvkeep"\n'
        f'base_url = "{door}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "KVKEEP_API_KEY"\n'
        # The Responses door's stream opens with the reply's first token, after the prompt.
        f"stream_idle_timeout_ms = {RUN_SECONDS * 1000}\n"
    )
    env = {**quiet_env(home), "CODEX_HOME": str(codex_home), "KVKEEP_API_KEY": "dummy"}
    done = run(
        [str(CODEX), "exec", "--json", "--skip-git-repo-check", prompt], env, home / "work", check=check
    )
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def completed(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The items of one kind that Codex's events say were completed."""
    return [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == kind]


def codex(d: InProcessDaemon, home: Path) -> dict[str, Any]:
    """`codex exec --json` on one prompt: its turn's usage, as the daemon counted it (Codex
    reports none for a turn it failed)."""
    with kvkeep.Client(d.address) as client:
        before = client.info()
    events = codex_events(url(d), home, PROMPT, check=False)
    answers = [item["text"] for item in completed(events, "agent_message")]
    assert answers and answers[-1].strip(), events[-5:]
    (end,) = [e for e in events if e["type"] in ("turn.completed", "turn.failed")]
    if end["type"] == "turn.failed":
        # Codex sends no temperature: the embedded model samples at the default one and may
        # talk past the daemon's cap, and Codex fails a turn whose reply was cut short. Any
        # other failure fails.
        assert "reason: max_output_tokens" in end["error"]["message"], events[-5:]
    with kvkeep.Client(d.address) as client:
        after = client.info()
    usage = {
        "input_tokens": after.tokens_evaluated - before.tokens_evaluated,
        "cached_input_tokens": after.tokens_reused - before.tokens_reused,
        "codex": end.get("usage"),
    }
    print("codex:", usage, repr(answers[-1][:200]))
    return usage


def claude_env(door: str, home: Path) -> dict[str, str]:
    """The environment Claude Code runs in, with the door as Anthropic's API."""
    return {
        **quiet_env(home),
        "ANTHROPIC_BASE_URL": door,
        "ANTHROPIC_API_KEY": "dummy",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_TOKENS),
    }


def claude(d: InProcessDaemon, home: Path) -> dict[str, Any]:
    """`claude -p --output-format json` on one prompt, with its Bash tool; its result."""
    args = [str(CLAUDE), "-p", PROMPT, "--output-format", "json", "--tools", "Bash"]
    done = run(args, claude_env(url(d), home), home / "work", check=False)
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["subtype"] == "success", done.stdout[-3000:]
    if result["is_error"]:
        # The embedded model samples at Claude Code's temperature and may talk past the cap
        # (every reply then ends "max_tokens", as the door says): the model's limit, not the
        # door's. Any other error fails.
        assert result.get("api_error") == "max_output_tokens", done.stdout[-3000:]
        assert result["usage"]["output_tokens"] >= MAX_TOKENS, done.stdout[-3000:]
    else:
        assert done.returncode == 0 and str(result["result"]).strip(), done.stdout[-3000:]
    print("claude:", result["usage"], repr(str(result["result"])[:200]))
    return result


@needs(CODEX)
@pytest.mark.timeout(2 * RUN_SECONDS)
def test_codex_exec_completes_a_turn_and_reads_its_prefix_after_a_restart(
    state: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvkeepd.access")
    d = start(state)
    try:
        first = codex(d, tmp_path / "first")
    finally:
        d.stop()
    lines = served(caplog)
    assert any("POST /v1/responses" in line for line in lines), lines
    assert all(line.endswith(" 200") for line in lines), lines
    assert first["input_tokens"] > 4000, first

    caplog.clear()
    d = start(state)
    try:
        second = codex(d, tmp_path / "second")
    finally:
        d.stop()
    assert all(line.endswith(" 200") for line in served(caplog)), served(caplog)
    assert second["cached_input_tokens"] > 0, second


@needs(CLAUDE)
@pytest.mark.timeout(2 * RUN_SECONDS)
def test_claude_code_completes_a_turn_and_reads_its_prefix_after_a_restart(
    state: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvkeepd.access")
    d = start(state)
    try:
        first = claude(d, tmp_path / "first")
    finally:
        d.stop()
    lines = served(caplog)
    assert any("POST /v1/messages" in line for line in lines), lines
    assert all(line.endswith(" 200") for line in lines), lines
    assert first["usage"]["input_tokens"] + first["usage"]["cache_creation_input_tokens"] > 3000, first

    caplog.clear()
    d = start(state)
    try:
        second = claude(d, tmp_path / "second")
    finally:
        d.stop()
    assert all(line.endswith(" 200") for line in served(caplog)), served(caplog)
    assert second["usage"]["cache_read_input_tokens"] > 0, second


def test_a_system_message_among_the_messages_is_rendered_where_it_stands(door: InProcessDaemon) -> None:
    user = {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}
    environment = {
        "role": "system",
        "content": [
            {"type": "text", "text": "The working directory is /srv.", "cache_control": {"type": "ephemeral"}}
        ],
    }
    with httpx.Client(base_url=url(door), headers={"x-api-key": "dummy"}, timeout=120) as http:
        alone = http.post("/v1/messages/count_tokens", json={"model": "m", "messages": [user]})
        both = http.post("/v1/messages/count_tokens", json={"model": "m", "messages": [user, environment]})
        assert alone.status_code == 200 and both.status_code == 200, both.text
        assert both.json()["input_tokens"] > alone.json()["input_tokens"]
        reply = http.post(
            "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": [user, environment]}
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["output_tokens"] >= 1
        # An assistant's message last is still refused, a system message after it or not.
        assistant = {"role": "assistant", "content": "Hel"}
        cut = http.post(
            "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": [user, assistant, environment]}
        )
        assert cut.status_code == 400, cut.text


# ---- a task that needs a tool call, on the scripted model ------------------------------------

TASK = f"Run the command `{scriptedmodels.COMMAND}`, then say that it is done."
# What the command prints.
OUTPUT = scriptedmodels.COMMAND.removeprefix("echo ")
# Codex CLI's command tool and Claude Code's, as they send them (their first properties; the
# rest are optional, as theirs are).
EXEC_COMMAND = {
    "name": "exec_command",
    "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}, "tty": {"type": "boolean"}},
        "required": ["cmd"],
        "additionalProperties": False,
    },
}
BASH = {
    "name": "Bash",
    "description": "Executes a given bash command and returns its output.",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
        "required": ["command"],
        "additionalProperties": False,
    },
}
VIEW_IMAGE = {
    "name": "view_image",
    "description": "View a local image file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[InProcessDaemon]:
    """A daemon serving the scripted model, its HTTP door open."""
    with own_daemon(
        tmp_path / "scripted",
        model=scriptedmodels.path(),
        slots=1,
        http_address="127.0.0.1:0",
        ctx_per_session=CTX,
        default_max_tokens=MAX_TOKENS,
    ) as d:
        yield d


@pytest.mark.parametrize(("tool", "argument"), [(EXEC_COMMAND, "cmd"), (BASH, "command")])
def test_the_scripted_model_calls_its_tool_then_answers_through_the_door(
    scripted: InProcessDaemon, tool: dict[str, Any], argument: str
) -> None:
    oai = openai.OpenAI(base_url=f"{url(scripted)}/v1", api_key="dummy")
    tools: Any = [{"type": "function", "function": f} for f in (VIEW_IMAGE, tool)]
    ask: list[Any] = [{"role": "user", "content": TASK}]
    # At temperature 1, as the CLIs sample, whatever the seed.
    for seed in range(3):
        first = oai.chat.completions.create(
            model="m", messages=ask, tools=tools, temperature=1, seed=seed, max_tokens=MAX_TOKENS
        )
        assert first.choices[0].finish_reason == "tool_calls", first
        (call,) = first.choices[0].message.tool_calls or []
        assert call.type == "function"
        assert (call.function.name, json.loads(call.function.arguments)) == (
            tool["name"],
            {argument: scriptedmodels.COMMAND},
        )
        result = {"role": "tool", "tool_call_id": call.id, "content": OUTPUT}
        again = [*ask, first.choices[0].message.model_dump(exclude_none=True), result]
        second = oai.chat.completions.create(
            model="m", messages=again, tools=tools, temperature=1, seed=seed, max_tokens=MAX_TOKENS
        )
        assert second.choices[0].finish_reason == "stop", second
        assert (second.choices[0].message.content, second.choices[0].message.tool_calls) == (
            scriptedmodels.ANSWER,
            None,
        )
    # The Responses API, as Codex speaks it: the whole input resent with the call's output.
    function: Any = {"type": "function", **tool}
    step = oai.responses.create(model="m", input=TASK, tools=[function], store=False)
    (item,) = step.output
    assert item.type == "function_call" and json.loads(item.arguments) == {argument: scriptedmodels.COMMAND}
    sent: Any = {
        "type": "function_call",
        "call_id": item.call_id,
        "name": item.name,
        "arguments": item.arguments,
    }
    output: Any = {"type": "function_call_output", "call_id": item.call_id, "output": OUTPUT}
    end = oai.responses.create(
        model="m", input=[{"role": "user", "content": TASK}, sent, output], tools=[function], store=False
    )
    assert end.output_text == scriptedmodels.ANSWER, end
    # Without tools it answers at once.
    plain = oai.chat.completions.create(model="m", messages=ask, max_tokens=MAX_TOKENS)
    assert plain.choices[0].message.content == scriptedmodels.ANSWER


@needs(CODEX)
@pytest.mark.timeout(RUN_SECONDS)
def test_codex_exec_runs_the_command_the_model_calls(
    scripted: InProcessDaemon, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvkeepd.access")
    events = codex_events(url(scripted), tmp_path, TASK)
    (command,) = completed(events, "command_execution")
    assert scriptedmodels.COMMAND in command["command"], command
    assert (command["exit_code"], command["aggregated_output"].strip()) == (0, OUTPUT), command
    # The model answers only once a tool's result is in its context (with tools offered, as
    # Codex offers them every request): the second request carried the call's output.
    assert [item["text"] for item in completed(events, "agent_message")] == [scriptedmodels.ANSWER], events
    lines = served(caplog, "POST /v1/responses", 2)
    assert len([line for line in lines if "POST /v1/responses" in line]) == 2, lines
    assert all(line.endswith(" 200") for line in lines), lines
    (turn,) = [e for e in events if e["type"] == "turn.completed"]
    print("codex:", command["command"], repr(command["aggregated_output"]), turn["usage"])


@needs(CLAUDE)
@pytest.mark.timeout(RUN_SECONDS)
def test_claude_code_runs_the_command_the_model_calls(
    scripted: InProcessDaemon, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvkeepd.access")
    args = [str(CLAUDE), "-p", TASK, "--output-format", "stream-json", "--verbose"]
    args += ["--tools", "Bash", "--allowedTools", "Bash"]
    done = run(args, claude_env(url(scripted), tmp_path), tmp_path / "work")
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    def blocks(role: str, kind: str) -> list[dict[str, Any]]:
        return [
            b
            for e in events
            if e["type"] == role
            for b in e["message"]["content"]
            if isinstance(b, dict) and b.get("type") == kind
        ]

    (use,) = blocks("assistant", "tool_use")
    assert (use["name"], use["input"]) == ("Bash", {"command": scriptedmodels.COMMAND}), use
    (result,) = blocks("user", "tool_result")
    assert result["tool_use_id"] == use["id"] and not result["is_error"], result
    assert str(result["content"]).strip() == OUTPUT, result
    # The model answers only once the result is in its context: the next request carried it.
    end = events[-1]
    assert end["type"] == "result" and not end["is_error"], end
    assert end["result"] == scriptedmodels.ANSWER, end
    lines = served(caplog, "POST /v1/messages", 2)
    assert len([line for line in lines if "POST /v1/messages" in line]) >= 2, lines
    assert all(line.endswith(" 200") for line in lines), lines
    print("claude:", use["input"], repr(result["content"]), end["usage"])
