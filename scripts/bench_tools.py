"""scripts/bench tools [--peer LLAMA_SERVER]: what tool calls cost, on the default model.

- Generation under the tool-call constraint against the same session's unconstrained
  generation: tokens/s of a streamed reply with tools and tool_choice none (no constraint),
  auto (free text: the grammar runs, its free text allows every token) and required (inside
  calls, each call's arguments held to a JSON schema); and the mask's own cost per token
  along such replies (llguidance, as the daemon computes it).
- An agent's tool loop of --steps steps: a system prompt with tools, a question, then each
  step a call, its result fed back and the next call. kvkeep keeps the session, so a step
  sends only the result; llama-server (`--jinja`, `cache_prompt`) is sent the whole
  conversation every step, as an OpenAI client sends it. Per-step latency and the prompt
  tokens each evaluated, in the same run, on the same model, threads and context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import connected, llama_server, table

import kvkeep
from kvkeep import Message, SamplingParams, Tool

# A call that need not end early: long free-text arguments, so every run writes its count.
NOTE = Tool(
    "write_note",
    "Write a note into the ledger.",
    {
        "type": "object",
        "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
        "required": ["title", "body"],
        "additionalProperties": False,
    },
)
LOOKUP = Tool(
    "lookup",
    "Look up what the ledger holds about a pier.",
    {
        "type": "object",
        "properties": {"pier": {"type": "integer", "minimum": 1, "maximum": 200}},
        "required": ["pier"],
        "additionalProperties": False,
    },
)
ASK = "Write a long note about the harbour: every ship, crate and tide you know of."


def add_parser(sub: Any) -> None:
    """The `tools` sub-command's arguments."""
    p = sub.add_parser("tools", help="the tool-call constraint's cost, and a tool loop vs llama-server")
    p.add_argument("--tokens", type=int, default=96, help="tokens per timed reply")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="steps of the tool loop")
    p.add_argument("--system-tokens", type=int, default=600, help="about this many tokens of system prompt")
    p.add_argument("--peer", type=Path, default=None, metavar="LLAMA_SERVER", help="a llama-server binary")


def run(args: argparse.Namespace) -> None:
    threads = str(args.threads)
    with connected("--slots", "1", "--threads", threads) as (client, _):
        rates = constraint_rates(client, args.tokens, args.repeat)
        outputs = {kind: sample_output(client, kind, args.tokens) for kind in ("auto", "required")}
        loop = kvkeep_loop(client, args.steps, args.system_tokens)
    base = statistics.median(rates["none"])
    rows = [("generation with tools", f"tokens/s (median of {args.repeat})", "ms/token", "vs unconstrained")]
    labels = {
        "none": "tool_choice none (unconstrained)",
        "auto": "auto (free text)",
        "required": "required (in calls)",
    }
    for kind, values in rates.items():
        rate = statistics.median(values)
        rows.append((labels[kind], f"{rate:.1f}", f"{1000 / rate:.2f}", f"{rate / base:.2f}x"))
    table(rows)
    print()
    rows = [("mask per token (llguidance)", "median", "max", "tokens")]
    for kind, tokens in outputs.items():
        costs = mask_costs(kind, tokens)
        rows.append(
            (
                labels[kind],
                f"{statistics.median(costs) * 1e6:.0f} us",
                f"{max(costs) * 1e6:.0f} us",
                str(len(costs)),
            )
        )
    table(rows)
    print()
    rows = [
        (
            f"tool loop, {args.steps} steps ({args.threads} threads)",
            "per step after the first (median)",
            "p90",
            "prompt tokens evaluated per step",
            "tokens generated per step",
        )
    ]
    rows.append(loop_row("kvkeep, one session (only the result sent)", loop))
    if args.peer is not None:
        with llama_server(args.peer, args.threads, "--jinja", "-c", "4096") as (url, _):
            rows.append(
                loop_row(
                    "llama-server --jinja, whole conversation, cache_prompt",
                    server_loop(url, args.steps, args.system_tokens),
                )
            )
    table(rows)


def constraint_rates(client: kvkeep.Client, n: int, repeat: int) -> dict[str, list[float]]:
    """Tokens/s of one streamed session under each tool choice, interleaved."""
    rates: dict[str, list[float]] = {"none": [], "auto": [], "required": []}
    for i in range(repeat):
        for kind in rates:
            s = client.create_session(
                "You keep the harbour's ledger.", sampling=SamplingParams(temperature=0.8, seed=i)
            )
            # Prefill, compile and the first token outside the timing; the rest continues within
            # the open constraint (a reply cut short continues within its calls).
            s.chat(ASK, tools=[NOTE], tool_choice=kind, max_tokens=1)
            started = time.perf_counter()
            got = sum(len(c.token_ids) for c in s.generate("", max_tokens=n))
            rates[kind].append(got / (time.perf_counter() - started))
            s.close()
    return rates


