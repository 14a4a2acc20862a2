"""scripts/bench agent-cli [--peer LLAMA_SERVER]: agent CLIs' loops, in the shapes they send.

Two shapes, each a prefix of about 6,500 tokens (a coding agent's instructions, ~15 function
tools with JSON schemas, a project guide: agent_cli_prompts.py), a task, then `--steps` (10)
steps, each resending the whole conversation with what the model answered and one new item
(a tool's result, about 80 tokens; a user message where the model wrote text). Greedy, at
most `--max-tokens` (16) a reply, so that a step's time is its prompt's: what is evaluated.

- **Codex-shaped**, on `/v1/responses`: `instructions`, `tools`, `store: false`, a
  `prompt_cache_key` per agent, the whole `input` every step. Against kvkeep's own
  `previous_response_id` chaining (each step sends only its new item, `store: true`), and,
  with `--peer`, llama-server's `/v1/responses` (`--jinja`, `--cache-reuse 256`, its RAM
  prompt cache on by default).
- **Claude-Code-shaped**, on `/v1/messages`: `system` as two text blocks with `cache_control`
  on the last, `tools` with `input_schema`, the whole `messages` every step, the last
  message's last block marked `cache_control` too (as Claude Code does); against
  llama-server's `/v1/messages`.

One agent first, the ways taking their steps in turn on servers of their own, so that the
machine's noise falls on all alike; then each server stopped (SIGTERM) and started again on
the same state, and one more step: the first after a restart. Then `--agents` (4) agents at
once on 2 slots (kvkeep `--slots 2`, llama-server `-np 2`), on kvkeep then on llama-server.
Reported: the first step, the per-step median and p95 of the others, the tokens evaluated
per step (the prompt's tokens not taken from a cache), and ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import agent_cli_prompts as prompts
from bench import table
from bench_agent import free_port, post, wait_ready

from kvkeepd.config.settings import default_model_path

# The prefix (~6,500 tokens), ten steps and one after a restart fit with room to spare.
CONTEXT = 10240


# ---- servers ----------------------------------------------------------------------------


class Server:
    """A kvkeep daemon or llama-server subprocess on a port of its own, which can be stopped
    and started again on the same state."""

    def __init__(self, name: str, cmd: Callable[[int], list[str]], work: Path) -> None:
        self.name = name
        self.cmd = cmd
        self.work = work
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with (self.work / f"{self.name}.log").open("ab") as log:
            self.proc = subprocess.Popen(self.cmd(self.port), stdout=log, stderr=log)
        wait_ready(f"{self.url}/health", self.proc, self.name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)

    def restart(self) -> None:
        self.stop()
        self.start()


@contextmanager
def servers(args: argparse.Namespace, slots: int) -> Iterator[Callable[[str, bool], Server]]:
    """A factory of servers (name, is llama-server), all stopped and removed at the end."""
    work = Path(tempfile.mkdtemp(prefix="kvkeep-agent-cli-"))
    started: list[Server] = []
    threads, model = str(args.threads), str(default_model_path())

    def kvkeep_cmd(state: Path) -> Callable[[int], list[str]]:
        def cmd(port: int) -> list[str]:
            return [
                *(sys.executable, "-m", "kvkeepd", "--address", "127.0.0.1:0"),
                *("--state-dir", str(state), "--http", f"127.0.0.1:{port}", "--threads", threads),
                *("--slots", str(slots), "--ctx-per-session", str(CONTEXT), "--log-level", "warning"),
            ]

        return cmd

    def peer_cmd(port: int) -> list[str]:
        return [
            *(str(args.peer), "-m", model, "--host", "127.0.0.1", "--port", str(port)),
            *("-t", threads, "-tb", threads, "-c", str(CONTEXT * slots), "-np", str(slots)),
            *("--jinja", "--cache-reuse", "256"),
        ]

    def make(name: str, peer: bool) -> Server:
        server = Server(name, peer_cmd if peer else kvkeep_cmd(work / name), work)
        server.start()
        started.append(server)
        return server

    try:
        yield make
    finally:
        for server in started:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


# ---- the loops ---------------------------------------------------------------------------


@dataclass
class Step:
    seconds: float
    evaluated: int
    generated: int


def codex_loop(
    url: str, agent: int, steps: int, max_tokens: int, short: bool, chained: bool = False
) -> Iterator[Step]:
    """The Codex-shaped loop on /v1/responses, one step per next(); with `chained`, by
    previous_response_id (stored responses) instead of resending everything."""
    base: dict[str, Any] = {
        "model": "agent",
        "instructions": prompts.rules_text(short),
        "tools": prompts.tools_responses(short),
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "store": chained,
        "prompt_cache_key": f"agent-{agent}",
        "include": [],
        "temperature": 0,
        "max_output_tokens": max_tokens,
    }
    new: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        for text in (prompts.guide_text(short), prompts.environment_text(), prompts.task(agent))
    ]
    items: list[dict[str, Any]] = []
    previous: str | None = None
    for step in range(1, steps + 1):
        items += new
        body = {**base, "input": items}
        if chained and previous is not None:
            body = {**base, "input": new, "previous_response_id": previous}
        seconds, answer = post(url + "/v1/responses", body)
        previous = answer["id"]
        u = answer["usage"]
        yield Step(
            seconds, u["input_tokens"] - u["input_tokens_details"]["cached_tokens"], u["output_tokens"]
        )
        new = []
        for out in answer["output"]:
            if out["type"] == "function_call":
                call = {k: out[k] for k in ("type", "call_id", "name", "arguments")}
                new += [
                    call,
                    {
                        "type": "function_call_output",
                        "call_id": out["call_id"],
                        "output": prompts.tool_result(agent, step),
                    },
                ]
            elif out["type"] == "message":
                text = "".join(part.get("text", "") for part in out["content"])
                new.append(
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": text}],
                    }
                )
        if not any(item["type"] == "function_call_output" for item in new):
            text = "Here is what the shell gave:\n" + prompts.tool_result(agent, step)
            new.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})


def claude_loop(url: str, agent: int, steps: int, max_tokens: int, short: bool) -> Iterator[Step]:
    """The Claude-Code-shaped loop on /v1/messages, one step per next()."""
    base: dict[str, Any] = {
        "model": "agent",
        "system": [
            {"type": "text", "text": "You are an interactive command-line coding agent."},
            {"type": "text", "text": prompts.rules_text(short), "cache_control": {"type": "ephemeral"}},
        ],
        "tools": prompts.tools_messages(short),
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": f"agent-{agent}"},
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    reminder = f"<system-reminder>\n{prompts.guide_text(short)}\n</system-reminder>"
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "text", "text": reminder}, {"type": "text", "text": prompts.task(agent)}],
        }
    ]
    for step in range(1, steps + 1):
        # As Claude Code, the last message's last block is marked too: the conversation so far is
        # a breakpoint, which the next step (or the first after a restart) reads.
        last = messages[-1]
        marked = [*last["content"][:-1], {**last["content"][-1], "cache_control": {"type": "ephemeral"}}]
        sent = [*messages[:-1], {**last, "content": marked}]
        seconds, answer = post(url + "/v1/messages", {**base, "messages": sent})
        u = answer["usage"]
        evaluated = u["input_tokens"] + (u.get("cache_creation_input_tokens") or 0)
        yield Step(seconds, evaluated, u["output_tokens"])
        content = [
            b
            for b in answer["content"]
            if b["type"] in ("text", "tool_use") and (b["type"] != "text" or b["text"])
        ]
        messages.append({"role": "assistant", "content": content or [{"type": "text", "text": "..."}]})
        calls = [b for b in content if b["type"] == "tool_use"]
        if calls:
            given = [
                {"type": "tool_result", "tool_use_id": b["id"], "content": prompts.tool_result(agent, step)}
                for b in calls
            ]
        else:
            given = [
                {"type": "text", "text": "Here is what the shell gave:\n" + prompts.tool_result(agent, step)}
            ]
        messages.append({"role": "user", "content": given})


# ---- measures ----------------------------------------------------------------------------

Loop = Callable[[str, int], Iterator[Step]]


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def row(name: str, first: list[Step], rest: list[Step], vs: tuple[str, float] | None) -> tuple[str, ...]:
    """A table row: the first steps, then the others' median and p95; `vs`: (what, its median
    step in seconds) for the ratio."""
    times = [s.seconds * 1000 for s in rest]
    median = statistics.median(times)
    return (
        name,
        " / ".join(f"{s.seconds * 1000:,.0f}" for s in first) + " ms",
        f"{median:,.0f} ms",
        f"{p95(times):,.0f} ms",
        f"{statistics.median(s.evaluated for s in rest):,.0f}",
        f"{statistics.median(s.generated for s in rest):,.0f}",
        f"{median / 1000 / vs[1]:.2f}x {vs[0]}" if vs else "1x",
    )


HEADER = (
    "way",
    "first step",
    "step, median",
    "step, p95",
    "evaluated/step",
    "generated/step",
    "ratio (median)",
)


def lockstep(ways: dict[str, tuple[Server, Iterator[Step]]], steps: int) -> dict[str, list[Step]]:
    """Each way's steps, taken in turn; then each server restarted and one step more."""
    done: dict[str, list[Step]] = {name: [] for name in ways}
    for step in range(steps):
        for name, (_, way) in ways.items():
            done[name].append(next(way))
        print(f"step {step + 1}/{steps}", file=sys.stderr)
    for name, (server, way) in ways.items():
        server.restart()
        done[name].append(next(way))
    return done


