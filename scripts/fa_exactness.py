"""Flash attention on llama-server: is a token's next-token distribution the same however its
prompt was batched, and how fast is prompt evaluation?

    .venv/bin/python scripts/fa_exactness.py exact LLAMA_SERVER [--batch-invariant] [--fa on|off]
    .venv/bin/python scripts/fa_exactness.py speed --build NAME:LLAMA_SERVER:FA:INVARIANT ...

`exact` evaluates a prompt of random token ids whole (nothing cached), then as a cached prefix
plus a suffix of 1, 7, 63, 64, 65 and 500 tokens (llama-server's prompt cache: the prefix is
sent first, then the whole prompt), on slot 1 of a server with two slots and per-slot KV
(`--no-kv-unified`, as kvkeep's exact mode), alone and while slot 0 generates; each
evaluation's top next-token log-probabilities (before sampling) must equal the whole
prompt's, bit for bit. Slot 0's token comes first in llama-server's batch, so llama.cpp puts
it in one ubatch with one of slot 1's prompt tokens at a time (split_equal over two streams):
the prompt is then evaluated a token at a time beside another sequence's. `--batch-invariant`
sets GGML_CPU_FA_BATCH_INVARIANT=1 (the patch in patches/llama.cpp). Exits 1 when any differ.

`speed` evaluates a prompt of about 1k, 4k and 8k tokens with nothing cached on each given
server configuration in turn, repeated, and prints the medians of tokens/s and tokens per CPU
second of the server process, the compute buffer llama-server logs, and the median time and
CPU time of a decode step (a token generated) at that context.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvkeepd.config.settings import default_model_path

SUFFIXES = (500, 65, 64, 63, 7, 1)  # longest first: each later prefix is already cached
TOP = 20
# Token ids to draw prompts from: past SmolLM2's special tokens, within its vocabulary.
FIRST_ID, LAST_ID = 100, 49000


class Server:
    """A llama-server subprocess on a free port, its log, and a kept-alive connection."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """One non-streamed /completion on the kept connection."""
        self.conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response = self.conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"/completion: {response.status} {data[:300]!r}")
        answer: dict[str, Any] = json.loads(data)
        return answer

    def compute_buffer_mib(self) -> float:
        """The CPU compute buffer llama-server logged at start, in MiB."""
        found = re.findall(r"CPU compute buffer size =\s*([0-9.]+) MiB", self.log.read_text())
        return float(found[-1]) if found else float("nan")


@contextmanager
def llama_server(
    binary: Path, *, fa: str, batch_invariant: bool, threads: int, ctx: int, slots: int
) -> Iterator[Server]:
    """llama-server on the default model: `slots` slots of `ctx` tokens each, per-slot KV."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    env = dict(os.environ)
    env.pop("GGML_CPU_FA_BATCH_INVARIANT", None)
    if batch_invariant:
        env["GGML_CPU_FA_BATCH_INVARIANT"] = "1"
    log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    cmd = [str(binary), "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", str(threads), "-tb", str(threads), "-c", str(ctx * slots), "-np", str(slots)]
    cmd += ["-fa", fa, "--no-kv-unified", "--no-webui", "-lv", "4"]  # -lv 4: the buffer sizes
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: see {log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
                if ok:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        yield Server(proc, port, log)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def top_logprobs(answer: dict[str, Any]) -> list[tuple[int, float]]:
    """The next token's top (id, log-probability) pairs, before sampling."""
    first = answer["completion_probabilities"][0]
    return [(int(t["id"]), float(t["logprob"])) for t in first["top_logprobs"]]


def evaluate(
    server: Server, tokens: list[int], *, cached: bool, slot: int = 1
) -> tuple[int, list[tuple[int, float]]]:
    """(prompt tokens evaluated, top next-token log-probabilities) of one request on `slot`."""
    answer = server.complete(
        {
            "prompt": tokens,
            "n_predict": 1,
            "n_probs": TOP,
            "post_sampling_probs": False,
            "temperature": 0.0,
            "cache_prompt": cached,
            "id_slot": slot,
        }
    )
    return int(answer["timings"]["prompt_n"]), top_logprobs(answer)


@contextmanager
def busy_slot(server: Server) -> Iterator[None]:
    """Slot 0 generates, streamed, until the block ends: its tokens share slot 1's ubatches."""
    stop = threading.Event()

    def generate() -> None:
        rng = random.Random(1)
        while not stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=3600)
            prompt = [rng.randrange(FIRST_ID, LAST_ID) for _ in range(16)]
            body = {"prompt": prompt, "n_predict": 256, "ignore_eos": True, "stream": True, "id_slot": 0}
            conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            while not stop.is_set() and response.readline():
                pass
            conn.close()  # the server cancels a stream whose client has gone

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    time.sleep(1.0)  # let slot 0 start decoding
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)


