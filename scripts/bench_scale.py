"""scripts/bench scale [--peer LLAMA_SERVER] [--shape 1b]: the costs of a session as its context grows.

At each `--lengths` (1k-8k tokens on SmolLM2; with `--shape 1b`, a model of Llama 3.2 1B's
shape with random weights written by scripts/gpu_model.py, 1k-4k), kvkeep and, with `--peer`,
llama-server from the same llama.cpp (same model, threads, slots, context per slot, batch
size, flash attention left at each one's default) are measured in the same run, one length
after the other. Prompts are token ids (random, seeded: no cache holds them), greedy, one
token generated per request.

- re-prefill: a fresh kvkeep session evaluates the length's tokens + 1 token (the baseline);
  llama-server's first evaluation of its own prompt of that length beside it;
- checkpoint, full and after `--grow` (64) new tokens: seconds and bytes written, of an
  ephemeral session (its blocks; its whole state kept in RAM) and of a persistent one;
  llama-server: a slot save to `--slot-save-path`, the whole file each time;
- restore + first token from RAM: kvkeep, a one-token turn on a session parked in RAM (as many
  other sessions as slots took a turn since); llama-server, the same prompt + 1 token after
  another prompt took the slot (its prompt cache, `--cache-ram`, loads it);
- restore + first token from disk: kvkeep, a persistent session's checkpoint restored (read
  from its block files) + a one-token turn; llama-server, a slot restore of its save file +
  1 token; each with the page cache warm and with the files' pages dropped first
  (posix_fadvise DONTNEED on each file: cold without touching the rest of the machine);
- resume after a restart: each length's persistent session's first one-token turn after the
  daemon is stopped (SIGTERM) and started again; llama-server, restarted too, a slot restore
  of its file + 1 token;
- bytes per session: on disk (the persistent checkpoint's blocks; llama-server's file) and
  in RAM (kvkeep_parked_bytes that parking one session adds);
- `--sessions` (32) sessions of that length on `--slots` (4), each prefilled, then one-token
  turns in round robin (`--rounds`), median per turn (kvkeep swaps each in; llama-server
  -np 4 with its prompt cache: the tokens it evaluated per turn say whether it loaded or
  evaluated again);
- the machine's bound: a numpy copy of a buffer of the state's size in RAM, and a plain read
  of a file of that size in the work dir with its pages dropped (and once cached), in GB/s,
  against each restore's own GB/s (the state's bytes over restore + token less a hot turn);
- the kvkeep daemon's peak RSS (VmHWM) against `--ram-cache`.

Prints markdown tables (rows: model x length), with `--out DIR` writes scale.json (every
figure), and with `--charts DIR` draws scale-<model>.png (seconds against context, log-log).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_chain
import gpu_model
import numpy as np
from bench import chart, daemon, table, timed
from bench_agent import free_port
from bench_agent_cli import Server
from bench_peer import LlamaServer

import kvkeep
from kvkeep import SamplingParams
from kvkeepd.config.settings import default_model_path

GREEDY = SamplingParams(temperature=0.0)
TOKEN = 400  # the one-token turns' prompt: an ordinary token in every vocabulary here
LOWEST_ID = 300  # below it: control and byte tokens
MB = 1e6


def add_parser(sub: Any) -> None:
    """The `scale` sub-command's arguments."""
    p = sub.add_parser(
        "scale", help="checkpoints, restores, bytes and RSS by context length (bench_scale.py)"
    )
    p.add_argument("--peer", type=Path, default=None, metavar="LLAMA_SERVER", help="a llama-server binary")
    p.add_argument(
        "--shape", choices=sorted(gpu_model.SHAPES), default=None, help="a generated model's shape"
    )
    p.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2-135M)")
    p.add_argument(
        "--lengths", default=None, help="context lengths, comma-separated (default 1k-8k; 1k-4k with --shape)"
    )
    p.add_argument("--repeat", type=int, default=5, help="timed restores and turns per measure (median)")
    p.add_argument("--grow", type=int, default=64, help="new tokens before the delta checkpoint")
    p.add_argument("--sessions", type=int, default=32, help="sessions of the round robin (0: leave it out)")
    p.add_argument("--rounds", type=int, default=1, help="round-robin rounds timed")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument(
        "--ram-cache", type=int, default=2 << 30, help="kvkeep --ram-cache, llama-server --cache-ram"
    )
    p.add_argument("--work", type=Path, default=None, help="where state dirs, save files and models go")
    p.add_argument("--out", type=Path, default=None, metavar="DIR", help="write scale.json here")


