"""scripts/bench fairness [--peer LLAMA_SERVER]: one long prompt against everyone else.

While one session's uncached prompt of `--long` (8,000) tokens is evaluated, does everybody
else keep moving? Each server (kvkeep, and with `--peer` llama-server from the same llama.cpp,
same slots, same batch size, same threads) is measured on its own, in turns, through its
OpenAI chat completions door, greedy:

- alone: (a) the time to the first token of a short request (a ~16-token prompt, 4 tokens),
  `--repeat` (7) times; (b) the gaps between the tokens of a running stream; (c) the long
  prompt's own time (1 token generated).
- together: the long prompt sent while a stream is running (restarted whenever it ends), and
  short requests sent one after another from another session until the long prompt is
  answered: (a) and (b) measured inside the long prompt's window, and (c) again.

Reported per server: (a) median and p95, (b) p95, (c), and "together / alone" for each — the
goal is (a) and (b) within 1.5x of alone and (c) within 1.15x.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench import STORY, table
from bench_agent_cli import Server, p95

from kvkeepd.config.settings import default_model_path

# Tokens of each session's context: the long prompt's and a little more.
CONTEXT = 8448


def chat(url: str, prompt: str, max_tokens: int, *, stream: bool) -> Iterator[float]:
    """Send one chat completion; yield the time of each content chunk (stream) or of the
    answer (not streamed)."""
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    with httpx.Client(timeout=1800) as http:
        if not stream:
            r = http.post(f"{url}/v1/chat/completions", json=body)
            r.raise_for_status()
            yield time.perf_counter()
            return
        with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                delta = choices[0].get("delta") or {}
                if delta.get("content"):
                    yield time.perf_counter()


def first_token(url: str, n: int) -> float:
    """Seconds to the first content chunk of a short request (a prompt of about 16 tokens)."""
    started = time.perf_counter()
    prompt = f"Request {n}: name one colour of the sea at dawn, in a word."
    for at in chat(url, prompt, 4, stream=True):
        return at - started
    return time.perf_counter() - started


def long_prompt(n_tokens: int, tokens_per_story: float, nonce: int) -> str:
    """About n_tokens of prompt, its first words unique so that no cache holds it."""
    return f"Document {nonce}. " + STORY * max(1, round(n_tokens / tokens_per_story))


@dataclass
class Streamer:
    """A stream kept running (restarted when it ends); the time of each of its tokens."""

    url: str
    stamps: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            prompt = f"Story {n}: tell a long tale about a lighthouse keeper and the sea."
            last = None
            for at in chat(self.url, prompt, 200, stream=True):
                if last is not None:
                    self.stamps.append(at)
                last = at
                if self.stop.is_set():
                    break
            self.stamps.append(float("nan"))  # a gap across streams is no token's gap

    def gaps(self, start: float, end: float) -> list[float]:
        return [
            b - a
            for a, b in zip(self.stamps, self.stamps[1:], strict=False)
            if a == a and b == b and start <= a and b <= end
        ]


@dataclass
class Figures:
    first_token: list[float]
    gaps: list[float]
    long: float


def alone(url: str, repeat: int, prompt: str) -> Figures:
    firsts = [first_token(url, i) for i in range(repeat)]
    streamer = Streamer(url)
    thread = threading.Thread(target=streamer.run)
    started = time.perf_counter()
    thread.start()
    time.sleep(8)
    streamer.stop.set()
    thread.join()
    gaps = streamer.gaps(started, time.perf_counter())
    began = time.perf_counter()
    for _ in chat(url, prompt, 1, stream=False):
        pass
    return Figures(firsts, gaps, time.perf_counter() - began)


def together(url: str, prompt: str) -> Figures:
    streamer = Streamer(url)
    streaming = threading.Thread(target=streamer.run)
    streaming.start()
    time.sleep(3)  # the stream is running
    window: dict[str, float] = {}

    def evaluate() -> None:
        window["start"] = time.perf_counter()
        for _ in chat(url, prompt, 1, stream=False):
            pass
        window["end"] = time.perf_counter()

    long = threading.Thread(target=evaluate)
    long.start()
    time.sleep(1)  # the long prompt is being evaluated
    firsts: list[float] = []
    n = 1000
    while long.is_alive():
        n += 1
        firsts.append(first_token(url, n))
    long.join()
    streamer.stop.set()
    streaming.join()
    gaps = streamer.gaps(window["start"] + 1, window["end"])
    return Figures(firsts, gaps, window["end"] - window["start"])


def tokens_per_story(url: str) -> float:
    """Prompt tokens per STORY, from one request's usage."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": STORY * 20}],
        "max_tokens": 1,
        "temperature": 0,
    }
    with httpx.Client(timeout=600) as http:
        r = http.post(f"{url}/v1/chat/completions", json=body)
        r.raise_for_status()
        return float(r.json()["usage"]["prompt_tokens"]) / 20


