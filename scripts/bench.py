"""kvkeep benchmarks. Every figure is measured in the same run as the baseline it is
compared with, and reported as a ratio: this machine is shared and noisy.

    scripts/bench generate     one session's tokens/s vs llama-cpp-python create_completion
    scripts/bench checkpoint   a 2,000-token session: checkpoint, restore, delta, bytes
                               (--model PATH: any model; the last line is its family row)
    scripts/bench sessions     batching speed-up vs raw llama_decode; swapping 32 sessions
    scripts/bench prefix       16 sessions sharing a 1,000-token system prompt: the prefix
                               cache on and off, and on again after a restart
    scripts/bench grammar      structured output: tokens/s with a JSON schema and a GBNF
                               grammar vs unconstrained; the mask per token, llguidance vs
                               llama.cpp's grammar sampler on the same output
    scripts/bench http         a conversation through the OpenAI-compatible door: resent
                               whole, continued by session_id, and evaluated from scratch
    scripts/bench routing      two daemons behind HAProxy (deploy/haproxy.cfg) against one
                               daemon reached directly: calls, turns, streams, exports
    scripts/bench prefill      prefill tokens/s of one long prompt: exact mode vs
                               --flash-attn (and, with --peer LLAMA_SERVER, llama-server's
                               default and -fa off), taken in turns in the same run
    scripts/bench agent [--peer LLAMA_SERVER]
                               a 20-step agent loop by previous_response_id, resent to the
                               chat door and to llama-server, and with a kill -9 midway
                               (bench_agent.py)
    scripts/bench agent-cli [--peer LLAMA_SERVER]
                               Codex- and Claude-Code-shaped loops: a ~6,500-token prefix,
                               the whole conversation resent each step, against chaining
                               and llama-server, 4 agents on 2 slots, a restart
                               (bench_agent_cli.py)
    scripts/bench chain [--steps 1000]
                               the RAM a chain of stored responses holds against --ram-cache
                               (the daemon's metrics every 100 steps; bench_chain.py)
    scripts/bench fairness [--peer LLAMA_SERVER]
                               while an 8,000-token prompt is evaluated: another session's
                               first token, a running stream's token gaps, the long prompt's
                               own time, against each alone (bench_fairness.py)
    scripts/bench exact-speed [--peer LLAMA_SERVER]
                               exact mode on batch-invariant flash attention against exact
                               mode without it and llama-server's default: prompts at 1k-8k,
                               one-token turns, compute buffers (bench_exact_speed.py)
    scripts/bench scale [--peer LLAMA_SERVER] [--shape 1b]
                               checkpoints (full, delta), restores from RAM and disk,
                               a restart, bytes, 32 sessions on 4 slots and peak RSS at
                               1k-8k tokens, against re-prefill, llama-server and the
                               machine's copy/read bound (bench_scale.py)
    scripts/bench peer LLAMA_SERVER
                               turns, restores, a restart, streaming and concurrency
                               against llama-server on the same model (bench_peer.py)
    scripts/bench turns        one-token turns on a ~1,900-token session, persistent vs
                               ephemeral, and the first turn after a restart and a kill -9
    scripts/bench store        restore + first token of a 2,000-token persistent session from
                               local disk, Redis and S3 (servers on loopback) vs re-prefill,
                               and the session moving between two daemons sharing a catalog
    scripts/bench shared-turns one-token persistent turns on a daemon of its own (sqlite,
                               the journal file) vs one sharing a Redis catalog and store
                               (the journal on the catalog's server), taken in turns

--charts DIR (before the benchmark's name) also draws PNG charts into DIR (matplotlib, in
kvkeep[dev]): checkpoint.png (restore vs re-prefill by context length; checkpoint runs
three shorter lengths too), sessions.png (tokens/s by concurrent sessions),
turns.png (the swap turns' latencies) and scale-MODEL.png (costs by context length).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

import kvkeep
from kvkeep import SamplingParams
from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeep.v1 import kvkeep_pb2_grpc as pb_grpc
from kvkeepd.config.settings import default_model_path

ROOT = Path(__file__).resolve().parent.parent
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
    "and listening to the sea. "
)


@contextmanager
def daemon(*flags: str, state: Path | None = None) -> Iterator[tuple[str, Path]]:
    """A daemon subprocess on a free port: (address, state dir). The state dir is fresh and
    removed afterwards unless one is given (then it is kept, for a restart)."""
    keep = state is not None
    state = state or Path(tempfile.mkdtemp(prefix="kvkeep-bench-"))
    (state / "ready").unlink(missing_ok=True)
    ready = state / "ready"
    log = (state / "daemon.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvkeepd",
            "--address",
            "127.0.0.1:0",
            "--http",
            "off",
            "--state-dir",
            str(state / "s"),
            "--ready-file",
            str(ready),
            "--log-level",
            "warning",
            *flags,
        ],
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 300  # model load and start-up probes, on a busy machine
        while not (ready.exists() and ready.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start: {(state / 'daemon.log').read_text()}")
            time.sleep(0.05)
        yield f"127.0.0.1:{ready.read_text().strip()}", state / "s"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
        if not keep:
            shutil.rmtree(state, ignore_errors=True)


@contextmanager
def connected(*flags: str) -> Iterator[tuple[kvkeep.Client, Path]]:
    """A client of a fresh daemon subprocess: (client, the daemon's state dir)."""
    with daemon(*flags) as (address, state), kvkeep.Client(address) as client:
        yield client, state


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def llama(n_ctx: int, threads: int, model: Path | None = None) -> Any:
    from llama_cpp import Llama

    return Llama(
        str(model or default_model_path()),
        n_ctx=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )


def chart(args: argparse.Namespace, name: str, draw: Callable[[Any], None]) -> None:
    """With --charts DIR: draw(axes) into DIR/name, a PNG file."""
    if args.charts is None:
        return
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    draw(ax)
    ax.grid(True, alpha=0.3)
    args.charts.mkdir(parents=True, exist_ok=True)
    path = args.charts / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"chart: {path}", file=sys.stderr)


def table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


# ---- generate ---------------------------------------------------------------------------------


def bench_generate(args: argparse.Namespace) -> None:
    n = args.tokens
    prompt = STORY * 4
    with connected("--slots", "1", "--threads", str(args.threads)) as (client, _):
        rates = []
        for _ in range(args.repeat):
            s = client.create_session(sampling=SamplingParams(temperature=0.0))
            s.complete(prompt, max_tokens=1)  # prefill outside the timing
            started = time.perf_counter()
            got = 0
            for chunk in s.generate("", max_tokens=n):
                got += len(chunk.token_ids)
            rates.append(got / (time.perf_counter() - started))
            s.close()
    kv_rate = statistics.median(rates)
    llm = llama(2048, args.threads)
    rates = []
    for _ in range(args.repeat):
        llm.reset()
        llm.create_completion(prompt, max_tokens=1, temperature=0.0)
        started = time.perf_counter()
        got = 0
        for part in llm.create_completion(prompt, max_tokens=n, temperature=0.0, stream=True):
            got += 1 if part["choices"][0]["text"] is not None else 0
        rates.append(got / (time.perf_counter() - started))
    lc_rate = statistics.median(rates)
    table(
        [
            ("path", f"tokens/s (median of {args.repeat})", "ratio"),
            ("kvkeep SDK, one session (streamed)", f"{kv_rate:.1f}", f"{kv_rate / lc_rate:.2f}x"),
            ("llama-cpp-python create_completion", f"{lc_rate:.1f}", "1.00x"),
        ]
    )