def one_agent(
    args: argparse.Namespace, shape: str, ways: dict[str, tuple[Server, Iterator[Step]]], reference: str
) -> None:
    done = lockstep(ways, args.steps)
    n = args.steps
    medians = {name: statistics.median(s.seconds for s in steps[1:n]) for name, steps in done.items()}
    rows = [HEADER]
    for name, steps in done.items():
        vs = None if name == reference else (f"vs {reference}", medians[reference])
        rows.append(row(name, steps[:1], steps[1:n], vs))
    print(f"\n{shape}, one agent, {n} steps (steps 2-{n} in the median and p95):")
    table(rows)
    for name, steps in done.items():
        after = steps[n]
        print(
            f"{name}: first step after a restart {after.seconds * 1000:,.0f} ms, {after.evaluated:,} "
            f"evaluated: {after.seconds / medians[name]:.2f}x its median step"
        )


def many_agents(args: argparse.Namespace, servers_: dict[str, Server], loop: Loop, shape: str) -> None:
    """`--agents` agents at once on each server in turn (2 slots)."""
    rows = [HEADER]
    medians: dict[str, float] = {}
    walls: dict[str, float] = {}
    for name, server in servers_.items():
        results: list[list[Step]] = [[] for _ in range(args.agents)]
        errors: list[BaseException] = []

        def agent(
            i: int,
            url: str = server.url,
            results: list[list[Step]] = results,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                results[i].extend(loop(url, i))
            except BaseException as e:  # reported after the join
                errors.append(e)

        started = time.perf_counter()
        workers = [threading.Thread(target=agent, args=(i,)) for i in range(args.agents)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        walls[name] = time.perf_counter() - started
        if errors:
            raise errors[0]
        firsts = [r[0] for r in results]
        rest = [s for r in results for s in r[1:]]
        medians[name] = statistics.median(s.seconds for s in rest)
        reference = next(iter(medians))
        vs = None if name == reference else (f"vs {reference}", medians[reference])
        rows.append(row(name, firsts, rest, vs))
    print(f"\n{shape}, {args.agents} agents at once on 2 slots, {args.steps} steps each:")
    table(rows)
    print("wall time, all agents: " + ", ".join(f"{n} {w:,.1f} s" for n, w in walls.items()))


def run(args: argparse.Namespace) -> None:
    n, out, short = args.steps, args.max_tokens, args.short
    # Stopped by `timeout` or a kill: still stop the servers this run started (the finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    shapes = ("codex", "claude") if args.shape == "both" else (args.shape,)
    if "codex" in shapes:
        with servers(args, 2) as make:
            chained, resent = make("kvkeep-chained", False), make("kvkeep-resent", False)
            ways = {
                "kvkeep, previous_response_id": (
                    chained,
                    codex_loop(chained.url, 0, n + 1, out, short, chained=True),
                ),
                "kvkeep, resent (store false)": (resent, codex_loop(resent.url, 0, n + 1, out, short)),
            }
            if args.peer is not None:
                peer = make("llama-server", True)
                ways["llama-server, resent"] = (peer, codex_loop(peer.url, 0, n + 1, out, short))
            one_agent(args, "Codex-shaped loop on /v1/responses", ways, "kvkeep, previous_response_id")
    if "claude" in shapes:
        with servers(args, 2) as make:
            kv = make("kvkeep-messages", False)
            ways = {"kvkeep": (kv, claude_loop(kv.url, 0, n + 1, out, short))}
            if args.peer is not None:
                peer = make("llama-server-messages", True)
                ways["llama-server"] = (peer, claude_loop(peer.url, 0, n + 1, out, short))
            one_agent(args, "Claude-Code-shaped loop on /v1/messages", ways, "kvkeep")
    if args.agents > 0:
        loops: dict[str, Loop] = {
            "codex": lambda url, i: codex_loop(url, i, n, out, short),
            "claude": lambda url, i: claude_loop(url, i, n, out, short),
        }
        for shape in shapes:
            with servers(args, 2) as make:
                both = {"kvkeep --slots 2": make(f"kvkeep-{shape}-many", False)}
                if args.peer is not None:
                    both["llama-server -np 2"] = make(f"llama-server-{shape}-many", True)
                many_agents(args, both, loops[shape], f"{shape}-shaped loop")


def add_parser(sub: Any) -> None:
    """The `agent-cli` sub-command's arguments."""
    a = sub.add_parser("agent-cli", help="Codex- and Claude-Code-shaped agent loops (bench_agent_cli.py)")
    a.add_argument("--steps", type=int, default=10)
    a.add_argument("--agents", type=int, default=4, help="agents at once on 2 slots (0: leave out)")
    a.add_argument("--max-tokens", type=int, default=16, help="the most tokens a reply (default 16)")
    a.add_argument("--shape", default="both", choices=["both", "codex", "claude"])
    a.add_argument(
        "--short",
        action="store_true",
        help="a ~1,600-token prefix (fewer rules, tools and guide): a quick check of the loops",
    )
    a.add_argument("--peer", type=Path, default=None, metavar="LLAMA_SERVER", help="a llama-server binary")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    add_parser(parser.add_subparsers(dest="what", required=True))
    with contextlib.suppress(KeyboardInterrupt):
        run(parser.parse_args())