def run(args: argparse.Namespace) -> None:
    threads, slots, batch = str(args.threads), str(args.slots), str(args.batch_size)
    work = Path(tempfile.mkdtemp(prefix="kvkeep-fairness-"))

    def kvkeep_cmd(port: int) -> list[str]:
        return [
            *(sys.executable, "-m", "kvkeepd", "--address", "127.0.0.1:0"),
            *("--state-dir", str(work / "kvkeep"), "--http", f"127.0.0.1:{port}"),
            *("--threads", threads, "--slots", slots, "--batch-size", batch),
            *("--ctx-per-session", str(CONTEXT), "--log-level", "warning", *args.flag),
        ]

    def peer_cmd(port: int) -> list[str]:
        return [
            *(str(args.peer), "-m", str(default_model_path()), "--host", "127.0.0.1"),
            *("--port", str(port), "-t", threads, "-tb", threads, "-np", slots),
            *("-c", str(CONTEXT * args.slots), "-b", batch, "-ub", batch, "--jinja"),
        ]

    ways: dict[str, Callable[[int], list[str]]] = {"kvkeep": kvkeep_cmd}
    if args.peer is not None:
        ways["llama-server"] = peer_cmd
    results: dict[str, tuple[Figures, Figures, int]] = {}
    try:
        for name, cmd in ways.items():
            with contextlib.ExitStack() as stack:
                server = Server(name, cmd, work)
                server.start()
                stack.callback(server.stop)
                per_story = tokens_per_story(server.url)
                n = round(args.long / per_story) * per_story
                print(f"{name}: a long prompt of about {n:.0f} tokens", file=sys.stderr)
                first = alone(server.url, args.repeat, long_prompt(args.long, per_story, 1))
                both = together(server.url, long_prompt(args.long, per_story, 2))
                results[name] = (first, both, round(n))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        (
            "server",
            "long prompt",
            "(a) first token, alone: median / p95",
            "(a) during the long prompt: median / p95 (n)",
            "(b) token gap p95: alone / during",
            "(c) long prompt: alone / together",
        )
    ]
    for name, (a, b, n) in results.items():
        fa, fb = statistics.median(a.first_token), statistics.median(b.first_token)
        ga, gb = p95(a.gaps), p95(b.gaps) if b.gaps else float("nan")
        rows.append(
            (
                name,
                f"{n} tokens",
                f"{fa:.2f} / {p95(a.first_token):.2f} s",
                f"{fb:.2f} / {p95(b.first_token):.2f} s ({len(b.first_token)}): {fb / fa:.2f}x",
                f"{ga * 1000:.0f} / {gb * 1000:.0f} ms: {gb / ga:.2f}x",
                f"{a.long:.1f} / {b.long:.1f} s: {b.long / a.long:.2f}x",
            )
        )
    table(rows)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fairness")
    p.add_argument("--long", type=int, default=8000, help="tokens of the long prompt")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--peer", type=Path, default=None, metavar="LLAMA_SERVER", help="a llama-server binary")
    p.add_argument(
        "--flag", action="append", default=[], help="a daemon flag (repeatable): --flag=--flash-attn"
    )
