"""scripts/bench exact-speed [--peer LLAMA_SERVER]: exact mode's price, prompt by prompt.

Exact mode needs a token's logits not to depend on how it was batched. llama.cpp's CPU flash
attention does depend on it, so exact mode used to run without flash attention; with the
batch-invariant kernels of patches/llama.cpp/ it runs on flash attention (`--exact-attention
auto`, the default, where the start-up probe finds them exact). Measured here, each server on
its own, in turns, one slot, the same threads and batch size, through /v1/completions with
prompts given as token ids (random ids that no cache holds):

- prompt evaluation at each `--lengths` (1k, 4k, 8k; longer where the model allows): one
  uncached prompt of that many tokens, 1 token generated, `--repeat` times (the median);
- a one-token turn at `--turns` (2k, 8k): 16 more tokens after a prompt of that many, which
  the server holds (kvkeep: the session; llama-server: the slot's prompt cache), 1 token
  generated;
- the compute buffer llama.cpp allocates for that context (its own log line).

Servers: kvkeep exact on batch-invariant flash attention ("exact-flash"), kvkeep exact
without flash attention ("exact-plain": before the patch), and with `--peer` llama-server's
default (flash attention auto: its tiled kernel, not exact) and `-fa off`. Ratios are against
llama-server's default; the goal is exact-flash's prompts at most 1.1x of it and its turns no
slower than exact-plain's.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from bench import table
from bench_agent_cli import Server

from kvkeepd.config.settings import default_model_path

TURN = 16
_BUFFER = re.compile(r"CPU compute buffer size\s*=\s*([0-9.]+) MiB")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("exact-speed")
    p.add_argument(
        "--peer", type=Path, help="llama-server of the same llama.cpp (scripts/build-llama-server)"
    )
    p.add_argument("--lengths", default="1024,4096,8000", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--turns", default="2048,8000", help="held prompt lengths of the one-token turns")
    p.add_argument("--repeat", type=int, default=1, help="uncached prompts per length (the median)")
    p.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2-135M)")


def ids(n: int, seed: int) -> list[int]:
    """`n` token ids no cache holds: a seeded walk over the ordinary part of the vocabulary."""
    out, x = [], seed * 2654435761 % 4294967296
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2147483648
        out.append(1000 + x % 30000)
    return out


def complete(url: str, prompt: list[int], extra: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Seconds for one completion of 1 token, and its reply."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    started = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=3600)
    took = time.perf_counter() - started
    r.raise_for_status()
    return took, r.json()


def measure(
    server: Server, peer: bool, lengths: list[int], turns: list[int], repeat: int
) -> dict[str, float]:
    """Prompt seconds per length (`p<n>`) and turn seconds per held length (`t<n>`)."""
    out: dict[str, float] = {}
    seed = 1
    for n in lengths:
        times = []
        for _ in range(repeat):
            seed += 1
            took, _reply = complete(server.url, ids(n, seed), {})
            times.append(took)
        out[f"p{n}"] = statistics.median(times)
        print(f"  {server.name}: prompt of {n}: {out[f'p{n}']:.2f} s", file=sys.stderr, flush=True)
    for n in turns:
        seed += 1
        held = ids(n, seed)
        if peer:
            complete(server.url, held, {"cache_prompt": True})
            took, _reply = complete(server.url, held + ids(TURN, seed + 1000), {"cache_prompt": True})
        else:
            _took, first = complete(server.url, held, {"session_id": "new"})
            took, reply = complete(server.url, ids(TURN, seed + 1000), {"session_id": first["session_id"]})
            cached = reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            assert cached >= n, f"the turn reused {cached} tokens, not the {n} held"
        out[f"t{n}"] = took
        print(f"  {server.name}: turn after {n}: {took:.2f} s", file=sys.stderr, flush=True)
    return out


def compute_buffer(log: Path) -> float:
    """The CPU compute buffer llama.cpp said it allocated (MiB; the last such line)."""
    found = _BUFFER.findall(log.read_text(errors="replace"))
    return float(found[-1]) if found else float("nan")


@contextlib.contextmanager
def server(name: str, cmd: Callable[[int], list[str]], work: Path) -> Iterator[Server]:
    s = Server(name, cmd, work)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def run(args: argparse.Namespace) -> None:
    lengths = [int(x) for x in args.lengths.split(",")]
    turns = [int(x) for x in args.turns.split(",")]
    model = args.model or default_model_path()
    context = -(-(max(lengths + [t + TURN for t in turns]) + 64) // 256) * 256
    threads = str(args.threads)
    work = Path(tempfile.mkdtemp(prefix="kvkeep-exact-speed-"))

    def kvkeep(attention: str) -> Callable[[int], list[str]]:
        def cmd(port: int) -> list[str]:
            return [
                *(sys.executable, "-m", "kvkeepd", "--model", str(model), "--address", "127.0.0.1:0"),
                *("--state-dir", str(work / f"state-{attention}"), "--http", f"127.0.0.1:{port}"),
                *("--threads", threads, "--slots", "1", "--ctx-per-session", str(context)),
                *("--exact-attention", attention, "--log-level", "debug"),
            ]

        return cmd

    def peer(fa: str) -> Callable[[int], list[str]]:
        def cmd(port: int) -> list[str]:
            return [
                *(str(args.peer), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
                *("-t", threads, "-tb", threads, "-c", str(context), "-np", "1", "-b", "512", "-ub", "512"),
                *("-fa", fa, "--no-warmup"),
            ]

        return cmd

    runs: list[tuple[str, Callable[[int], list[str]], bool]] = [
        ("kvkeep exact-flash", kvkeep("auto"), False),
        ("kvkeep exact-plain", kvkeep("plain"), False),
    ]
    if args.peer:
        runs += [("llama-server default", peer("auto"), True), ("llama-server -fa off", peer("off"), True)]
    results: dict[str, dict[str, float]] = {}
    for name, cmd, is_peer in runs:
        print(f"{name}:", file=sys.stderr, flush=True)
        with server(name.replace(" ", "-"), cmd, work) as s:
            if not is_peer:
                info = httpx.get(f"{s.url}/console/api/info", timeout=30)
                if info.status_code == 200:
                    flash = info.json().get("model", {}).get("flash_attention")
                    print(f"  {name}: flash attention {flash}", file=sys.stderr, flush=True)
            results[name] = measure(s, is_peer, lengths, turns, args.repeat)
        log = work / f"{name.replace(' ', '-')}.log"
        if is_peer:  # llama-server logs its buffers at -lv 4 only, which also logs every step

            def verbose(port: int, c: Callable[[int], list[str]] = cmd) -> list[str]:
                return [*c(port), "-lv", "4"]

            with server(f"{name.replace(' ', '-')}-buffers", verbose, work) as s:
                log = work / f"{s.name}.log"
        results[name]["buffer"] = compute_buffer(log)
    base = results.get("llama-server default")
    header = ("server", *(f"prompt {n}" for n in lengths), *(f"turn at {n}" for n in turns), "compute buffer")
    rows: list[tuple[str, ...]] = [header]
    for name, r in results.items():
        cells = []
        for key in [f"p{n}" for n in lengths] + [f"t{n}" for n in turns]:
            ratio = f" ({r[key] / base[key]:.2f}x)" if base and name != "llama-server default" else ""
            cells.append(f"{r[key]:.2f} s{ratio}")
        rows.append((name, *cells, f"{r['buffer']:.1f} MiB"))
    print(f"\nmodel {model.name}, {threads} threads, one slot, context {context}, batch 512")
    table(rows)
