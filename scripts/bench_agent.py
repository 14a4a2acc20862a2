"""scripts/bench agent [--peer LLAMA_SERVER]: an agent loop four ways, in lockstep in one run.

An agent's loop: a long system prompt with tool definitions (~1,000 tokens), a task, then
steps of a tool call and its result, the next call... (`--steps`, 20). Every step asks for a
call (`tool_choice` required, one call, greedy), so the four ways do the same work:

- `previous_response_id`: kvkeep's `/v1/responses`, each step sending only the tool's
  result and the previous response's id;
- resent to kvkeep's chat door: `/v1/chat/completions` given the whole conversation each
  step (the door continues the session it kept for it);
- resent to llama-server (`--jinja`, `cache_prompt`; built by scripts/build-llama-server)
  the same way, when `--peer` names its binary;
- `previous_response_id` with the daemon killed (`kill -9`) and started again before step
  `--restart-at` (10): that step continues from the stored response on disk.

Each way runs on a server of its own (a fresh state directory: no way finds another's
blocks), with the same threads and context, and the ways take their steps in turn (step 1 of
each, then step 2 of each...), so that the machine's noise falls on all of them alike.
Reported per way: per-step latency (median, p95) and the tokens each step evaluated (the
prompt tokens not taken from a cache); the first step after the restart against the median
step; and a branch: step `--branch-at`'s response continued again (a fork from its
checkpoint) against the in-place step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import table

from kvkeepd.config.settings import default_model_path

CONTEXT = 8192
MAX_TOKENS = 128
TOOLS = [
    ("read_file", "Read a file of the repository and return its text.", {"path": "string"}),
    (
        "search_code",
        "Search the repository for a regular expression; return matching lines.",
        {"pattern": "string"},
    ),
    ("run_tests", "Run the test suite, or one test file, and return the failures.", {"target": "string"}),
    ("list_dir", "List the files of a directory of the repository.", {"path": "string"}),
]
RULES = [
    "You are a careful software engineer working in a Python repository on behalf of a user.",
    "You work by calling tools: read files before changing them, search before guessing where code lives,",
    "and run the tests after every change. Never invent file names, functions or test results.",
    "When a tool fails, read its error, decide what it means, and try a different approach.",
    "Keep changes small and focused; do not reformat code you did not change.",
    "Prefer the standard library; add no dependency without a reason the user would accept.",
    "Every public function has a docstring that says what it returns and what it raises.",
    "Types are checked strictly: annotate every parameter and return value.",
    "Errors are raised with a message that names the value at fault, never silently ignored.",
    "Tests run against real things: no mocks of the code under test, no hard-coded results.",
    "A test that cannot fail is worse than no test; check that yours fails before the fix.",
    "Log with the logging module at the right level; never print from library code.",
    "Configuration is read once at start into a frozen value; nothing reads the environment later.",
    "Concurrency: every piece of mutable state has one owner, and transitions run to their end.",
    "When the task is done, say what changed, which tests cover it, and what remains.",
]


def system_prompt() -> str:
    """About 700 tokens of instructions (the tools add the rest of ~1,000)."""
    lines = [f"{i + 1}. {rule}" for i, rule in enumerate(RULES * 3)]
    return "\n".join(["# How you work", *lines, "Answer only by calling one tool at a time."])


def tools_chat() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": text,
                "parameters": {
                    "type": "object",
                    "properties": {k: {"type": v} for k, v in params.items()},
                    "required": list(params),
                },
            },
        }
        for name, text, params in TOOLS
    ]


def tools_responses() -> list[dict[str, Any]]:
    return [{"type": "function", **t["function"]} for t in tools_chat()]


def tool_result(step: int) -> str:
    """What the tool answered at a step: about 50 tokens, different every step."""
    return (
        f"step {step}: ok. src/app/module_{step}.py lines {10 * step}-{10 * step + 9}:\n"
        f"def handler_{step}(request):\n    value = request.get('key_{step}')\n"
        f"    if value is None:\n        raise KeyError('key_{step}')\n    return value * {step}\n"
    )


TASK = "The tests in tests/test_app.py fail with a KeyError. Find the cause and fix it."


# ---- servers ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def post(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """POST a JSON body; (seconds, the JSON answer)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            found: dict[str, Any] = json.loads(answer.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: {e.code} {e.read()[:2000]!r}") from None
    return time.perf_counter() - started, found


def wait_ready(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.1)


class Daemon:
    """A kvkeep daemon subprocess serving HTTP on a port of its own, which can be killed
    and started again on the same state directory."""

    def __init__(self, threads: int) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="kvkeep-agent-"))
        self.port = free_port()
        self.threads = threads
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "kvkeepd",
            "--address",
            "127.0.0.1:0",
            "--state-dir",
            str(self.state / "s"),
        ]
        cmd += ["--http", f"127.0.0.1:{self.port}", "--threads", str(self.threads), "--slots", "2"]
        cmd += ["--ctx-per-session", str(CONTEXT), "--log-level", "warning"]
        with (self.state / "daemon.log").open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        wait_ready(f"http://127.0.0.1:{self.port}/health", self.proc, "the daemon")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        shutil.rmtree(self.state, ignore_errors=True)


