"""scripts/bench chain [--steps 1000] [--ram-cache BYTES] [--context TOKENS]: the RAM a long chain
of stored responses holds, against --ram-cache.

One daemon process (one slot, its metrics served), one chain: each step a response to "Hi"
with `previous_response_id` the step before's, `max_output_tokens` 1, `truncation: auto`, so
that the chain outgrows the context (after some 80 steps at 1,024 tokens) and each step from
then on cuts the history, loads its prefix from the stored blocks and evaluates the rest.
Every `--every` steps the daemon's own metrics are read: the RAM it counts against
--ram-cache (kvkeep_parked_bytes: parked states and ephemeral checkpoints;
kvkeep_whole_state_bytes: stored responses' whole states kept), the C heap in use
(kvkeep_heap_bytes) and its resident memory (process_resident_memory_bytes). Reported:
those samples, the step's median time in each window, and what the daemon holds and how its
memory grew, as ratios to --ram-cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from typing import Any

from bench import daemon, table
from bench_agent import free_port, post

MIB = 1 << 20


def metrics(url: str) -> dict[str, float]:
    """The daemon's metrics of memory, by name (the heap's in use)."""
    with urllib.request.urlopen(url, timeout=30) as answer:
        text = answer.read().decode()
    wanted = {
        "kvkeep_parked_bytes": "parked",
        "kvkeep_whole_state_bytes": "wholes",
        'kvkeep_heap_bytes{state="in_use"}': "heap",
        "process_resident_memory_bytes": "rss",
    }
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            found[wanted[name]] = float(value)
    return found


def run(args: argparse.Namespace) -> None:
    http, metrics_port = free_port(), free_port()
    flags = ["--http", f"127.0.0.1:{http}", "--metrics-address", f"127.0.0.1:{metrics_port}"]
    flags += ["--ram-cache", str(args.ram_cache), "--ctx-per-session", str(args.context)]
    flags += ["--slots", "1", "--threads", str(args.threads)]
    url, scrape = f"http://127.0.0.1:{http}/v1/responses", f"http://127.0.0.1:{metrics_port}/metrics"
    body: dict[str, Any] = {"model": "chain", "input": "Hi", "max_output_tokens": 1, "temperature": 0}
    body["truncation"] = "auto"
    rows: list[tuple[str, ...]] = [
        ("steps", "step, median", "input tokens", "held / --ram-cache", "heap in use", "resident")
    ]
    samples: list[tuple[int, dict[str, float]]] = []
    times: list[float] = []
    previous = ""
    started = time.monotonic()
    with daemon(*flags):
        for step in range(1, args.steps + 1):
            seconds, answer = post(url, {**body, **({"previous_response_id": previous} if previous else {})})
            previous = answer["id"]
            times.append(seconds)
            if step % args.every and step != args.steps:
                continue
            m = metrics(scrape)
            samples.append((step, m))
            held = m["parked"] + m["wholes"]
            rows.append(
                (
                    f"{step:,}",
                    f"{statistics.median(times[-args.every :]) * 1000:,.0f} ms",
                    f"{answer['usage']['input_tokens']:,}",
                    f"{held / MIB:.1f} MiB ({held / args.ram_cache:.2f})",
                    f"{m['heap'] / MIB:,.0f} MiB",
                    f"{m['rss'] / MIB:,.0f} MiB",
                )
            )
            print(json.dumps({"step": step, **m}), file=sys.stderr)
    table(rows)
    first, last = samples[0][1], samples[-1][1]
    steps = samples[-1][0] - samples[0][0]
    most = max(m["parked"] + m["wholes"] for _, m in samples)
    print()
    p95 = sorted(times)[int(len(times) * 0.95)]
    print(
        f"{args.steps:,} chained responses in {time.monotonic() - started:,.0f} s; step median "
        f"{statistics.median(times) * 1000:,.0f} ms, p95 {p95 * 1000:,.0f} ms"
    )
    print(f"held against --ram-cache, at most: {most / args.ram_cache:.2f}x ({most / MIB:.1f} MiB)")
    for name in ("heap", "rss"):
        grown = last[name] - first[name]
        print(
            f"{name} from step {samples[0][0]:,} to {samples[-1][0]:,}: {grown / MIB:+,.1f} MiB "
            f"({grown / args.ram_cache:+.2f}x --ram-cache, {grown / max(steps, 1) / 1024:+,.1f} KiB a step); "
            f"at most {max(m[name] for _, m in samples) / MIB:,.0f} MiB"
        )


def add_parser(sub: Any) -> None:
    """The `chain` sub-command's arguments."""
    c = sub.add_parser("chain", help="the RAM of a long chain of stored responses (bench_chain.py)")
    c.add_argument("--steps", type=int, default=1000)
    c.add_argument("--every", type=int, default=100, help="steps between samples of the metrics")
    c.add_argument("--ram-cache", type=int, default=64 * MIB, metavar="BYTES")
    c.add_argument("--context", type=int, default=1024, metavar="TOKENS", help="--ctx-per-session")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    add_parser(parser.add_subparsers(dest="what", required=True))
    run(parser.parse_args())
