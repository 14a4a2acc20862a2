"""scripts/bench peer LLAMA_SERVER: kvkeep and llama-server side by side, in one run.

Both serve the same model with the same threads, context per session and batch size, and
are driven the same way: token ids in, greedy sampling, over one kept-alive connection
each (gRPC for kvkeep, HTTP/1.1 for llama-server). Every measure is a median of rounds
that interleave the two, so the machine's noise falls on both alike.

- a one-token turn on a hot session (~1,900 tokens): llama-server `/completion` with
  `cache_prompt` and `n_predict` 1 on the slot that holds them; kvkeep ephemeral and
  persistent (the latter's turn is durable when acknowledged);
- restore + one-token turn: llama-server `/slots/0?action=restore` of a file saved with
  `--slot-save-path` (in the page cache); kvkeep restoring a checkpoint of an ephemeral
  session (RAM: its whole state, kept when it was taken) and of a persistent one (disk, page
  cache: its blocks), alternating two checkpoints
  whose tokens part at the sixth, so that each restore loads a state (checked in GetInfo's
  swap-in count);
- rollback + one-token turn: kvkeep restoring the session's own checkpoint while it still
  holds its cells (the slot is cut, nothing loaded), beside the same slot restore;
- the first one-token turn of a persistent session after a daemon restart;
- the same restores with a cold page cache (`echo 1 > /proc/sys/vm/drop_caches` before
  each; the row is left out, saying why, where that is not permitted);
- tokens/s of one streamed session vs llama-cpp-python's `create_completion`, the two in
  turn within each round;
- aggregate tokens/s of 1, 4 and 8 concurrent sessions vs llama-server `-np 8`: rounds that
  run every count on kvkeep, then on llama-server, each speed-up the median of the rounds'
  own (N sessions vs 1 in the same round).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import STORY, daemon, llama, table, timed

import kvkeep
from kvkeep import SamplingParams
from kvkeepd.config.settings import default_model_path

GREEDY = SamplingParams(temperature=0.0)
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def add_parser(sub: Any) -> None:
    """The `peer` sub-command's arguments."""
    p = sub.add_parser("peer", help="kvkeep vs llama-server, same model, threads and context")
    p.add_argument("llama_server", type=Path, metavar="LLAMA_SERVER", help="the llama-server binary")
    p.add_argument("--tokens", type=int, default=1900, help="tokens of the session (default 1900)")
    p.add_argument("--ctx", type=int, default=4096, help="context per session (default 4096)")
    p.add_argument("--repeat", type=int, default=15, help="rounds per latency measure (default 15)")
    p.add_argument("--restarts", type=int, default=5, help="daemon restarts measured (default 5)")
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--stream-rounds", type=int, default=5, help="rounds of the streaming measure (default 5)")
    p.add_argument("--concurrent-tokens", type=int, default=48, help="tokens per concurrent session")
    p.add_argument(
        "--concurrent-rounds", type=int, default=5, help="rounds of the concurrency measures (default 5)"
    )
    p.add_argument("--concurrency-only", action="store_true", help="measure the concurrency rows only")
    p.add_argument(
        "--flash-attn",
        default="off",
        choices=["on", "off", "auto"],
        help="llama-server's -fa (default off: the arithmetic of kvkeep's exact mode)",
    )
    p.add_argument("--no-cold", action="store_true", help="leave out the cold page-cache rows")


# ---- llama-server -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LlamaServer:
    """A llama-server subprocess and one kept-alive HTTP connection to it."""

    def __init__(self, port: int, proc: subprocess.Popen[bytes]) -> None:
        self.port = port
        self.proc = proc
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)

    def post(self, path: str, body: dict[str, Any], conn: http.client.HTTPConnection | None = None) -> Any:
        conn = conn or self.conn
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # The server closed a connection left idle (its keep-alive timeout): open it again.
            conn.close()
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"llama-server {path}: {response.status} {data[:300]!r}")
        return json.loads(data)

    def complete(
        self,
        tokens: list[int],
        n_predict: int = 1,
        slot: int = 0,
        conn: http.client.HTTPConnection | None = None,
    ) -> list[int]:
        """Evaluate what of `tokens` the slot lacks and generate; the generated token ids."""
        out = self.post(
            "/completion",
            {
                "prompt": tokens,
                "n_predict": n_predict,
                "cache_prompt": True,
                "id_slot": slot,
                "temperature": 0.0,
                "return_tokens": True,
                "ignore_eos": True,
            },
            conn,
        )
        return list(out["tokens"])

    def tokenize(self, text: str) -> list[int]:
        return list(self.post("/tokenize", {"content": text})["tokens"])

    def slot(self, action: str, filename: str, slot: int = 0) -> None:
        self.post(f"/slots/{slot}?action={action}", {"filename": filename})