def sample_output(client: kvkeep.Client, kind: str, n: int) -> list[int]:
    """The tokens of one reply under `kind`."""
    s = client.create_session(
        "You keep the harbour's ledger.", sampling=SamplingParams(temperature=0.8, seed=7)
    )
    reply = s.chat(ASK, tools=[NOTE], tool_choice=kind, max_tokens=n)
    s.close()
    return list(reply.token_ids)


def mask_costs(kind: str, tokens: list[int]) -> list[float]:
    """Seconds per token of the allowed set along `tokens`, as the daemon computes it."""
    import llama_cpp as lc
    import llguidance
    from llguidance.llamacpp import lltokenizer_from_vocab

    from kvkeepd.config.settings import default_model_path
    from kvkeepd.engine.structured_output import Matcher, compile_spec
    from kvkeepd.tools import Toolkit
    from kvkeepd.values.toolcall import Tool as DaemonTool
    from kvkeepd.values.toolcall import ToolChoice

    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(default_model_path()).encode(), params)
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    tokenizer = lltokenizer_from_vocab(
        vocab, eos_token=[t for t in range(n_vocab) if lc.llama_vocab_is_eog(vocab, t)]
    )
    spec = Toolkit("generic", {}, ()).grammar(
        [DaemonTool(NOTE.name, NOTE.description, json.dumps(NOTE.parameters))],
        ToolChoice.of(kind),
        True,
    )
    assert spec is not None
    matcher = Matcher(compile_spec(tokenizer, spec, llguidance.LLParserLimits()), n_vocab)
    costs = []
    for t in tokens:
        started = time.perf_counter()
        allowed = matcher.allowed()
        costs.append(time.perf_counter() - started)
        if not allowed[t]:
            break
        matcher.consume(t)
    lc.llama_model_free(model)
    return costs


def system_prompt(tokens: int) -> str:
    notes = " ".join(
        f"Pier {i} holds {i * 13 % 37} crates of salt and the boat of keeper {i * 7 % 11}."
        for i in range(tokens // 18)
    )
    return f"You keep the harbour's ledger. Call lookup for each pier you are asked about. {notes}"


def kvkeep_loop(client: kvkeep.Client, steps: int, system_tokens: int) -> list[tuple[float, int, int]]:
    """Each step's latency, prompt tokens evaluated and tokens generated: one session, the
    result only."""
    s = client.create_session(
        system_prompt(system_tokens), tools=[LOOKUP], sampling=SamplingParams(temperature=0.0)
    )
    out = []
    send: list[Message] = [Message("user", "What do piers 3, 5 and 8 hold? Look each up.")]
    for step in range(steps):
        started = time.perf_counter()
        reply = s.chat(send, tool_choice="lookup", max_tokens=64)
        usage = reply.usage
        out.append(
            (
                time.perf_counter() - started,
                usage.evaluated_tokens - usage.generated_tokens,
                usage.generated_tokens,
            )
        )
        call = reply.tool_calls[0]
        send = [Message("tool", json.dumps({"pier": step, "crates": step * 3}), tool_call_id=call.call_id)]
    s.close()
    return out


def server_loop(url: str, steps: int, system_tokens: int) -> list[tuple[float, int, int]]:
    """The same loop on llama-server's OpenAI endpoint: the whole conversation each step."""
    tool = {
        "type": "function",
        "function": {"name": LOOKUP.name, "description": LOOKUP.description, "parameters": LOOKUP.parameters},
    }
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(system_tokens)},
        {"role": "user", "content": "What do piers 3, 5 and 8 hold? Look each up."},
    ]
    out = []
    called = 0
    for step in range(steps):
        body = {
            "messages": messages,
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": LOOKUP.name}},
            "max_tokens": 64,
            "temperature": 0,
            "cache_prompt": True,
        }
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as r:
            answer = json.load(r)
        elapsed = time.perf_counter() - started
        message = answer["choices"][0]["message"]
        called += bool(message.get("tool_calls"))
        calls = message.get("tool_calls") or [
            {"id": f"call_{step}", "type": "function", "function": {"name": LOOKUP.name, "arguments": "{}"}}
        ]
        timings = answer.get("timings", {})
        out.append((elapsed, int(timings.get("prompt_n", -1)), int(timings.get("predicted_n", -1))))
        messages += [
            {"role": "assistant", "content": message.get("content") or "", "tool_calls": calls[:1]},
            {
                "role": "tool",
                "tool_call_id": calls[0]["id"],
                "content": json.dumps({"pier": step, "crates": step * 3}),
            },
        ]
    print(f"llama-server answered {called} of {steps} steps with a tool call")
    return out


def loop_row(name: str, steps: list[tuple[float, int, int]]) -> tuple[str, str, str, str, str]:
    later = steps[1:] or steps  # the first step evaluates the system prompt: reported apart
    times = sorted(t for t, _, _ in later)
    first = steps[0]
    return (
        name,
        f"{statistics.median(times) * 1e3:.0f} ms",
        f"{times[int(0.9 * (len(times) - 1))] * 1e3:.0f} ms",
        f"{statistics.median(n for _, n, _ in later):.0f} (first: {first[1]} in {first[0] * 1e3:.0f} ms)",
        f"{statistics.median(g for _, _, g in later):.0f}",
    )