def exactness(server: Server, length: int, seed: int) -> list[tuple[str, int, bool, float]]:
    """Rows (how, tokens evaluated, same as whole, top logprob) for one prompt of `length`."""
    rng = random.Random(seed)
    prompt = [rng.randrange(FIRST_ID, LAST_ID) for _ in range(length)]
    n, whole = evaluate(server, prompt, cached=False)
    rows = [("whole", n, True, whole[0][1])]
    evaluate(server, prompt[: length - SUFFIXES[0]], cached=False)
    for suffix in SUFFIXES:
        evaluate(server, prompt[: length - suffix], cached=True)
        n, got = evaluate(server, prompt, cached=True)
        if n != suffix:
            raise RuntimeError(f"expected {suffix} tokens evaluated after the cached prefix, got {n}")
        rows.append((f"prefix + {suffix}", n, got == whole, got[0][1]))
    return rows


def run_exact(args: argparse.Namespace) -> None:
    failed = False
    ctx = max(args.tokens) + 512
    with llama_server(
        args.binary, fa=args.fa, batch_invariant=args.batch_invariant, threads=args.threads, ctx=ctx, slots=2
    ) as server:
        for length in args.tokens:
            for beside in (False, True):
                if beside:
                    with busy_slot(server):
                        rows = exactness(server, length, seed=length)
                else:
                    rows = exactness(server, length, seed=length)
                where = "slot 0 generating" if beside else "alone"
                for how, n, same, logprob in rows:
                    failed |= not same
                    verdict = "same" if same else "DIFFERS"
                    print(f"{length:>6} {where:<18} {how:<14} {n:>6} {verdict:<8} {logprob!r}")
                sys.stdout.flush()
    sys.exit(1 if failed else 0)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_speed(args: argparse.Namespace) -> None:
    builds: list[tuple[str, Path, str, bool]] = []
    for spec in args.build:
        name, binary, fa, invariant = spec.split(":")
        builds.append((name, Path(binary), fa, invariant == "1"))
    for length in args.tokens:
        rate: dict[str, list[float]] = {name: [] for name, *_ in builds}
        per_cpu: dict[str, list[float]] = {name: [] for name, *_ in builds}
        buffer: dict[str, float] = {}
        decode_ms: dict[str, list[float]] = {name: [] for name, *_ in builds}
        decode_cpu_ms: dict[str, list[float]] = {name: [] for name, *_ in builds}
        for round_ in range(args.repeat):  # in turns, so that the machine's load falls on all alike
            prompt = [random.Random(round_).randrange(FIRST_ID, LAST_ID) for _ in range(length)]
            for name, binary, fa, invariant in builds:
                with llama_server(
                    binary, fa=fa, batch_invariant=invariant, threads=args.threads, ctx=length + 256, slots=1
                ) as server:
                    started, cpu_before = time.perf_counter(), cpu_seconds(server.proc.pid)
                    n, _ = evaluate(server, prompt, cached=False, slot=0)
                    rate[name].append(n / (time.perf_counter() - started))
                    per_cpu[name].append(n / (cpu_seconds(server.proc.pid) - cpu_before))
                    buffer[name] = server.compute_buffer_mib()
                    # Then a decode step at that context: 9 tokens generated after the cached prompt,
                    # one evaluation each (the prompt's last token again, then 8 decode steps).
                    cpu_before = cpu_seconds(server.proc.pid)
                    timings = server.complete(
                        {
                            "prompt": prompt,
                            "n_predict": 9,
                            "ignore_eos": True,
                            "cache_prompt": True,
                            "id_slot": 0,
                        }
                    )["timings"]
                    decode_ms[name].append(timings["predicted_ms"] / timings["predicted_n"])
                    cpu = cpu_seconds(server.proc.pid) - cpu_before
                    decode_cpu_ms[name].append(1000 * cpu / timings["predicted_n"])
                print(f"# {length} round {round_} {name}: {rate[name][-1]:.1f} tokens/s", file=sys.stderr)
        base = statistics.median(rate[builds[0][0]])
        for name, *_ in builds:
            r, c = statistics.median(rate[name]), statistics.median(per_cpu[name])
            print(
                f"| {length} | {name} | {r:.1f} | {base / r:.2f}x | {c:.1f} | {buffer[name]:.1f} MiB |"
                f" {statistics.median(decode_ms[name]):.0f} ms |"
                f" {statistics.median(decode_cpu_ms[name]):.0f} ms |"
                f" {' '.join(f'{x:.1f}' for x in rate[name])} |"
            )
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    exact = sub.add_parser("exact", help="whole vs cached prefix + suffix, alone and beside slot 0")
    exact.add_argument("binary", type=Path, help="llama-server")
    exact.add_argument("--fa", default="on", choices=("on", "off", "auto"))
    exact.add_argument("--batch-invariant", action="store_true", help="GGML_CPU_FA_BATCH_INVARIANT=1")
    exact.add_argument("--tokens", type=int, nargs="+", default=[1000])
    exact.add_argument("--threads", type=int, default=2)
    speed = sub.add_parser("speed", help="prompt evaluation, configurations in turns")
    speed.add_argument(
        "--build",
        action="append",
        required=True,
        help="NAME:LLAMA_SERVER:FA:INVARIANT (FA on/off/auto, INVARIANT 0/1); the first is the base",
    )
    speed.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000, 8000])
    speed.add_argument("--repeat", type=int, default=3)
    speed.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    run_exact(args) if args.command == "exact" else run_speed(args)


if __name__ == "__main__":
    main()