@contextmanager
def kvkeep_daemon(threads: int) -> Iterator[Daemon]:
    d = Daemon(threads)
    try:
        d.start()
        yield d
    finally:
        d.stop()


@contextmanager
def llama_server(binary: Path, threads: int) -> Iterator[str]:
    port = free_port()
    cmd = [str(binary), "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", str(threads), "-tb", str(threads), "-c", str(CONTEXT), "-np", "1", "--jinja"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, "llama-server")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(30)


# ---- the loops ---------------------------------------------------------------------------


class Step:
    def __init__(self, seconds: float, evaluated: int, generated: int, response: dict[str, Any]) -> None:
        self.seconds = seconds
        self.evaluated = evaluated
        self.generated = generated
        self.response = response


def by_responses(url: str, steps: int) -> Iterator[Step]:
    """The loop by previous_response_id, one step at a time (each Step's `response`: the
    response, its request body under "request")."""
    base = {
        "model": "agent",
        "instructions": system_prompt(),
        "tools": tools_responses(),
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": MAX_TOKENS,
    }
    previous: dict[str, Any] | None = None
    for step in range(steps):
        if previous is None:
            body = {**base, "input": TASK}
        else:
            call = next(o for o in previous["output"] if o["type"] == "function_call")
            given = [
                {"type": "function_call_output", "call_id": call["call_id"], "output": tool_result(step)}
            ]
            body = {**base, "input": given, "previous_response_id": previous["id"]}
        seconds, previous = post(url + "/responses", body)
        u = previous["usage"]
        yield Step(
            seconds,
            u["input_tokens"] - u["input_tokens_details"]["cached_tokens"],
            u["output_tokens"],
            {**previous, "request": body},
        )