@contextmanager
def llama_server(
    binary: Path, args: argparse.Namespace, n_parallel: int, save_dir: Path
) -> Iterator[LlamaServer]:
    port = free_port()
    log = (save_dir / f"llama-server-np{n_parallel}.log").open("w")
    proc = subprocess.Popen(
        [
            str(binary),
            "-m",
            str(default_model_path()),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(args.threads),
            "-tb",
            str(args.threads),
            "-c",
            str(args.ctx * n_parallel),
            "-np",
            str(n_parallel),
            "-b",
            "512",
            "-ub",
            "512",
            "-fa",
            args.flash_attn,
            "--no-kv-unified",
            "--slot-save-path",
            str(save_dir),
            "--no-webui",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: see {log.name}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    conn.close()
                    break
                conn.close()
            except OSError:
                pass
            time.sleep(0.1)
        yield LlamaServer(port, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# ---- helpers ----------------------------------------------------------------------------------


def drop_caches() -> bool:
    """Empty the page cache; False where that is not permitted."""
    try:
        os.sync()
        DROP_CACHES.write_text("1\n")
    except OSError:
        return False
    return True


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def ratio(value: float, base: float) -> str:
    return f"{value:.1f} ms ({value / base:.2f}x)"


def kv_turn(session: kvkeep.Session, token: int) -> None:
    """A one-token prompt and one generated token, to the end of the stream."""
    for _ in session.generate([token], max_tokens=1):
        pass


def kv_restore_turn(session: kvkeep.Session, checkpoint_id: str, token: int) -> None:
    session.restore(checkpoint_id)
    kv_turn(session, token)


def rounds(repeat: int, measures: dict[str, Callable[[], None]]) -> dict[str, list[float]]:
    """Each measure once per round, interleaved; seconds."""
    times: dict[str, list[float]] = {name: [] for name in measures}
    for fn in measures.values():  # one warm-up each: first-use costs are measured apart
        fn()
    for _ in range(repeat):
        for name, fn in measures.items():
            times[name].append(timed(fn)[0])
    return times


# ---- the benchmark ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    binary = args.llama_server.resolve()
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"not an executable: {binary}")
    work = Path(tempfile.mkdtemp(prefix="kvkeep-bench-peer-"))
    if args.concurrency_only:
        try:
            print_concurrency(args, concurrency(args, binary, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    try:
        latency = latencies(args, binary, work)
        stream = streaming(args)
        together = concurrency(args, binary, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_tables(args, latency, stream, together)


def latencies(args: argparse.Namespace, binary: Path, work: Path) -> dict[str, Any]:
    flags = (
        "--slots",
        "4",
        "--ctx-per-session",
        str(args.ctx),
        "--threads",
        str(args.threads),
        "--batch-size",
        "512",
    )
    state = work / "kvkeep"
    state.mkdir()
    out: dict[str, Any] = {}
    with llama_server(binary, args, 1, work) as server:
        text = STORY * (args.tokens // 20 + 2)
        ids = server.tokenize(text)[: args.tokens]
        token = ids[7]
        history = list(ids)
        history += server.complete(history)
        server.slot("save", "peer.bin")
        saved = list(history)

        def server_turn() -> None:
            history.append(token)
            history.extend(server.complete(history))

        def server_restore() -> None:
            server.slot("restore", "peer.bin")
            server.complete([*saved, token])

        with daemon(*flags, state=state) as (address, _), kvkeep.Client(address, timeout=600) as client:
            eph = client.create_session(sampling=GREEDY)
            per = client.create_session(sampling=GREEDY, persistent=True)
            for s in (eph, per):
                s.complete(ids, max_tokens=1)
            eph_ck = eph.checkpoint("peer").checkpoint_id
            per_ck = per.checkpoint("peer").checkpoint_id
            # The second checkpoint of each kind: the same tokens but the sixth, so a restore
            # never finds the other's cells in the session.
            other = [*ids[:5], ids[5] + 1, *ids[6:]]
            alternate: dict[str, str] = {}
            for persistent, ck in ((False, eph_ck), (True, per_ck)):
                s = client.create_session(sampling=GREEDY, persistent=persistent)
                s.complete(other, max_tokens=1)
                alternate[ck] = s.checkpoint("peer-other").checkpoint_id
                alternate[alternate[ck]] = ck  # (left open: closing drops its checkpoints)
            turn_of = {eph.session_id: [eph_ck], per.session_id: [per_ck]}

            def kv_alternating(session: kvkeep.Session) -> None:
                last = turn_of[session.session_id]
                last[0] = alternate[last[0]]
                kv_restore_turn(session, last[0], token)

            print("peer: sessions ready", file=sys.stderr)
            out["turn"] = rounds(
                args.repeat,
                {
                    "server": server_turn,
                    "ephemeral": lambda: kv_turn(eph, token),
                    "persistent": lambda: kv_turn(per, token),
                },
            )
            print("peer: turns done", file=sys.stderr)
            loads = client.info().swap_ins
            out["restore"] = rounds(
                args.repeat,
                {
                    "server": server_restore,
                    "ephemeral": lambda: kv_alternating(eph),
                    "persistent": lambda: kv_alternating(per),
                },
            )
            loads = client.info().swap_ins - loads
            if loads < 2 * (args.repeat + 1):
                raise SystemExit(f"{2 * (args.repeat + 1)} restores loaded only {loads} states")
            print("peer: restores done", file=sys.stderr)
            # Back to a checkpoint of the session's own, whose cells it holds: cut, not loaded.
            eph_rb = eph.checkpoint("rollback").checkpoint_id
            per_rb = per.checkpoint("rollback").checkpoint_id
            loads = client.info().swap_ins
            out["rollback"] = rounds(
                args.repeat,
                {
                    "server": server_restore,
                    "ephemeral": lambda: kv_restore_turn(eph, eph_rb, token),
                    "persistent": lambda: kv_restore_turn(per, per_rb, token),
                },
            )
            out["rollback_loads"] = client.info().swap_ins - loads
            print("peer: rollbacks done", file=sys.stderr)
            out["cold"] = None
            if not args.no_cold and drop_caches():
                cold: dict[str, list[float]] = {"server": [], "persistent": []}
                for _ in range(max(args.repeat // 3, 3)):
                    drop_caches()
                    cold["server"].append(timed(server_restore)[0])
                    drop_caches()
                    cold["persistent"].append(timed(lambda: kv_restore_turn(per, per_ck, token))[0])
                out["cold"] = cold
                print("peer: cold restores done", file=sys.stderr)
            elif not args.no_cold:
                out["cold_why"] = f"{DROP_CACHES} is not writable here"
            # The restarts below continue the persistent session from its restored checkpoint.
            per.restore(per_ck)
            kv_turn(per, token)
            per_id = per.session_id
        out["restart"] = restarts(args, flags, state, per_id, token, server_restore)
    return out


def restarts(
    args: argparse.Namespace,
    flags: tuple[str, ...],
    state: Path,
    session_id: str,
    token: int,
    server_restore: Callable[[], None],
) -> dict[str, list[float]]:
    """The first one-token turn of a persistent session after each restart (page cache warm,
    and cold where permitted), each next to a llama-server slot restore + turn."""
    times: dict[str, list[float]] = {"server": [], "first": [], "server_cold": [], "first_cold": []}
    for i in range(args.restarts):
        cold = not args.no_cold and i % 2 == 1 and drop_caches()
        with daemon(*flags, state=state) as (address, _), kvkeep.Client(address, timeout=600) as client:
            if cold:
                drop_caches()
            started = time.perf_counter()
            kv_turn(client.session(session_id), token)
            times["first_cold" if cold else "first"].append(time.perf_counter() - started)
            if cold:
                drop_caches()
            times["server_cold" if cold else "server"].append(timed(server_restore)[0])
        print(f"peer: restart {i + 1} done", file=sys.stderr)
    return times


def streaming(args: argparse.Namespace) -> dict[str, float]:
    """Tokens/s of one streamed greedy session, kvkeep and llama-cpp-python in turn within
    each round (both loaded throughout, so a noisy stretch falls on both); the ratio is the
    median of the rounds' own."""
    n = args.stream_tokens
    prompt = STORY * 4
    kv, direct = [], []
    flags = ("--slots", "1", "--threads", str(args.threads))
    llm = llama(2048, args.threads)
    with daemon(*flags) as (address, _), kvkeep.Client(address) as client:
        for _ in range(args.stream_rounds):
            s = client.create_session(sampling=GREEDY)
            s.complete(prompt, max_tokens=1)  # prefill outside the timing
            started = time.perf_counter()
            got = sum(len(c.token_ids) for c in s.generate("", max_tokens=n))
            kv.append(got / (time.perf_counter() - started))
            s.close()
            llm.reset()
            llm.create_completion(prompt, max_tokens=1, temperature=0.0)
            started = time.perf_counter()
            got = sum(1 for _ in llm.create_completion(prompt, max_tokens=n, temperature=0.0, stream=True))
            direct.append(got / (time.perf_counter() - started))
    del llm
    rates = {"kvkeep": [round(x, 1) for x in kv], "llama-cpp-python": [round(x, 1) for x in direct]}
    print(f"peer: streaming done, tok/s of each round: {rates}", file=sys.stderr)
    return {
        "kvkeep": statistics.median(kv),
        "direct": statistics.median(direct),
        "ratio": statistics.median(a / b for a, b in zip(kv, direct, strict=True)),
    }


def concurrency(args: argparse.Namespace, binary: Path, work: Path) -> dict[str, dict[int, list[float]]]:
    """Aggregate tokens/s of N concurrent sessions, each a short prompt then greedy tokens:
    per count, one figure a round. Both servers stay up throughout (idle while the other
    is measured), so each round measures every count on both within seconds."""
    counts, n = (1, 4, 8), args.concurrent_tokens
    rates: dict[str, dict[int, list[float]]] = {
        "kvkeep": {c: [] for c in counts},
        "server": {c: [] for c in counts},
    }
    prompts = [f"({i}) {STORY}" for i in range(max(counts))]

    def together(count: int, work_of: Callable[[int], int]) -> float:
        got = [0] * count

        def one(i: int) -> None:
            got[i] = work_of(i)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(got) / (time.perf_counter() - started)

    def kv_round(client: kvkeep.Client, count: int) -> float:
        sessions = [client.create_session(sampling=GREEDY) for _ in range(count)]
        try:
            for s, p in zip(sessions, prompts, strict=False):  # prefill outside the timing
                s.complete(p, max_tokens=1)
            return together(
                count, lambda i: sum(len(c.token_ids) for c in sessions[i].generate("", max_tokens=n))
            )
        finally:
            for s in sessions:
                s.close()

    def server_round(server: LlamaServer, conns: list[http.client.HTTPConnection], count: int) -> float:
        for i in range(count):  # prefill outside the timing, as above
            server.complete(ids[i], 1, i, conns[i])
        return together(count, lambda i: len(server.complete(ids[i], n, i, conns[i])))

    flags = ("--slots", "8", "--ctx-per-session", "512", "--threads", str(args.threads))
    small = argparse.Namespace(**{**vars(args), "ctx": 512})
    with (
        daemon(*flags) as (address, _),
        kvkeep.Client(address) as client,
        llama_server(binary, small, max(counts), work) as server,
    ):
        conns = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=600) for _ in prompts]
        ids = [server.tokenize(p) for p in prompts]
        for _ in range(args.concurrent_rounds):
            for count in counts:
                rates["kvkeep"][count].append(kv_round(client, count))
            for count in counts:
                rates["server"][count].append(server_round(server, conns, count))
            figures = {k: [round(r[c][-1], 1) for c in counts] for k, r in rates.items()}
            print(f"peer: concurrency round, tok/s of {counts} sessions: {figures}", file=sys.stderr)
    print("peer: concurrency done", file=sys.stderr)
    return rates


def print_tables(
    args: argparse.Namespace,
    latency: dict[str, Any],
    stream: dict[str, float],
    together: dict[str, dict[int, list[float]]],
) -> None:
    turn, restore, restart = latency["turn"], latency["restore"], latency["restart"]
    t_server, r_server = median_ms(turn["server"]), median_ms(restore["server"])
    rows = [
        (
            f"measure (median; {args.tokens}-token session, {args.threads} threads, -fa {args.flash_attn})",
            "llama-server",
            "kvkeep ephemeral",
            "kvkeep persistent",
        ),
        (
            f"one-token turn on a hot session ({args.repeat} rounds)",
            f"{t_server:.1f} ms",
            ratio(median_ms(turn["ephemeral"]), t_server),
            ratio(median_ms(turn["persistent"]), t_server),
        ),
        (
            "restore + one-token turn (llama-server: slot file, page cache; kvkeep: RAM / disk)",
            f"{r_server:.1f} ms",
            ratio(median_ms(restore["ephemeral"]), r_server),
            ratio(median_ms(restore["persistent"]), r_server),
        ),
        (
            f"rollback to the session's own checkpoint + one-token turn ({latency['rollback_loads']} loads)",
            f"{median_ms(latency['rollback']['server']):.1f} ms",
            ratio(median_ms(latency["rollback"]["ephemeral"]), median_ms(latency["rollback"]["server"])),
            ratio(median_ms(latency["rollback"]["persistent"]), median_ms(latency["rollback"]["server"])),
        ),
    ]
    if restart["first"]:
        base = median_ms(restart["server"])
        rows.append(
            (
                f"first turn after a daemon restart ({len(restart['first'])} restarts) vs slot restore",
                f"{base:.1f} ms",
                "",
                ratio(median_ms(restart["first"]), base)
                + f"; {median_ms(restart['first']) / median_ms(restore['persistent']):.2f}x a disk restore",
            )
        )
    cold = latency.get("cold")
    if cold:
        base = median_ms(cold["server"])
        rows.append(
            (
                f"restore + one-token turn, cold page cache ({len(cold['server'])} rounds)",
                f"{base:.1f} ms",
                "",
                ratio(median_ms(cold["persistent"]), base),
            )
        )
    if restart["first_cold"]:
        base = median_ms(restart["server_cold"])
        rows.append(
            (
                f"first turn after a restart, cold page cache ({len(restart['first_cold'])} restarts)",
                f"{base:.1f} ms",
                "",
                ratio(median_ms(restart["first_cold"]), base),
            )
        )
    table(rows)
    if "cold_why" in latency:
        print(f"\ncold page-cache rows left out: {latency['cold_why']}")
    print()
    table(
        [
            (
                f"one streamed session, {args.stream_tokens} greedy tokens (median of "
                f"{args.stream_rounds} rounds; ratio: of the rounds' own)",
                "tokens/s",
                "ratio",
            ),
            ("llama-cpp-python create_completion", f"{stream['direct']:.1f}", "1.00x"),
            ("kvkeep SDK", f"{stream['kvkeep']:.1f}", f"{stream['ratio']:.2f}x"),
        ]
    )
    print()
    print_concurrency(args, together)


def print_concurrency(args: argparse.Namespace, together: dict[str, dict[int, list[float]]]) -> None:
    kv, sv = together["kvkeep"], together["server"]

    def speedup(rates: dict[int, list[float]], count: int) -> str:
        return f"{statistics.median(r / one for r, one in zip(rates[count], rates[1], strict=True)):.2f}x"

    rounds = len(kv[1])
    rows = [
        (
            f"concurrent sessions ({args.concurrent_tokens} tokens each; median of {rounds} rounds)",
            "kvkeep tok/s",
            "speed-up",
            "llama-server -np 8 tok/s",
            "speed-up",
        )
    ]
    for c in sorted(kv):
        rows.append(
            (
                str(c),
                f"{statistics.median(kv[c]):.1f}",
                speedup(kv, c),
                f"{statistics.median(sv[c]):.1f}",
                speedup(sv, c),
            )
        )
    table(rows)