# ---- helpers ----------------------------------------------------------------------------


def ids(n: int, seed: int, vocab: int) -> list[int]:
    """`n` seeded token ids of the ordinary part of the vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(LOWEST_ID, vocab) for _ in range(n)]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def drop_pages(root: Path) -> bool:
    """Write back and drop from the page cache every file under `root` (or `root` itself);
    True where fincore (util-linux) confirms none of their pages stayed, or is missing."""
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for path in files:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    # sqlite's shared-memory index (-shm) is mapped by the daemon: its pages stay, and no
    # restore reads it.
    checked = [p for p in files if not p.name.endswith("-shm")]
    if not checked or shutil.which("fincore") is None:
        return True
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, checked)],
        capture_output=True,
        text=True,
    ).stdout.split()
    return all(v.strip() == "0" for v in out)


def vmhwm(pid: int) -> int:
    """A process's peak resident set, bytes (/proc/PID/status VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def fs_type(path: Path) -> str:
    return subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True
    ).stdout.strip()


def bound(size: int, work: Path, repeat: int) -> dict[str, Any]:
    """GB/s of a plain copy of `size` bytes in RAM, and of a plain read of a file of that size
    with its pages dropped and once cached."""
    src = np.frombuffer(os.urandom(size), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # both buffers faulted in
    copy = median([timed(lambda: np.copyto(dst, src))[0] for _ in range(repeat)])
    path = work / "bound.bin"
    path.write_bytes(src.tobytes())
    buffer = bytearray(size)

    def read() -> None:
        with path.open("rb", buffering=0) as f:
            f.readinto(buffer)

    cold, dropped = [], True
    for _ in range(repeat):
        dropped = drop_pages(path) and dropped
        cold.append(timed(read)[0])
    cached = median([timed(read)[0] for _ in range(repeat)])
    path.unlink()
    return {
        "bytes": size,
        "copy_gbps": size / copy / 1e9,
        "read_gbps": size / median(cold) / 1e9,
        "read_dropped": dropped,
        "cached_read_gbps": size / cached / 1e9,
    }


# ---- kvkeep -----------------------------------------------------------------------------


class Kvkeep:
    """A kvkeep daemon on a state dir that outlives its restarts, its client and its metrics."""

    def __init__(self, flags: list[str], root: Path) -> None:
        self.metrics_port = free_port()
        self.flags = [*flags, "--metrics-address", f"127.0.0.1:{self.metrics_port}"]
        self.root = root
        root.mkdir()
        self.stack = contextlib.ExitStack()
        self.client: kvkeep.Client
        self.state = root / "s"
        self.pid = 0

    def start(self) -> None:
        address, self.state = self.stack.enter_context(daemon(*self.flags, state=self.root))
        self.client = self.stack.enter_context(kvkeep.Client(address, timeout=7200))
        self.pid = int((self.state / "lock").read_text())

    def stop(self) -> None:
        self.stack.close()

    def parked(self) -> float:
        """Bytes of parked states (kvkeep_parked_bytes)."""
        return bench_chain.metrics(f"http://127.0.0.1:{self.metrics_port}/metrics")["parked"]


def turn(s: kvkeep.Session) -> float:
    """Seconds of a one-token turn (one token in, one generated), to its last chunk."""
    started = time.perf_counter()
    for _ in s.generate([TOKEN], max_tokens=1):
        pass
    return time.perf_counter() - started


def grown(s: kvkeep.Session, kind: str, more: list[int]) -> tuple[dict[str, Any], kvkeep.CheckpointInfo]:
    """A full checkpoint of `s`, `more` tokens, a delta checkpoint: their figures (keys
    prefixed by `kind`) and the full checkpoint."""
    full_s, full = timed(lambda: s.checkpoint("full"))
    s.complete(more, max_tokens=1)
    delta_s, delta = timed(lambda: s.checkpoint("delta"))
    figures = {
        f"{kind}_full_s": full_s,
        f"{kind}_full_bytes": full.bytes_written,
        f"{kind}_delta_s": delta_s,
        f"{kind}_delta_bytes": delta.bytes_written,
        f"{kind}_delta_tokens": delta.n_tokens - full.n_tokens,
    }
    return figures, full


def kv_length(kv: Kvkeep, n: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """kvkeep's figures at `n` tokens; leaves the persistent session open (its id in the
    result) for the restart."""
    c, out = kv.client, dict[str, Any]()
    e = c.create_session(sampling=GREEDY)
    out["prefill_s"], done = timed(lambda: e.complete(ids(n, n, vocab), max_tokens=1))
    out["evaluated"] = done.usage.evaluated_tokens
    out["hot_s"] = median([turn(e) for _ in range(args.repeat)])
    # From RAM: as many other sessions as slots take a turn, which parks `e`, then its turn.
    others = [c.create_session(sampling=GREEDY) for _ in range(args.slots)]
    for i, o in enumerate(others):
        o.complete(ids(8, 7 * n + i, vocab), max_tokens=1)
    ram, ram_bytes, where = [], [], []
    for i in range(args.repeat + 1):
        before = kv.parked()
        for o in others:
            turn(o)
        ram_bytes.append(kv.parked() - before)
        where.append(e.info().residency)
        took = turn(e)
        if i:  # the first: a warm-up
            ram.append(took)
    out |= {"ram_s": median(ram), "ram_bytes": median(ram_bytes[1:]), "ram_from": sorted(set(where))}
    out["ram_tokens"] = e.info().n_tokens

    figures, _ = grown(e, "e", ids(args.grow, n + 101, vocab))
    out |= figures
    p = c.create_session(sampling=GREEDY, persistent=True)
    p.complete(ids(n, n + 2, vocab), max_tokens=1)
    figures, full = grown(p, "p", ids(args.grow, n + 102, vocab))
    out |= figures
    out["disk_bytes"] = full.bytes_referenced
    print(f"scale: kvkeep {n}: prefill, RAM and checkpoints done", file=sys.stderr)

    # From disk: the persistent session's first checkpoint, read from its blocks into
    # another persistent session (restored into `p`, whose cells it is, it would be a cut).
    q = c.create_session(sampling=GREEDY, persistent=True)

    def restore_turn() -> None:
        q.restore(full.checkpoint_id)
        turn(q)

    restore_turn()  # a warm-up
    loads = c.info().swap_ins
    out["disk_s"] = median([timed(restore_turn)[0] for _ in range(args.repeat)])
    cold, dropped = [], True
    for _ in range(args.repeat):
        dropped = drop_pages(kv.state) and dropped
        cold.append(timed(restore_turn)[0])
    out |= {"disk_cold_s": median(cold), "disk_dropped": dropped, "disk_loads": c.info().swap_ins - loads}
    out["persistent_id"] = p.session_id
    for s in (e, q, *others):
        s.close()
    print(f"scale: kvkeep {n}: restores done", file=sys.stderr)
    return out


def kv_sessions(kv: Kvkeep, n: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """`--sessions` ephemeral sessions of `n` tokens, one-token turns in round robin."""
    c = kv.client
    sessions = [c.create_session(sampling=GREEDY) for _ in range(args.sessions)]
    for i, s in enumerate(sessions):
        s.complete(ids(n, 100_000 + 1000 * n + i, vocab), max_tokens=1)
    loads = c.info().swap_ins
    turns = [turn(s) for _ in range(args.rounds) for s in sessions]
    info = c.info()
    parked = kv.parked()
    for s in sessions:
        s.close()
    return {
        "turn_s": median(turns),
        "turn_p95_s": sorted(turns)[round(0.95 * (len(turns) - 1))],
        "swap_ins": info.swap_ins - loads,
        "warm": info.sessions_warm,
        "cold": info.sessions_cold,
        "parked_bytes": parked,
    }


# ---- llama-server -----------------------------------------------------------------------


class Peer:
    """llama-server on `--slots` slots of the same context, with a save path and a prompt
    cache of `--ram-cache`; one connection of a long timeout."""

    def __init__(self, binary: Path, model: Path, args: argparse.Namespace, ctx: int, work: Path) -> None:
        self.saves = work / "slots"
        self.saves.mkdir()
        slots, threads = str(args.slots), str(args.threads)

        def cmd(port: int) -> list[str]:
            return [
                *(str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
                *("-t", threads, "-tb", threads, "-np", slots, "-c", str(ctx * args.slots)),
                *("-b", str(args.batch_size), "-ub", str(args.batch_size), "--no-kv-unified"),
                *("--slot-save-path", str(self.saves), "--cache-ram", str(args.ram_cache >> 20)),
                "--no-webui",
            ]

        self.server = Server("llama-server", cmd, work)
        self.api: LlamaServer
        self.conn: http.client.HTTPConnection

    def start(self) -> None:
        self.server.start()
        assert self.server.proc is not None
        self.api = LlamaServer(self.server.port, self.server.proc)
        self.conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=7200)

    def stop(self) -> None:
        self.conn.close()
        self.server.stop()

    def restart(self) -> None:
        self.stop()
        self.start()

    def complete(self, tokens: list[int], slot: int = 0) -> tuple[float, list[int], int]:
        """Seconds, the generated ids and the prompt tokens evaluated, of one completion."""
        body = {
            "prompt": tokens,
            "n_predict": 1,
            "cache_prompt": True,
            "id_slot": slot,
            "temperature": 0.0,
            "return_tokens": True,
            "ignore_eos": True,
        }
        took, out = timed(lambda: self.api.post("/completion", body, self.conn))
        return took, list(out["tokens"]), int(out["timings"]["prompt_n"])

    def slot(self, action: str, filename: str) -> float:
        return timed(lambda: self.api.post(f"/slots/0?action={action}", {"filename": filename}, self.conn))[0]


def peer_length(peer: Peer, n: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """llama-server's figures at `n` tokens (slot 0); its save file stays for the restart."""
    out: dict[str, Any] = {}
    history = ids(n, n + 3, vocab)
    out["prefill_s"], generated, out["evaluated"] = peer.complete(history)
    history += generated
    hot = []
    for _ in range(args.repeat):
        took, generated, _ = peer.complete([*history, TOKEN])
        history += [TOKEN, *generated]
        hot.append(took)
    out["hot_s"] = median(hot)
    saved, name = list(history), f"scale-{n}.bin"
    out["full_s"] = peer.slot("save", name)
    out["full_bytes"] = (peer.saves / name).stat().st_size
    history += ids(args.grow, n + 103, vocab)
    _, generated, _ = peer.complete(history)
    history += generated
    out["delta_s"] = peer.slot("save", f"scale-{n}-grown.bin")
    out["delta_bytes"] = (peer.saves / f"scale-{n}-grown.bin").stat().st_size

    # From RAM: another prompt takes the slot, then this one comes back from the prompt cache.
    ram, evaluated = [], []
    for i in range(args.repeat + 1):
        peer.complete(ids(32, 9 * n + i, vocab))
        took, generated, prompt_n = peer.complete([*history, TOKEN])
        history += [TOKEN, *generated]
        if i:
            ram.append(took)
            evaluated.append(prompt_n)
    out |= {"ram_s": median(ram), "ram_evaluated": median([float(e) for e in evaluated])}

    # From disk: the first save restored, + 1 token.
    def restore_turn() -> None:
        peer.slot("restore", name)
        peer.complete([*saved, TOKEN])

    restore_turn()
    out["disk_s"] = median([timed(restore_turn)[0] for _ in range(args.repeat)])
    cold, dropped = [], True
    for _ in range(args.repeat):
        dropped = drop_pages(peer.saves / name) and dropped
        cold.append(timed(restore_turn)[0])
    out |= {"disk_cold_s": median(cold), "disk_dropped": dropped, "saved": saved}
    print(f"scale: llama-server {n}: done", file=sys.stderr)
    return out


def peer_sessions(peer: Peer, n: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The same round robin on llama-server: any slot, its prompt cache behind them."""
    histories = [ids(n, 100_000 + 1000 * n + i, vocab) for i in range(args.sessions)]
    for h in histories:
        h += peer.complete(h, -1)[1]
    turns, evaluated = [], []
    for _ in range(args.rounds):
        for h in histories:
            took, generated, prompt_n = peer.complete([*h, TOKEN], -1)
            h += [TOKEN, *generated]
            turns.append(took)
            evaluated.append(float(prompt_n))
    return {"turn_s": median(turns), "evaluated": median(evaluated)}


# ---- the run ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    if args.peer is not None and not os.access(args.peer, os.X_OK):
        raise SystemExit(f"not an executable: {args.peer}")
    # 8,000, not 8,192: a slot holds the length, the grown tokens and the turns after it, and
    # llama-server gives a slot no more than the model's own context (SmolLM2's is 8,192).
    default = "1024,2048,4096" if args.shape else "1024,2048,4096,8000"
    lengths = [int(x) for x in (args.lengths or default).split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvkeep-scale-", dir=args.work))
    try:
        if args.model is not None:
            model = args.model
        elif args.shape is not None:
            print(f"scale: writing a random {args.shape} model", file=sys.stderr)
            model = gpu_model.write(work / f"random-{args.shape}.gguf", args.shape)
        else:
            model = default_model_path()
        figures = measure(args, model, lengths, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, figures)


def measure(args: argparse.Namespace, model: Path, lengths: list[int], work: Path) -> dict[str, Any]:
    ctx = -(-(max(lengths) + args.grow + 4 * args.repeat + 64) // 256) * 256
    flags = ["--model", str(model), "--slots", str(args.slots), "--ctx-per-session", str(ctx)]
    flags += ["--threads", str(args.threads), "--batch-size", str(args.batch_size)]
    flags += ["--ram-cache", str(args.ram_cache)]
    kv = Kvkeep(flags, work / "kvkeep")
    peer = Peer(args.peer.resolve(), model, args, ctx, work) if args.peer else None
    name = f"random {args.shape}" if args.shape and args.model is None else model.name
    result: dict[str, Any] = {
        "model": name,
        "model_bytes": model.stat().st_size,
        "threads": args.threads,
        "slots": args.slots,
        "ctx_per_session": ctx,
        "ram_cache": args.ram_cache,
        "sessions": args.sessions,
        "work_fs": fs_type(work),
        "lengths": {},
    }
    rows: dict[int, dict[str, Any]] = {n: {} for n in lengths}
    with contextlib.ExitStack() as stack:
        kv.start()
        stack.callback(kv.stop)
        if peer is not None:
            peer.start()
            stack.callback(peer.stop)
        vocab = kv.client.info().n_vocab
        for n in lengths:
            rows[n]["kvkeep"] = kv_length(kv, n, args, vocab)
            if peer is not None:
                rows[n]["llama-server"] = peer_length(peer, n, args, vocab)
            rows[n]["kvkeep"]["vmhwm"] = vmhwm(kv.pid)
            rows[n]["bound"] = bound(rows[n]["kvkeep"]["disk_bytes"], work, args.repeat)
        hwm = vmhwm(kv.pid)
        kv.stop()
        kv.start()
        for n in lengths:
            s = kv.client.session(rows[n]["kvkeep"]["persistent_id"])
            rows[n]["kvkeep"]["restart_s"] = turn(s)
            s.close()
        if peer is not None:
            peer.restart()
            for n in lengths:
                mine = rows[n]["llama-server"]
                took = peer.slot("restore", f"scale-{n}.bin")
                mine["restart_s"] = took + peer.complete([*mine.pop("saved"), TOKEN])[0]
        print("scale: restarts done", file=sys.stderr)
        for n in lengths:
            if args.sessions:
                rows[n]["kvkeep"]["sessions"] = kv_sessions(kv, n, args, vocab)
                if peer is not None:
                    rows[n]["llama-server"]["sessions"] = peer_sessions(peer, n, args, vocab)
                print(f"scale: {args.sessions} sessions of {n} done", file=sys.stderr)
            rows[n]["kvkeep"]["vmhwm_sessions"] = vmhwm(kv.pid)
        result["peak_rss"] = max(hwm, vmhwm(kv.pid))
    result["lengths"] = rows
    return result


# ---- the report -------------------------------------------------------------------------


def secs(x: float) -> str:
    """Seconds as ms below 10 s."""
    return f"{x:,.1f} s" if x >= 10 else f"{x * 1e3:,.1f} ms"


def vs(mine: float, theirs: float | None) -> str:
    return f" ({mine / theirs:.2f}x)" if theirs else ""


def gbps(size: float, took: float, hot: float) -> str:
    """GB/s of a restore: the state's bytes over restore + token less a hot one-token turn
    ("-" where the difference is within the noise)."""
    return f"{size / (took - hot) / 1e9:.2f}" if took > hot else "-"


def report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    name, rows = result["model"], result["lengths"]
    peers = {n: r.get("llama-server") for n, r in rows.items()}
    print(
        f"\n{name}, {result['threads']} threads, {result['slots']} slots of {result['ctx_per_session']}"
        f" tokens, --ram-cache {result['ram_cache'] / 2**30:.2f} GiB, work dir on {result['work_fs']};"
        " ratios: kvkeep / llama-server\n"
    )
    first: list[tuple[str, ...]] = [
        (
            "model",
            "tokens",
            "re-prefill + 1 token (llama-server's)",
            "checkpoint, ephemeral: full / +64 tokens",
            "checkpoint, persistent (blocks autosaved): full / +64 tokens",
            "llama-server slot save: full / +64 tokens",
            "per session: disk / RAM (llama-server file)",
        )
    ]
    for n, r in rows.items():
        k, p = r["kvkeep"], peers[n]
        first.append(
            (
                name,
                f"{n:,}",
                secs(k["prefill_s"]) + (f" ({secs(p['prefill_s'])})" if p else ""),
                f"{secs(k['e_full_s'])}, {k['e_full_bytes'] / MB:.1f} MB / "
                f"{secs(k['e_delta_s'])}, {k['e_delta_bytes'] / MB:.2f} MB",
                f"{secs(k['p_full_s'])}, {k['p_full_bytes'] / MB:.1f} MB / "
                f"{secs(k['p_delta_s'])}, {k['p_delta_bytes'] / MB:.2f} MB",
                f"{secs(p['full_s'])}, {p['full_bytes'] / MB:.1f} MB / {secs(p['delta_s'])}, "
                f"{p['delta_bytes'] / MB:.1f} MB"
                if p
                else "",
                f"{k['disk_bytes'] / MB:.1f} / {k['ram_bytes'] / MB:.1f} MB"
                + (f" ({p['full_bytes'] / MB:.1f} MB)" if p else ""),
            )
        )
    table(first)
    print()
    second: list[tuple[str, ...]] = [
        (
            "model",
            "tokens",
            "hot one-token turn",
            "from RAM (llama-server: prompt cache)",
            "from disk, page cache (slot restore)",
            "from disk, pages dropped (slot restore)",
            "after a restart (slot restore)",
            "vs re-prefill: RAM / disk",
            "GB/s: RAM / disk dropped (llama-server) / bound copy / read",
        )
    ]
    for n, r in rows.items():
        k, p, b = r["kvkeep"], peers[n], r["bound"]
        size = k["disk_bytes"]
        read = f"{b['read_gbps']:.2f}" + ("" if b["read_dropped"] else " (cached)")
        second.append(
            (
                name,
                f"{n:,}",
                secs(k["hot_s"]) + (f" ({secs(p['hot_s'])})" if p else ""),
                secs(k["ram_s"])
                + (
                    f" ({secs(p['ram_s'])}, {p['ram_evaluated']:.0f} evaluated){vs(k['ram_s'], p['ram_s'])}"
                    if p
                    else ""
                ),
                secs(k["disk_s"]) + (f" ({secs(p['disk_s'])}){vs(k['disk_s'], p['disk_s'])}" if p else ""),
                secs(k["disk_cold_s"])
                + (f" ({secs(p['disk_cold_s'])}){vs(k['disk_cold_s'], p['disk_cold_s'])}" if p else "")
                + ("" if k["disk_dropped"] else " (cached)"),
                secs(k["restart_s"])
                + (f" ({secs(p['restart_s'])}){vs(k['restart_s'], p['restart_s'])}" if p else ""),
                f"{k['prefill_s'] / k['ram_s']:.0f}x / {k['prefill_s'] / k['disk_s']:.0f}x",
                f"{gbps(k['ram_bytes'], k['ram_s'], k['hot_s'])} / {gbps(size, k['disk_cold_s'], k['hot_s'])}"
                + (f" ({gbps(p['full_bytes'], p['disk_cold_s'], p['hot_s'])})" if p else "")
                + f" / {b['copy_gbps']:.2f} / {read}",
            )
        )
    table(second)
    for n, r in rows.items():
        k = r["kvkeep"]
        if k["ram_from"] != ["warm"]:
            print(f"note: at {n:,} the parked session was {', '.join(k['ram_from'])}, not only in RAM")
        if k["disk_loads"] < 2 * args.repeat:
            print(f"note: at {n:,} {2 * args.repeat} restores from disk loaded {k['disk_loads']} states")
    print()
    third: list[tuple[str, ...]] = [
        (
            "model",
            "tokens",
            f"{result['sessions']} sessions on {result['slots']} slots: turn median (llama-server)",
            "turn p95",
            "kvkeep swap-ins; parked: warm / cold",
            "llama-server tokens evaluated per turn",
            "peak RSS (VmHWM) / --ram-cache",
        )
    ]
    for n, r in rows.items():
        k, p = r["kvkeep"], peers[n]
        many, theirs = k.get("sessions"), (p or {}).get("sessions")
        third.append(
            (
                name,
                f"{n:,}",
                (
                    secs(many["turn_s"])
                    + (f" ({secs(theirs['turn_s'])}){vs(many['turn_s'], theirs['turn_s'])}" if theirs else "")
                )
                if many
                else "",
                secs(many["turn_p95_s"]) if many else "",
                f"{many['swap_ins']}; {many['warm']} / {many['cold']}" if many else "",
                f"{theirs['evaluated']:.0f}" if theirs else "",
                f"{k['vmhwm'] / 2**30:.2f} GiB / {result['ram_cache'] / 2**30:.2f} GiB",
            )
        )
    table(third)
    print(
        f"\npeak RSS of the daemon over the run: {result['peak_rss'] / 2**30:.2f} GiB (the model"
        f" file: {result['model_bytes'] / 2**30:.2f} GiB, mapped; --ram-cache"
        f" {result['ram_cache'] / 2**30:.2f} GiB)"
    )
    slug = name.replace(" ", "-")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"scale-{slug}.json"
        path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"figures: {path}", file=sys.stderr)
    chart(args, f"scale-{slug}.png", lambda ax: draw(ax, result))


def draw(ax: Any, result: dict[str, Any]) -> None:
    """Seconds against context length, log-log: kvkeep's checkpoints and restores, re-prefill,
    llama-server's slot save and restore."""
    rows = result["lengths"]
    lengths = sorted(rows)

    def line(label: str, value: Callable[[dict[str, Any]], float | None], style: str) -> None:
        points = [(n, value(rows[n])) for n in lengths]
        shown = [(n, v) for n, v in points if v is not None]
        if shown:
            ax.plot([n for n, _ in shown], [v for _, v in shown], style, label=label)

    def peer(key: str) -> Callable[[dict[str, Any]], float | None]:
        return lambda r: r["llama-server"][key] if "llama-server" in r else None

    line("re-prefill + 1 token", lambda r: r["kvkeep"]["prefill_s"], "o-")
    line("kvkeep checkpoint, full (ephemeral)", lambda r: r["kvkeep"]["e_full_s"], "s-")
    line("kvkeep checkpoint, +64 tokens (ephemeral)", lambda r: r["kvkeep"]["e_delta_s"], "s--")
    line("kvkeep restore + 1 token, RAM", lambda r: r["kvkeep"]["ram_s"], "^-")
    line("kvkeep restore + 1 token, disk (pages dropped)", lambda r: r["kvkeep"]["disk_cold_s"], "v-")
    line("llama-server slot save", peer("full_s"), "s:")
    line("llama-server slot restore + 1 token (pages dropped)", peer("disk_cold_s"), "v:")
    line("llama-server prompt cache + 1 token", peer("ram_s"), "^:")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("seconds (log scale)")
    ax.set_title(f"Costs by context length, {result['model']}")
    ax.legend(fontsize=7)