def by_resending(url: str, steps: int, peer: bool) -> Iterator[Step]:
    """The loop resending the whole conversation to a chat door, one step at a time."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": TASK},
    ]
    body: dict[str, Any] = {
        "model": "agent",
        "tools": tools_chat(),
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    if peer:
        body["cache_prompt"] = True
    for step in range(steps):
        seconds, answer = post(url + "/chat/completions", {**body, "messages": messages})
        reply = answer["choices"][0]["message"]
        u = answer.get("usage", {})
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        evaluated = answer.get("timings", {}).get("prompt_n", u.get("prompt_tokens", 0) - cached)
        generated = answer.get("timings", {}).get("predicted_n", u.get("completion_tokens", 0))
        yield Step(seconds, int(evaluated), int(generated), answer)
        calls = reply.get("tool_calls") or []
        messages.append({"role": "assistant", "content": reply.get("content") or "", "tool_calls": calls})
        call_id = calls[0]["id"] if calls else f"call_{step}"
        messages.append({"role": "tool", "tool_call_id": call_id, "content": tool_result(step + 1)})


def summary(name: str, steps: list[Step]) -> tuple[str, ...]:
    times = sorted(s.seconds * 1000 for s in steps[1:])  # the first step evaluates the prompt
    p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
    evaluated = [s.evaluated for s in steps[1:]]
    return (
        name,
        f"{steps[0].seconds * 1000:,.0f} ms",
        f"{statistics.median(times):,.0f} ms",
        f"{p95:,.0f} ms",
        f"{statistics.median(evaluated):,.0f}",
        f"{sum(s.evaluated for s in steps):,}",
        f"{statistics.median(s.generated for s in steps[1:]):,.0f}",
    )


def run(args: argparse.Namespace) -> None:
    """The ways in lockstep: each step of every way in turn, so that the machine's noise falls
    on all of them alike."""
    threads, n = args.threads, args.steps
    with contextlib.ExitStack() as stack:
        chained_d = stack.enter_context(kvkeep_daemon(threads))
        resent_d = stack.enter_context(kvkeep_daemon(threads))
        restarted_d = stack.enter_context(kvkeep_daemon(threads))
        ways: dict[str, Iterator[Step]] = {
            "kvkeep, previous_response_id": by_responses(chained_d.url, n),
            "kvkeep chat door, whole conversation resent": by_resending(resent_d.url, n, peer=False),
        }
        if args.peer is not None:
            url = stack.enter_context(llama_server(args.peer, threads))
            ways["llama-server --jinja, cache_prompt, resent"] = by_resending(url, n, peer=True)
        restarted = f"kvkeep, previous_response_id, kill -9 before step {args.restart_at}"
        ways[restarted] = by_responses(restarted_d.url, n)
        done: dict[str, list[Step]] = {name: [] for name in ways}
        for step in range(n):
            if step == args.restart_at:
                restarted_d.kill()
                restarted_d.start()
            for name, way in ways.items():
                done[name].append(next(way))
            print(f"step {step + 1}/{n}", file=sys.stderr)
        chained = done["kvkeep, previous_response_id"]
        branch = chained[args.branch_at + 1].response["request"]
        branch_seconds, branched = post(
            chained_d.url + "/responses",
            {**branch, "previous_response_id": chained[args.branch_at].response["id"]},
        )
    rows: list[tuple[str, ...]] = [
        (
            "way",
            "first step",
            "step, median",
            "step, p95",
            "tokens evaluated per step, median",
            "tokens evaluated, all",
            "tokens generated per step, median",
        )
    ]
    rows += [summary(name, steps) for name, steps in done.items()]
    table(rows)
    median = statistics.median(s.seconds for s in chained[1:])
    after = done[restarted][args.restart_at]
    normal = statistics.median(s.seconds for s in done[restarted][1:] if s is not after)
    print()
    for name, steps in done.items():
        if name != "kvkeep, previous_response_id" and name != restarted:
            ratio = median / statistics.median(s.seconds for s in steps[1:])
            print(f"chaining / {name}, median step: {ratio:.2f}x")
    print(
        f"first step after the restart: {after.seconds * 1000:,.0f} ms, {after.evaluated} tokens "
        f"evaluated ({after.seconds / normal:.2f}x the median step of that run)"
    )
    u = branched["usage"]
    evaluated = u["input_tokens"] - u["input_tokens_details"]["cached_tokens"]
    in_place = chained[args.branch_at + 1]
    print(
        f"branch from step {args.branch_at} (a fork of its checkpoint): {branch_seconds * 1000:,.0f} ms, "
        f"{evaluated} tokens evaluated; the same step in place: {in_place.seconds * 1000:,.0f} ms, "
        f"{in_place.evaluated} evaluated"
    )


def add_parser(sub: Any) -> None:
    """The `agent` sub-command's arguments."""
    a = sub.add_parser("agent", help="an agent loop four ways (bench_agent.py)")
    a.add_argument("--steps", type=int, default=20)
    a.add_argument("--restart-at", type=int, default=10)
    a.add_argument("--branch-at", type=int, default=5)
    a.add_argument("--peer", type=Path, default=None, metavar="LLAMA_SERVER", help="a llama-server binary")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    add_parser(parser.add_subparsers(dest="what", required=True))
    run(parser.parse_args())