# ---- checkpoint -------------------------------------------------------------------------------


def checkpoint_run(client: kvkeep.Client, text: str, persistent: bool, repeat: int) -> dict[str, Any]:
    """Prefill a session, checkpoint it, extend it by 64 tokens, checkpoint again, then time
    restore + first token of the first checkpoint."""
    s = client.create_session(sampling=SamplingParams(temperature=0.0), persistent=persistent)
    prefill, done = timed(lambda: s.complete(text, max_tokens=1))
    full_s, full = timed(lambda: s.checkpoint("full"))
    grow = s.complete(STORY * 3 + STORY[:40], max_tokens=1)
    delta_s, delta = timed(lambda: s.checkpoint("delta"))

    def restore_first() -> None:
        s.restore(full.checkpoint_id)
        next(iter(s.generate("", max_tokens=1)))

    restores = [timed(restore_first)[0] for _ in range(repeat)]
    s.close()
    return {
        "n": done.usage.prompt_tokens if done.usage else 0,
        "grown": (grow.usage.added_tokens + 1) if grow.usage else 0,
        "prefill": prefill,
        "full_s": full_s,
        "full": full,
        "delta_s": delta_s,
        "delta": delta,
        "restore": statistics.median(restores),
    }


def bench_checkpoint(args: argparse.Namespace) -> None:
    model = args.model or default_model_path()
    flags = (
        "--model",
        str(model),
        "--slots",
        "4",
        "--ctx-per-session",
        "4096",
        "--threads",
        str(args.threads),
        "--codec",
        args.codec,
    )
    with connected(*flags) as (client, _):
        info = client.info()
        # About args.tokens tokens of text in this model's tokenizer.
        probe = client.create_session()
        per_story = probe.complete(STORY, max_tokens=1).usage.prompt_tokens
        probe.close()
        text = STORY * max(1, args.tokens // max(per_story, 1))
        # Shorter sessions for the chart first: ephemeral ones leave nothing in the prefix
        # cache, so every re-prefill evaluates its whole text.
        by_length = []
        if args.charts is not None:
            for fraction in (8, 4, 2):
                shorter = STORY * max(1, args.tokens // fraction // max(per_story, 1))
                by_length.append(checkpoint_run(client, shorter, False, args.repeat))
        ram = checkpoint_run(client, text, False, args.repeat)
        disk = checkpoint_run(client, text, True, args.repeat)
        by_length.append(ram)
    n = ram["n"]
    llm = llama(4096, args.threads, model)
    ids = llm.tokenize(text.encode())[:n]
    llm.reset()
    llm.eval(ids)
    save_s, saved = timed(llm.save_state)
    load_s, _ = timed(lambda: llm.load_state(saved))
    prefill = ram["prefill"]
    rows = [
        (f"measure ({n}-token session, {args.threads} threads)", "value", "vs re-prefill"),
        ("re-prefill from text + first token", f"{prefill * 1e3:.0f} ms", "1x"),
        ("llama-cpp-python Llama.save_state", f"{save_s * 1e3:.0f} ms", ""),
        ("llama-cpp-python Llama.load_state", f"{load_s * 1e3:.0f} ms", f"{prefill / load_s:.0f}x"),
    ]
    full, delta = ram["full"], ram["delta"]
    rows += [
        ("kvkeep checkpoint (full)", f"{ram['full_s'] * 1e3:.0f} ms, {full.bytes_written / 1e6:.1f} MB", ""),
        (
            f"kvkeep restore + first token, ephemeral: RAM (median of {args.repeat})",
            f"{ram['restore'] * 1e3:.1f} ms",
            f"{prefill / ram['restore']:.0f}x ({load_s / ram['restore']:.1f}x vs load_state)",
        ),
        (
            f"kvkeep restore + first token, persistent: disk (median of {args.repeat})",
            f"{disk['restore'] * 1e3:.1f} ms",
            f"{prefill / disk['restore']:.0f}x ({load_s / disk['restore']:.1f}x vs load_state)",
        ),
        (
            f"kvkeep checkpoint after {ram['grown']} more tokens",
            f"{ram['delta_s'] * 1e3:.0f} ms, {delta.bytes_written / 1e6:.2f} MB",
            f"{100 * delta.bytes_written / full.bytes_written:.1f}% of full",
        ),
    ]
    full = disk["full"]
    state_bytes = saved.llama_state_size
    rows.append(
        (
            f"bytes/token on disk (codec {args.codec})",
            f"{full.bytes_referenced / max(full.n_tokens, 1):.0f}",
            f"llama.cpp's whole state: {state_bytes / max(n, 1):.0f} B/token",
        )
    )
    table(rows)
    chart(args, "checkpoint.png", lambda ax: draw_checkpoint(ax, by_length, Path(model).name))
    print()
    print(
        f"family row: | {Path(model).name} | {info.architecture} | {info.memory_type} | {n} | "
        f"{prefill * 1e3:.0f} ms | {ram['restore'] * 1e3:.1f} ms ({prefill / ram['restore']:.0f}x) | "
        f"{disk['restore'] * 1e3:.1f} ms ({prefill / disk['restore']:.0f}x) | "
        f"{full.bytes_referenced / max(full.n_tokens, 1):.0f} | "
        f"{delta.bytes_written / 1e3:.0f} kB for {ram['grown']} tokens |"
    )


def draw_checkpoint(ax: Any, runs: list[dict[str, Any]], model: str) -> None:
    lengths = [r["n"] for r in runs]
    ax.plot(lengths, [r["prefill"] * 1e3 for r in runs], "o-", label="re-prefill from text + first token")
    ax.plot(lengths, [r["restore"] * 1e3 for r in runs], "o-", label="restore (RAM) + first token")
    for r in runs:
        ax.annotate(
            f"{r['prefill'] / r['restore']:.0f}x",
            (r["n"], r["restore"] * 1e3),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("ms (log scale)")
    ax.set_title(f"Restore vs re-prefill, {model}")
    ax.legend()


# ---- sessions ---------------------------------------------------------------------------------


def raw_decode_rates(counts: list[int], steps: int, threads: int) -> dict[int, float]:
    """Tokens/s of llama_decode with batches of N tokens, one per sequence (exact mode)."""
    import llama_cpp as L

    from kvkeepd.engine.backend import route_llama_log

    route_llama_log()  # llama.cpp's chatter to logging (warnings and up)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(default_model_path()).encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    n_seq = max(counts)
    cp.n_ctx = 512 * n_seq
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = n_seq
    cp.n_threads = cp.n_threads_batch = threads
    cp.kv_unified = False
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(512, 0, 1)
    mem = L.llama_get_memory(ctx)
    rates = {}
    for count in counts:
        L.llama_memory_clear(mem, True)

        def fill(pos0: int, length: int, count: int = count) -> None:
            k = 0
            for seq in range(count):
                for i in range(length):
                    batch.token[k] = 100 + i
                    batch.pos[k] = pos0 + i
                    batch.n_seq_id[k] = 1
                    batch.seq_id[k][0] = seq
                    batch.logits[k] = 1 if i == length - 1 else 0
                    k += 1
            batch.n_tokens = k

        fill(0, 16)
        L.llama_decode(ctx, batch)
        started = time.perf_counter()
        for step in range(steps):
            fill(16 + step, 1)
            L.llama_decode(ctx, batch)
        rates[count] = count * steps / (time.perf_counter() - started)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return rates


def bench_sessions(args: argparse.Namespace) -> None:
    import threading

    counts = [1, 2, 4, 8]
    steps = args.tokens
    raw = raw_decode_rates(counts, steps, args.threads)
    rates: dict[int, float] = {}
    with connected("--slots", "8", "--ctx-per-session", "512", "--threads", str(args.threads)) as (client, _):
        for count in counts:
            sessions = [client.create_session(sampling=SamplingParams(temperature=0.0)) for _ in range(count)]
            for s in sessions:
                s.complete(STORY, max_tokens=1)
            totals = [0] * count

            def run(i: int, sessions: list[kvkeep.Session] = sessions, totals: list[int] = totals) -> None:
                for chunk in sessions[i].generate("", max_tokens=steps):
                    totals[i] += len(chunk.token_ids)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rates[count] = sum(totals) / (time.perf_counter() - started)
            for s in sessions:
                s.close()
    rows = [
        (
            "concurrent sessions",
            "kvkeep tok/s",
            "speed-up",
            "raw llama_decode tok/s",
            "speed-up",
            "kvkeep / raw speed-up",
        )
    ]
    for c in counts:
        ks, rs = rates[c] / rates[1], raw[c] / raw[1]
        rows.append(
            (str(c), f"{rates[c]:.1f}", f"{ks:.2f}x", f"{raw[c]:.1f}", f"{rs:.2f}x", f"{100 * ks / rs:.0f}%")
        )
    table(rows)
    chart(args, "sessions.png", lambda ax: draw_sessions(ax, counts, rates, raw))
    print()
    turns, prefill = swap_turns(args)
    chart(args, "turns.png", lambda ax: draw_turns(ax, turns, prefill, args))


def draw_sessions(ax: Any, counts: list[int], rates: dict[int, float], raw: dict[int, float]) -> None:
    ax.plot(counts, [rates[c] for c in counts], "o-", label="kvkeep (through the SDK)")
    ax.plot(counts, [raw[c] for c in counts], "s--", label="raw llama_decode, same batch shapes")
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("tokens/s, all sessions")
    ax.set_title("Aggregate decode throughput")
    ax.legend()


def draw_turns(ax: Any, turns: list[float], prefill: float, args: argparse.Namespace) -> None:
    ms = [t * 1e3 for t in turns]
    ax.hist(ms, bins=30, color="tab:blue", alpha=0.8)
    med, p95 = statistics.median(ms), statistics.quantiles(ms, n=20)[18]
    ax.axvline(med, color="black", label=f"median {med:.1f} ms")
    ax.axvline(p95, color="tab:red", linestyle="--", label=f"p95 {p95:.1f} ms")
    ax.set_xlabel("turn to first token (ms)")
    ax.set_ylabel("turns")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_title(
        f"{args.sessions} sessions x ~{args.context} tokens, --slots 4: every turn swaps in "
        f"(re-prefill {prefill * 1e3:.0f} ms)",
        fontsize=9,
    )
    ax.legend()


def swap_turns(args: argparse.Namespace) -> tuple[list[float], float]:
    """Round-robin one-token turns over more sessions than slots: the turns' latencies (s)
    and the median re-prefill of one session."""
    n_sessions, n_tokens, rounds = args.sessions, args.context, args.rounds
    text = STORY * (n_tokens // 20)
    flags = (
        "--slots",
        "4",
        "--ctx-per-session",
        "4096",
        "--threads",
        str(args.threads),
        "--ram-cache",
        str(8 << 30),
    )
    with daemon(*flags) as (address, _), kvkeep.Client(address) as client:
        sessions = []
        prefills = []
        for _ in range(n_sessions):
            s = client.create_session(sampling=SamplingParams(temperature=0.0))
            prefills.append(timed(lambda s=s: s.complete(text, max_tokens=1))[0])
            sessions.append(s)
        turns = []
        for _ in range(rounds):
            for s in sessions:

                def turn(s: kvkeep.Session = s) -> None:
                    next(iter(s.generate(" And then", max_tokens=1)))

                turns.append(timed(turn)[0])
        info = client.info()
        for s in sessions:
            s.close()
    prefill = statistics.median(prefills)
    med = statistics.median(turns)
    p95 = statistics.quantiles(turns, n=20)[18]
    table(
        [
            (
                f"{n_sessions} sessions x ~{n_tokens} tokens, --slots 4, round-robin",
                "latency",
                "vs re-prefill",
            ),
            ("re-prefill of one session's context (median)", f"{prefill * 1e3:.0f} ms", "1x"),
            ("turn to first token, median", f"{med * 1e3:.1f} ms", f"{prefill / med:.0f}x"),
            ("turn to first token, p95", f"{p95 * 1e3:.1f} ms", f"{prefill / p95:.0f}x"),
            (
                "swap-ins (mean)",
                f"{info.swap_ins} ({1e3 * info.swap_in_seconds_total / max(info.swap_ins, 1):.1f} ms)",
                "",
            ),
        ]
    )
    return turns, prefill


# ---- prefix -----------------------------------------------------------------------------------


def prefix_round(address: str, system: str, n: int, persistent: bool) -> dict[str, Any]:
    """n new sessions with the same system prompt, one chat turn each: time to first token,
    tokens evaluated and reused."""
    ttft, evaluated, reused = [], 0, 0
    with kvkeep.Client(address, timeout=600) as client:
        for _ in range(n):
            s = client.create_session(system, sampling=SamplingParams(temperature=0.0), persistent=persistent)
            started = time.perf_counter()
            stream = s.chat_stream("Which note names the copper lantern?", max_tokens=4)
            next(iter(stream))
            ttft.append(time.perf_counter() - started)
            for chunk in stream:
                if chunk.usage is not None:
                    evaluated += chunk.usage.evaluated_tokens
                    reused += chunk.usage.reused_tokens
    return {"ttft": ttft, "evaluated": evaluated, "reused": reused}


def disk_bytes(state: Path) -> int:
    return sum(p.stat().st_size for p in (state / "blocks").rglob("*") if p.is_file())


def bench_prefix(args: argparse.Namespace) -> None:
    words = ["amber", "lantern", "granite", "meadow", "copper", "willow", "saffron", "harvest"]
    system = " ".join(
        f"Note {i}: the {words[i % 8]} {words[(i * 3 + 1) % 8]} rests near pier {i * 7 % 101}."
        for i in range(args.prompt_tokens // 14)
    )
    flags = ("--slots", "4", "--ctx-per-session", "2048", "--threads", str(args.threads))
    rows = [
        (
            f"{args.sessions} sessions sharing a system prompt, {args.threads} threads",
            "tokens evaluated",
            "tokens reused",
            "first token, 1st session",
            "first token, others (median)",
            "blocks on disk",
        )
    ]
    runs = []
    state = Path(tempfile.mkdtemp(prefix="kvkeep-bench-prefix-"))
    try:
        for label, extra, where in (
            ("prefix cache off", ("--no-prefix-cache",), None),
            ("prefix cache on", (), state),
            ("prefix cache on, after a restart", (), state),
        ):
            with daemon(*flags, *extra, state=where) as (address, dir_):
                r = prefix_round(address, system, args.sessions, persistent=True)
                r["disk"] = disk_bytes(dir_)
            runs.append((label, r))
            print(f"{label}: done", file=sys.stderr)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    base = statistics.median(runs[0][1]["ttft"][1:])
    for label, r in runs:
        others = statistics.median(r["ttft"][1:])
        rows.append(
            (
                label,
                f"{r['evaluated']:,}",
                f"{r['reused']:,}",
                f"{r['ttft'][0] * 1e3:.0f} ms",
                f"{others * 1e3:.0f} ms ({base / others:.1f}x)",
                f"{r['disk'] / 1e6:.1f} MB",
            )
        )
    table(rows)


# ---- grammar ----------------------------------------------------------------------------------

# Outputs that need not end early, so every run generates its full count of tokens.
BENCH_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "note": {"type": "string"}},
        "required": ["name", "age", "note"],
        "additionalProperties": False,
    },
}
BENCH_GBNF = r"""
root ::= line+
line ::= "- " word (" " word)* "." "\n"
word ::= [a-zA-Z]+ | [0-9]+
"""


def constrained_rates(client: kvkeep.Client, n: int, repeat: int) -> dict[str, list[float]]:
    """Tokens/s of one streamed session, unconstrained and under each grammar, interleaved."""
    kinds: dict[str, dict[str, Any]] = {
        "unconstrained": {},
        "JSON schema": {"json_schema": BENCH_SCHEMA},
        "GBNF grammar": {"grammar": BENCH_GBNF},
    }
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(repeat):
        for kind, options in kinds.items():
            s = client.create_session(sampling=SamplingParams(temperature=0.8, seed=i))
            # Prefill, compile and the first token outside the timing; the rest continues
            # within the open constraint.
            s.complete("A list of the guests and what they said:\n", max_tokens=1, **options)
            started = time.perf_counter()
            got = 0
            for chunk in s.generate("", max_tokens=n):
                got += len(chunk.token_ids)
            rates[kind].append(got / (time.perf_counter() - started))
            s.close()
    return rates


def mask_costs(tokens: list[int], gbnf: str) -> dict[str, list[float]]:
    """Seconds per token along `tokens`: the allowed set by llguidance (as the daemon runs
    it) and by llama.cpp's grammar sampler over the whole vocabulary; the daemon's sampler
    on one logits row without and with the mask (its computation included)."""
    import ctypes

    import llama_cpp as lc
    import llguidance
    import numpy as np
    from llguidance.llamacpp import lltokenizer_from_vocab

    import kvkeepd.engine.sampling
    from kvkeepd.engine.structured_output import Matcher, compile_spec
    from kvkeepd.values.constraints import GrammarSpec

    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(default_model_path()).encode(), params)
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    eog = [t for t in range(n_vocab) if lc.llama_vocab_is_eog(vocab, t)]
    tokenizer = lltokenizer_from_vocab(vocab, eos_token=eog)
    matcher = Matcher(
        compile_spec(tokenizer, GrammarSpec("gbnf", gbnf), llguidance.LLParserLimits()), n_vocab
    )
    row = (np.random.default_rng(0).standard_normal(n_vocab) * 3).astype(np.float32)
    params = kvkeepd.engine.sampling.SamplingParams(seed=1)
    ours, plain, masked = [], [], []
    for i, t in enumerate(tokens):
        started = time.perf_counter()
        allowed = matcher.allowed()
        ours.append(time.perf_counter() - started)
        assert allowed[t]
        started = time.perf_counter()
        kvkeepd.engine.sampling.sample(row, tokens[:i], params, i, allowed)
        masked.append(time.perf_counter() - started + ours[-1])
        started = time.perf_counter()
        kvkeepd.engine.sampling.sample(row, tokens[:i], params, i)
        plain.append(time.perf_counter() - started)
        matcher.consume(t)
    sampler = lc.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    data = (lc.llama_token_data * n_vocab)()
    theirs = []
    for t in tokens:
        for j in range(n_vocab):
            data[j].id, data[j].logit, data[j].p = j, 0.0, 0.0
        array = lc.llama_token_data_array(data=data, size=n_vocab, selected=-1, sorted=False)
        started = time.perf_counter()
        lc.llama_sampler_apply(sampler, ctypes.byref(array))
        theirs.append(time.perf_counter() - started)
        if not np.isfinite(data[t].logit):  # the two engines disagree: stop comparing here
            break
        lc.llama_sampler_accept(sampler, t)
    lc.llama_sampler_free(sampler)
    lc.llama_model_free(model)
    return {"llguidance": ours, "llama.cpp": theirs, "plain": plain, "masked": masked}


def bench_grammar(args: argparse.Namespace) -> None:
    n = args.tokens
    with connected("--slots", "1", "--threads", str(args.threads)) as (client, _):
        rates = constrained_rates(client, n, args.repeat)
        s = client.create_session(sampling=SamplingParams(temperature=0.8, seed=1))
        sample = s.complete("A list of the guests and what they said:\n", grammar=BENCH_GBNF, max_tokens=n)
        s.close()
    base = statistics.median(rates["unconstrained"])
    rows = [("generation", f"tokens/s (median of {args.repeat})", "ms/token", "vs unconstrained")]
    for kind, values in rates.items():
        rate = statistics.median(values)
        rows.append((kind, f"{rate:.1f}", f"{1000 / rate:.2f}", f"{rate / base:.2f}x"))
    table(rows)
    print()
    costs = mask_costs(list(sample.token_ids), BENCH_GBNF)
    ours, theirs = costs["llguidance"], costs["llama.cpp"]
    mine, other = statistics.median(ours), statistics.median(theirs)
    table(
        [
            ("allowed set per token (GBNF above)", "median", "max", "tokens"),
            (
                "llguidance (the daemon's)",
                f"{mine * 1e6:.0f} us",
                f"{max(ours) * 1e6:.0f} us",
                str(len(ours)),
            ),
            (
                "llama.cpp grammar sampler, whole vocabulary",
                f"{other * 1e6:.0f} us ({other / mine:.0f}x)",
                f"{max(theirs) * 1e6:.0f} us",
                str(len(theirs)),
            ),
        ]
    )
    print()
    plain, masked = statistics.median(costs["plain"]), statistics.median(costs["masked"])
    table(
        [
            ("sampler, one logits row", "median per token", "vs unconstrained"),
            ("unconstrained", f"{plain * 1e6:.0f} us", "1.00x"),
            ("GBNF mask computed and applied", f"{masked * 1e6:.0f} us", f"{masked / plain:.2f}x"),
        ]
    )


# ---- http ---------------------------------------------------------------------------------------


def bench_http(args: argparse.Namespace) -> None:
    import socket

    import openai

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    system = " ".join(
        f"Note {i}: the ledger of pier {i * 7 % 101} lists {i * 13 % 37} crates of salt."
        for i in range(args.prompt_tokens // 20)
    )
    flags = ("--slots", "4", "--ctx-per-session", "2048", "--threads", str(args.threads))
    rows = [("turn", "prompt tokens", "from scratch", "resent whole", "by session_id", "cached (resent)")]
    with daemon(*flags, "--http", f"127.0.0.1:{port}"):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=600, max_retries=0)
        model = c.models.list().data[0].id

        def turn(messages: list[dict[str, str]], **extra: str) -> tuple[float, str, int, int, str]:
            """Time to first token, the reply, prompt and cached tokens, the session id."""
            started, first, text = time.perf_counter(), 0.0, ""
            prompt = cached = 0
            stream = c.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=args.reply_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
            session_id = ""
            for chunk in stream:
                session_id = (chunk.model_extra or {}).get("session_id", session_id)
                if chunk.choices:
                    first = first or time.perf_counter() - started
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                    prompt, cached = (
                        chunk.usage.prompt_tokens,
                        chunk.usage.prompt_tokens_details.cached_tokens or 0,
                    )
            return first, text, prompt, cached, session_id

        conversation = [{"role": "system", "content": system}]
        session_id = "new"
        for i in range(args.turns):
            question = {"role": "user", "content": f"What does the ledger of pier {i * 7 % 101} list?"}
            conversation.append(question)
            # Another system prompt (a different first token): nothing of it is cached.
            other = [{"role": "system", "content": f"({i}) {system}"}, *conversation[1:]]
            scratch = turn(other)
            resent = turn(conversation)
            sent = conversation if session_id == "new" else [question]
            continued = turn(sent, session_id=session_id)
            session_id = continued[4]
            assert continued[1] == resent[1], "the two paths gave different replies"
            conversation.append({"role": "assistant", "content": resent[1]})
            rows.append(
                (
                    str(i + 1),
                    f"{resent[2]:,}",
                    f"{scratch[0] * 1e3:.0f} ms",
                    f"{resent[0] * 1e3:.0f} ms ({scratch[0] / resent[0]:.1f}x)",
                    f"{continued[0] * 1e3:.0f} ms ({scratch[0] / continued[0]:.1f}x)",
                    f"{resent[3]:,}",
                )
            )
            print(f"turn {i + 1}: done", file=sys.stderr)
    table(rows)


# ---- routing ----------------------------------------------------------------------------------


@contextmanager
def haproxy(daemons: list[str]) -> Iterator[str]:
    """HAProxy on deploy/haproxy.cfg in front of two daemons: its address."""
    import socket

    binary = shutil.which("haproxy")
    if binary is None:
        raise SystemExit("haproxy is not installed (scripts/servers installs it)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    env = {
        **os.environ,
        "KVKEEP_PROXY_ADDRESS": address,
        "KVKEEP_DAEMON_1": daemons[0],
        "KVKEEP_DAEMON_2": daemons[1],
    }
    proc = subprocess.Popen(
        [binary, "-db", "-f", str(ROOT / "deploy" / "haproxy.cfg")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with kvkeep.Client(address, timeout=2) as client:
                    client.info()
                break
            except kvkeep.KvkeepError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("haproxy did not start") from None
                time.sleep(0.1)
        yield address
    finally:
        proc.terminate()
        proc.wait(10)


def bench_routing(args: argparse.Namespace) -> None:
    """The same calls, interleaved, on two sessions of one daemon: one reached through
    HAProxy (which routes it by its x-kvkeep-session header), one reached directly."""
    flags = ("--slots", "2", "--ctx-per-session", "2048", "--threads", str(args.threads))
    greedy = SamplingParams(temperature=0.0)
    times: dict[str, dict[str, list[float]]] = {"direct": {}, "routed": {}}
    sizes: dict[str, int] = {}
    with (
        daemon(*flags) as (a, _),
        daemon(*flags) as (b, _),
        haproxy([a, b]) as proxy,
        kvkeep.Client(proxy, timeout=600) as routed,
    ):
        proxied = routed.create_session(sampling=greedy)
        target = next(d for d in (a, b) if _has_session(d, proxied.session_id))
        with kvkeep.Client(target, timeout=600) as direct:
            baseline = direct.create_session(sampling=greedy)
            pairs = {"routed": (routed, proxied), "direct": (direct, baseline)}
            for _, s in pairs.values():
                s.complete(STORY * (args.tokens // 20), max_tokens=1)
            base = {key: s.info().n_tokens for key, (_, s) in pairs.items()}
            checkpoints = {key: s.checkpoint().checkpoint_id for key, (_, s) in pairs.items()}

            def measure(name: str, fn: Callable[[str, kvkeep.Client, kvkeep.Session], Any]) -> None:
                for i in range(args.repeat):
                    # Alternate which goes first, so that neither always follows the other.
                    for key, (client, session) in list(pairs.items())[:: 1 if i % 2 else -1]:
                        elapsed, _ = timed(lambda k=key, c=client, s=session: fn(k, c, s))
                        times[key].setdefault(name, []).append(elapsed)
                        if session.info().n_tokens != base[key]:
                            session.rewind(base[key])  # the same history for every repeat

            channels = {"routed": grpc.insecure_channel(proxy), "direct": grpc.insecure_channel(target)}

            def export(key: str, client: kvkeep.Client, session: kvkeep.Session) -> None:
                # An export names only its checkpoint, which the SDK cannot route; sent here
                # with its session's header, the proxy takes it to the daemon that has it.
                stub = pb_grpc.KvKeepStub(channels[key])
                request = pb.ExportCheckpointRequest(checkpoint_id=checkpoints[key])
                metadata = [("x-kvkeep-session", session.session_id)]
                sizes[key] = sum(len(r.data) for r in stub.ExportCheckpoint(request, metadata=metadata))

            measure("GetSession", lambda k, c, s: s.info())
            measure("one-token turn", lambda k, c, s: s.complete(" and", max_tokens=1))
            measure("64 tokens, streamed", lambda k, c, s: list(s.generate(" Then", max_tokens=64)))
            measure("export", export)
            for channel in channels.values():
                channel.close()
    rows = [("measure", "direct (median)", "through HAProxy (median)", "routed / direct")]
    for name, direct_times in times["direct"].items():
        d, r = statistics.median(direct_times), statistics.median(times["routed"][name])
        label = f"export ({sizes['direct'] / 1e6:.1f} MB)" if name == "export" else name
        rows.append((label, f"{d * 1e3:.2f} ms", f"{r * 1e3:.2f} ms", f"{r / d:.2f}x"))
    table(rows)


def _has_session(address: str, session_id: str) -> bool:
    with kvkeep.Client(address, timeout=30) as client:
        try:
            client.session(session_id)
        except kvkeep.NotFoundError:
            return False
    return True


# ---- prefill ----------------------------------------------------------------------------------


@contextmanager
def llama_server(binary: Path, threads: int, *flags: str) -> Iterator[tuple[str, int]]:
    """llama-server on the default model and a free port: (its base URL, its pid)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [str(binary), "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", str(threads), "-tb", str(threads), "-c", "2048", "-np", "1", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: {' '.join(cmd)}")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_pid(state: Path) -> int:
    """The pid of the daemon subprocess serving a state dir (bench's `daemon` starts it)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                args = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(state).encode() in args and b"kvkeepd" in args:
                return int(proc.name)
    raise RuntimeError(f"no daemon process serves {state}")


def server_prefill(url: str, prompt: str) -> int:
    """The prompt tokens of one /completion with nothing cached."""
    body = json.dumps({"prompt": prompt, "n_predict": 1, "cache_prompt": False}).encode()
    request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1200) as r:
        answer = json.load(r)
    return int(answer["timings"]["prompt_n"])


def kvkeep_prefill(client: kvkeep.Client, prompt: str) -> int:
    """The prompt tokens of one Generate of a fresh session, one token generated."""
    s = client.create_session(sampling=SamplingParams(temperature=0.0))
    c = s.complete(prompt, max_tokens=1)
    s.close()
    return c.usage.evaluated_tokens


def bench_prefill(args: argparse.Namespace) -> None:
    threads = str(args.threads)
    flags = ("--slots", "1", "--ctx-per-session", "2048", "--threads", threads, "--no-prefix-cache")
    with contextlib.ExitStack() as stack:
        exact, exact_state = stack.enter_context(connected(*flags))
        fast, fast_state = stack.enter_context(connected(*flags, "--flash-attn"))
        assert (exact.info().mode, fast.info().mode) == ("exact", "compact")
        paths: dict[str, tuple[Callable[[str], int], int]] = {
            "kvkeep exact mode": (functools.partial(kvkeep_prefill, exact), daemon_pid(exact_state)),
            "kvkeep --flash-attn (compact)": (
                functools.partial(kvkeep_prefill, fast),
                daemon_pid(fast_state),
            ),
        }
        if args.peer is not None:
            default, default_pid = stack.enter_context(llama_server(args.peer, args.threads))
            fa_off, fa_off_pid = stack.enter_context(llama_server(args.peer, args.threads, "-fa", "off"))
            paths["llama-server (default: -fa auto)"] = (
                functools.partial(server_prefill, default),
                default_pid,
            )
            paths["llama-server -fa off"] = (functools.partial(server_prefill, fa_off), fa_off_pid)
        # The prompt's length in tokens, then about --tokens of it.
        story = STORY * (args.tokens // 20)
        n = kvkeep_prefill(exact, story)
        prompt = STORY * max(1, round(len(story) / len(STORY) * args.tokens / n))
        wall: dict[str, list[float]] = {name: [] for name in paths}
        cpu: dict[str, list[float]] = {name: [] for name in paths}
        counts: dict[str, int] = {}
        for _ in range(args.repeat):  # in turns, so that the machine's load falls on all alike
            for name, (run, pid) in paths.items():
                started, cpu_before = time.perf_counter(), cpu_seconds(pid)
                counts[name] = run(prompt)
                wall[name].append(counts[name] / (time.perf_counter() - started))
                cpu[name].append(counts[name] / (cpu_seconds(pid) - cpu_before))
    base, base_cpu = (
        statistics.median(wall["kvkeep exact mode"]),
        statistics.median(cpu["kvkeep exact mode"]),
    )
    rows = [
        (
            "path",
            "prompt tokens",
            f"tokens/s (median of {args.repeat})",
            "vs exact mode",
            "tokens per CPU second",
            "vs exact mode",
        )
    ]
    for name in paths:
        rate, per_cpu = statistics.median(wall[name]), statistics.median(cpu[name])
        rows.append(
            (
                name,
                str(counts[name]),
                f"{rate:.1f}",
                f"{rate / base:.2f}x",
                f"{per_cpu:.1f}",
                f"{per_cpu / base_cpu:.2f}x",
            )
        )
    table(rows)


def one_token_turn(s: kvkeep.Session, token: int) -> float:
    """Seconds for a turn of a one-token prompt and one generated token, to its last chunk
    (a persistent turn's is sent once the turn is durable)."""
    started = time.perf_counter()
    for _ in s.generate([token], max_tokens=1):
        pass
    return time.perf_counter() - started


def bench_turns(args: argparse.Namespace) -> None:
    """A persistent session of about --tokens tokens and an ephemeral fork of it: one-token
    turns, interleaved; then the first turn of the persistent session after a graceful
    restart (its state read from disk) against a restore of its checkpoint from disk and a
    one-token turn, and the first turn after kill -9."""
    flags = ("--slots", "4", "--ctx-per-session", "4096", "--threads", str(args.threads), *args.flag)
    greedy = SamplingParams(temperature=0.0)
    state = Path(tempfile.mkdtemp(prefix="kvkeep-bench-"))
    try:
        with daemon(*flags, state=state) as (address, _), kvkeep.Client(address) as client:
            persistent = client.create_session(sampling=greedy, persistent=True)
            probe = persistent.complete(STORY, max_tokens=1).usage.prompt_tokens
            persistent.complete(STORY * max(1, args.tokens // max(probe, 1) - 1), max_tokens=1)
            ephemeral = client.fork_session(persistent.session_id)
            token = persistent.complete(" and", max_tokens=1).token_ids[0]
            for s in (persistent, ephemeral):  # warm: both hot, their first turns done
                one_token_turn(s, token)
            turns: dict[str, list[float]] = {"persistent": [], "ephemeral": []}
            for _ in range(args.turns):
                turns["persistent"].append(one_token_turn(persistent, token))
                turns["ephemeral"].append(one_token_turn(ephemeral, token))
            n = persistent.info().n_tokens
            ckpt = persistent.checkpoint("bench")
            scratch = client.create_session(sampling=greedy, persistent=True)

            def restore_turn() -> float:
                started = time.perf_counter()
                scratch.restore(ckpt.checkpoint_id)
                one_token_turn(scratch, token)
                return time.perf_counter() - started

            restores = [restore_turn() for _ in range(args.repeat)]
            scratch.close()
            sid = persistent.session_id
        after: dict[str, float] = {}
        for how in ("restart", "kill -9"):
            with daemon(*flags, state=state) as (address, s_dir), kvkeep.Client(address) as client:
                s = client.session(sid)
                after[how] = one_token_turn(s, token)
                for _ in range(3):  # turns that leave work for a replay after the kill
                    one_token_turn(s, token)
                if how == "restart":
                    os.kill(int((s_dir / "lock").read_text()), signal.SIGKILL)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    p, e = statistics.median(turns["persistent"]), statistics.median(turns["ephemeral"])
    r = statistics.median(restores)
    table(
        [
            (f"measure ({n}-token session, {args.threads} threads, medians)", "value", "ratio"),
            (f"one-token turn, ephemeral ({args.turns} turns)", f"{e * 1e3:.1f} ms", "1x"),
            (
                f"one-token turn, persistent ({args.turns} turns)",
                f"{p * 1e3:.1f} ms",
                f"{p / e:.2f}x ephemeral",
            ),
            (f"restore from disk + one-token turn ({args.repeat})", f"{r * 1e3:.1f} ms", "1x"),
            (
                "first turn after a restart",
                f"{after['restart'] * 1e3:.1f} ms",
                f"{after['restart'] / r:.2f}x restore",
            ),
            (
                "first turn after kill -9",
                f"{after['kill -9'] * 1e3:.1f} ms",
                f"{after['kill -9'] / r:.2f}x restore",
            ),
        ]
    )


# ---- store -------------------------------------------------------------------------------------

# The moving daemons' lease: the holder renews it, and lets a wanted session go, every third.
LEASE_SECONDS = 1.5


def store_servers(work: Path) -> tuple[Any, Any]:
    """Redis and S3 (weed mini) on loopback, as the tests start them (tests/support/servers.py)."""
    missing = [
        b
        for b in ("redis-server", "weed")
        if not (shutil.which(b) or (Path(sys.executable).parent / b).exists())
    ]
    if missing:
        sys.exit(f"scripts/bench store needs {', '.join(missing)}: scripts/servers installs them")
    sys.path.insert(0, str(ROOT / "tests"))
    from servers import RedisServer, WeedMini

    redis = RedisServer(work / "redis").start()
    try:
        weed = WeedMini(work / "weed").start()
    except BaseException:
        redis.stop()
        raise
    return redis, weed


def restore_times(client: kvkeep.Client, text: str, repeat: int) -> dict[str, Any]:
    """A persistent session of `text`: its prefill, a full checkpoint, and restore + first
    token of that checkpoint `repeat` times (each restore reads every block from the store)."""
    s = client.create_session(sampling=SamplingParams(temperature=0.0), persistent=True)
    prefill, done = timed(lambda: s.complete(text, max_tokens=1))
    ck = s.checkpoint("full")  # its blocks are the autosave's: written during the prefill

    def restore_first() -> None:
        s.restore(ck.checkpoint_id)
        next(iter(s.generate("", max_tokens=1)))

    restores = [timed(restore_first)[0] for _ in range(repeat)]
    s.close()
    n = done.usage.prompt_tokens if done.usage else 0
    return {"n": n, "prefill": prefill, "bytes": ck.bytes_referenced, "restores": restores}


def move_times(
    common: tuple[str, ...], catalog: str, store: tuple[str, ...], text: str, repeat: int
) -> tuple[list[float], list[float]]:
    """A persistent session moving between two daemons that share a catalog and a store, by
    one-token turns on the daemon that does not have it: (whole requests, the hand-over by
    the holder's next lease renewal included; requests sent once the holder let it go: the
    lease taken, the head restored from the store, the first token)."""
    flags = (*common, "--catalog", catalog, *store, "--lease-seconds", str(LEASE_SECONDS))
    with daemon(*flags) as (a_address, a_state):
        b_root = Path(tempfile.mkdtemp(prefix="kvkeep-bench-"))
        (b_root / "s").mkdir(mode=0o700)
        shutil.copy(a_state / "store.key", b_root / "s" / "store.key")  # shared manifests' key
        with (
            daemon(*flags, state=b_root) as (b_address, _),
            kvkeep.Client(a_address) as a,
            kvkeep.Client(b_address) as b,
        ):
            s = a.create_session(sampling=SamplingParams(temperature=0.0), persistent=True)
            s.complete(text, max_tokens=1)
            whole, moves = [], []
            for i in range(2 * repeat):
                address, there = ((b_address, b), (a_address, a))[i % 2]

                def move(there: kvkeep.Client = there) -> None:
                    next(iter(there.session(s.session_id).generate("", max_tokens=1)))

                if i < repeat:
                    whole.append(timed(move)[0])
                    continue
                # Asked for and given up at once: the holder lets it go at its next renewal.
                with (
                    kvkeep.Client(address, timeout=0.05) as asker,
                    contextlib.suppress(kvkeep.KvkeepError),
                ):
                    asker.session(s.session_id)
                time.sleep(LEASE_SECONDS / 3 + 0.5)
                moves.append(timed(move)[0])
        shutil.rmtree(b_root, ignore_errors=True)
    return whole, moves


def bench_store(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="kvkeep-bench-servers-"))
    redis, weed = store_servers(work)
    try:
        os.environ.update(weed.server.env)  # the daemons' S3 credentials (AWS_* variables)
        common = ("--slots", "4", "--ctx-per-session", "4096", "--threads", str(args.threads))
        stores = {
            "local disk": (),
            "Redis": ("--store", redis.url),
            "S3 (weed mini)": (
                "--store",
                f"s3://{weed.bucket}/bench",
                "--s3-endpoint",
                weed.server.endpoint_url,
            ),
        }
        with connected(*common) as (client, _):
            probe = client.create_session()
            per_story = probe.complete(STORY, max_tokens=1).usage.prompt_tokens
            probe.close()
        text = STORY * max(1, args.tokens // max(per_story, 1))
        runs = {}
        for name, flags in stores.items():
            with connected(*common, *flags) as (client, _):
                runs[name] = restore_times(client, text, args.repeat)
        whole, moves = move_times(
            common, f"{redis.url}?prefix=bench", ("--store", redis.url), text, args.repeat
        )
    finally:
        weed.stop()
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    prefill = statistics.median(r["prefill"] for r in runs.values())
    local = statistics.median(runs["local disk"]["restores"])
    n = runs["local disk"]["n"]
    rows = [
        (
            f"{n}-token persistent session ({runs['local disk']['bytes'] / 1e6:.1f} MB), {args.threads} thr.",
            "median",
            "vs local restore",
            "vs re-prefill",
        ),
        ("re-prefill from text + first token (median of 3 daemons)", f"{prefill * 1e3:,.0f} ms", "", "1x"),
    ]
    for name, run in runs.items():
        restore = statistics.median(run["restores"])
        rows.append(
            (
                f"restore + first token from {name} (median of {args.repeat})",
                f"{restore * 1e3:.1f} ms",
                f"{restore / local:.2f}x",
                f"{prefill / restore:.0f}x faster",
            )
        )
    for what, times in (("hand-over included", whole), ("once the holder let it go", moves)):
        move = statistics.median(times)
        rows.append(
            (
                f"the session moving to the other daemon, {what} (median of {args.repeat})",
                f"{move * 1e3:.1f} ms",
                f"{move / local:.2f}x (target <= 3x)",
                f"{prefill / move:.0f}x faster (target >= 50x)",
            )
        )
    print(f"two daemons: Redis catalog and store, --lease-seconds {LEASE_SECONDS} (renewed every third)")
    table(rows)


def bench_shared_turns(args: argparse.Namespace) -> None:
    """A persistent session of about --tokens tokens on each of two daemons, one with its own
    catalog and store, one sharing a Redis catalog and store (appendfsync always): one-token
    turns, interleaved. Each turn is acknowledged once durable: an fdatasync of the journal
    file, or a script on the catalog's server (which fsyncs its log before answering); both
    write a head by the same --head-interval rule."""
    work = Path(tempfile.mkdtemp(prefix="kvkeep-bench-servers-"))
    sys.path.insert(0, str(ROOT / "tests"))
    from servers import RedisServer

    redis = RedisServer(work / "redis").start()
    common = ("--slots", "2", "--ctx-per-session", "4096", "--threads", str(args.threads))
    shared_flags = ("--catalog", f"{redis.url}?prefix=bench", "--store", redis.url)
    greedy = SamplingParams(temperature=0.0)
    try:
        with connected(*common) as (local, _), connected(*common, *shared_flags) as (shared, _):
            sessions: dict[str, kvkeep.Session] = {}
            for name, client in (("local", local), ("shared", shared)):
                s = client.create_session(sampling=greedy, persistent=True)
                per_story = s.complete(STORY, max_tokens=1).usage.prompt_tokens
                s.complete(STORY * max(1, args.tokens // max(per_story, 1) - 1), max_tokens=1)
                sessions[name] = s
            token = sessions["local"].complete(" and", max_tokens=1).token_ids[0]
            for s in sessions.values():  # warm: hot, a first turn done
                one_token_turn(s, token)
            turns: dict[str, list[float]] = {name: [] for name in sessions}
            for _ in range(args.turns):
                for name, s in sessions.items():
                    turns[name].append(one_token_turn(s, token))
            n = sessions["local"].info().n_tokens
    finally:
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    local_ms = statistics.median(turns["local"]) * 1e3
    shared_ms = statistics.median(turns["shared"]) * 1e3
    p95 = {name: sorted(t)[int(0.95 * (len(t) - 1))] * 1e3 for name, t in turns.items()}
    table(
        [
            (
                f"persistent one-token turn ({n}-token session, {args.threads} threads)",
                "median",
                "p95",
                "ratio",
            ),
            (
                "own catalog and store (journal file, fdatasync)",
                f"{local_ms:.1f} ms",
                f"{p95['local']:.1f} ms",
                "1x",
            ),
            (
                "shared Redis catalog and store (journal on the server)",
                f"{shared_ms:.1f} ms",
                f"{p95['shared']:.1f} ms",
                f"{shared_ms / local_ms:.2f}x (target <= 1.2x)",
            ),
        ]
    )


def main() -> None:
    import bench_agent
    import bench_agent_cli
    import bench_chain
    import bench_exact_speed
    import bench_fairness
    import bench_peer  # imports this module's helpers as `bench`
    import bench_scale
    import bench_tools

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--charts", type=Path, default=None, metavar="DIR", help="also draw PNG charts into DIR"
    )
    sub = parser.add_subparsers(dest="what", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--tokens", type=int, default=128)
    g.add_argument("--repeat", type=int, default=3)
    c = sub.add_parser("checkpoint")
    c.add_argument("--tokens", type=int, default=2000)
    c.add_argument("--repeat", type=int, default=5)
    c.add_argument("--codec", default="lz4", choices=["lz4", "zstd", "none"])
    c.add_argument("--model", type=Path, default=None, help="GGUF file (default: the embedded model)")
    s = sub.add_parser("sessions")
    s.add_argument("--tokens", type=int, default=48, help="tokens per session in the batching run")
    s.add_argument("--sessions", type=int, default=32)
    s.add_argument("--context", type=int, default=2000)
    s.add_argument("--rounds", type=int, default=2)
    p = sub.add_parser("prefix")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    r = sub.add_parser("grammar")
    r.add_argument("--tokens", type=int, default=128)
    r.add_argument("--repeat", type=int, default=3)
    h = sub.add_parser("http")
    h.add_argument("--turns", type=int, default=5)
    h.add_argument("--prompt-tokens", type=int, default=1000)
    h.add_argument("--reply-tokens", type=int, default=16)
    o = sub.add_parser("routing")
    o.add_argument("--tokens", type=int, default=1000, help="tokens of each session's history")
    o.add_argument("--repeat", type=int, default=20)
    f = sub.add_parser("prefill")
    f.add_argument("--tokens", type=int, default=1900)
    f.add_argument("--repeat", type=int, default=3)
    f.add_argument("--peer", type=Path, default=None, metavar="LLAMA_SERVER", help="a llama-server binary")
    bench_peer.add_parser(sub)
    bench_tools.add_parser(sub)
    bench_agent.add_parser(sub)
    bench_agent_cli.add_parser(sub)
    bench_chain.add_parser(sub)
    bench_fairness.add_parser(sub)
    bench_exact_speed.add_parser(sub)
    bench_scale.add_parser(sub)
    t = sub.add_parser("turns")
    t.add_argument("--tokens", type=int, default=1900)
    t.add_argument("--turns", type=int, default=60)
    t.add_argument("--repeat", type=int, default=7)
    t.add_argument(
        "--flag", action="append", default=[], help="a daemon flag (repeatable): --flag=--codec=none"
    )
    st = sub.add_parser("store")
    st.add_argument("--tokens", type=int, default=2000)
    st.add_argument("--repeat", type=int, default=5)
    sh = sub.add_parser("shared-turns")
    sh.add_argument("--tokens", type=int, default=1900)
    sh.add_argument("--turns", type=int, default=60)
    args = parser.parse_args()
    benches = {
        "generate": bench_generate,
        "checkpoint": bench_checkpoint,
        "sessions": bench_sessions,
        "prefix": bench_prefix,
        "grammar": bench_grammar,
        "http": bench_http,
        "routing": bench_routing,
        "prefill": bench_prefill,
        "peer": bench_peer.run,
        "tools": bench_tools.run,
        "agent": bench_agent.run,
        "agent-cli": bench_agent_cli.run,
        "chain": bench_chain.run,
        "fairness": bench_fairness.run,
        "exact-speed": bench_exact_speed.run,
        "scale": bench_scale.run,
        "turns": bench_turns,
        "store": bench_store,
        "shared-turns": bench_shared_turns,
    }
    benches[args.what](args)


if __name__ == "__main__":
    main()
