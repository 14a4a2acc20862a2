"""kvkeep load generator: N clients send M requests in all, a weighted mix of Chat, Generate,
Checkpoint, Restore, Fork, Rewind, Close, Export and Import, through the SDK's AsyncClient on
one event loop; then throughput, p50/p99 latency per operation and errors by gRPC status.

    scripts/load                                  a daemon of its own (flags after --)
    scripts/load --address 127.0.0.1:50051        a running daemon
    scripts/load --clients 16 --requests 5000 --weights chat=4,generate=4,import=0

It stops by itself: after --requests requests or --duration seconds, whichever comes first,
and each request is given up after --timeout seconds (counted as DEADLINE_EXCEEDED). Each
client owns its sessions (at most --sessions-per-client; a fork beyond that closes one
instead), so that no request races another client's: every error is the daemon's. Sessions
are rewound before their context fills. Requests without what they need (a restore with no
checkpoint yet) take the checkpoint first, and say so in the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kvkeep
from kvkeep import SamplingParams

OPERATIONS = ("chat", "generate", "checkpoint", "restore", "fork", "rewind", "close", "export", "import")
DEFAULT_WEIGHTS = "chat=3,generate=3,checkpoint=2,restore=2,fork=1,rewind=1,close=1,export=1,import=1"
MESSAGES = ("Tell me about tides.", "And then?", "Name a colour.", "Why?", "Count to three.")
PROMPTS = (" Then", " The keeper said", " Far away,", " Meanwhile")
#: Kept per client at most; older imports are deleted (a "delete" outside the mix).
IMPORTS_KEPT = 4
CHECKPOINTS_KEPT = 8


@dataclass
class Owned:
    """A session of one client, its length and its checkpoints (id, n_tokens)."""

    session: kvkeep.AsyncSession
    n_tokens: int = 0
    checkpoints: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class Stats:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: Counter[str] = field(default_factory=Counter)
    errors_by_op: Counter[str] = field(default_factory=Counter)
    samples: list[str] = field(default_factory=list)


class Worker:
    """One client: its connection, its sessions, imports and last export."""

    def __init__(self, i: int, args: argparse.Namespace, stats: Stats, n_ctx: int, tmp: Path) -> None:
        self.i = i
        self.args = args
        self.stats = stats
        self.rng = random.Random(args.seed * 1000 + i)
        self.client = kvkeep.AsyncClient(args.address, token=args.token)
        self.sessions: list[Owned] = []
        self.imports: list[tuple[str, int]] = []
        self.export: tuple[Path, int] | None = None
        self.export_path = tmp / f"client{i}.kvs"
        # Room for a chat turn (template, message, reply) before the context is full.
        self.max_tokens_held = n_ctx - 4 * args.max_tokens - 64

    async def timed(self, op: str, coro: Any) -> Any:
        """Await one request, recording its latency (or its error)."""
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(coro, self.args.timeout)
        except kvkeep.KvkeepError as e:
            self._error(op, e.code, e.message)
            return None
        except TimeoutError:
            self._error(op, "DEADLINE_EXCEEDED", f"no answer in {self.args.timeout} s")
            return None
        self.stats.latencies[op].append(time.perf_counter() - started)
        return result

    def _error(self, op: str, code: str, message: str) -> None:
        self.stats.errors[code] += 1
        self.stats.errors_by_op[f"{op}:{code}"] += 1
        if len(self.stats.samples) < 20:
            self.stats.samples.append(f"{op}: {code} {message}")

    async def create(self) -> Owned | None:
        sampling = SamplingParams(temperature=0.8, seed=self.rng.randrange(1 << 30))
        persistent = self.rng.random() < self.args.persistent
        session = await self.timed(
            "create", self.client.create_session(sampling=sampling, persistent=persistent)
        )
        if session is None:
            return None
        owned = Owned(session)
        self.sessions.append(owned)
        return owned

    async def one(self, op: str) -> None:
        """One request of the mix, or what it needs first when that is missing."""
        if not self.sessions and await self.create() is None:
            return
        s = self.rng.choice(self.sessions)
        if (
            op in ("restore", "export", "fork")
            and not s.checkpoints
            and not (op == "restore" and self.imports)
        ):
            op = "checkpoint"
        if op == "import" and self.export is None:
            op = "export" if s.checkpoints else "checkpoint"
        if op == "fork" and len(self.sessions) >= self.args.sessions_per_client:
            op = "close"
        if op in ("chat", "generate") and s.n_tokens > self.max_tokens_held:
            op = "rewind"
        await getattr(self, f"op_{op}")(s)

    async def op_chat(self, s: Owned) -> None:
        reply = await self.timed(
            "chat",
            s.session.chat(self.rng.choice(MESSAGES), max_tokens=self.rng.randint(1, self.args.max_tokens)),
        )
        if reply is not None:
            await self.refresh(s)

    async def op_generate(self, s: Owned) -> None:
        prompt = self.rng.choice(PROMPTS) if s.n_tokens == 0 or self.rng.random() < 0.5 else ""
        reply = await self.timed(
            "generate", s.session.complete(prompt, max_tokens=self.rng.randint(1, self.args.max_tokens))
        )
        if reply is not None:
            await self.refresh(s)

    async def refresh(self, s: Owned) -> None:
        info = await self.timed("info", s.session.info())
        if info is not None:
            s.n_tokens = info.n_tokens

    async def op_checkpoint(self, s: Owned) -> None:
        ck = await self.timed("checkpoint", s.session.checkpoint())
        if ck is not None:
            s.checkpoints = [*s.checkpoints, (ck.checkpoint_id, ck.n_tokens)][-CHECKPOINTS_KEPT:]

    async def op_restore(self, s: Owned) -> None:
        checkpoint_id, _ = self.rng.choice(s.checkpoints + self.imports)
        info = await self.timed("restore", s.session.restore(checkpoint_id))
        if info is not None:
            s.n_tokens = info.n_tokens

    async def op_fork(self, s: Owned) -> None:
        persistent = self.rng.random() < self.args.persistent
        if self.rng.random() < 0.5:
            checkpoint_id, n = self.rng.choice(s.checkpoints)
            child = await self.timed("fork", s.session.fork(checkpoint_id, persistent=persistent))
        else:
            n = s.n_tokens
            child = await self.timed("fork", s.session.fork(persistent=persistent))
        if child is not None:
            self.sessions.append(Owned(child, n))

    async def op_rewind(self, s: Owned) -> None:
        low = s.n_tokens // 2 if s.n_tokens > self.max_tokens_held else max(0, s.n_tokens - 32)
        info = await self.timed("rewind", s.session.rewind(self.rng.randint(low, s.n_tokens)))
        if info is not None:
            s.n_tokens = info.n_tokens

    async def op_close(self, s: Owned) -> None:
        await self.timed("close", s.session.close())
        self.sessions.remove(s)  # closed, or an error that the report counts
        if not self.sessions:
            await self.create()

    async def op_export(self, s: Owned) -> None:
        checkpoint_id, n = self.rng.choice(s.checkpoints)
        written = await self.timed("export", self.client.export_checkpoint(checkpoint_id, self.export_path))
        if written is not None:
            self.export = (self.export_path, n)

    async def op_import(self, s: Owned) -> None:
        assert self.export is not None
        ck = await self.timed("import", self.client.import_checkpoint(self.export[0]))
        if ck is None:
            return
        self.imports.append((ck.checkpoint_id, ck.n_tokens))
        while len(self.imports) > IMPORTS_KEPT:
            old, _ = self.imports.pop(0)
            await self.timed("delete", self.client.delete_checkpoint(old))

    async def finish(self, keep: bool) -> list[str]:
        """Close this client's sessions and delete its imports (unless ``keep``): the ids left."""
        if not keep:
            for s in self.sessions:
                await self.timed("final close", s.session.close())
            for checkpoint_id, _ in self.imports:
                await self.timed("final delete", self.client.delete_checkpoint(checkpoint_id))
        left = [] if not keep else [s.session.session_id for s in self.sessions]
        await self.client.close()
        return left


def parse_weights(text: str) -> dict[str, float]:
    weights = dict.fromkeys(OPERATIONS, 0.0)
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in weights:
            raise SystemExit(f"unknown operation {name!r} in --weights (known: {', '.join(OPERATIONS)})")
        weights[name] = float(value)
    if not any(weights.values()):
        raise SystemExit("--weights gives every operation weight 0")
    return weights


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    weights = parse_weights(args.weights)
    names, cum = list(weights), list(weights.values())
    stats = Stats()
    async with kvkeep.AsyncClient(args.address, token=args.token, timeout=args.timeout) as probe:
        n_ctx = (await probe.info()).ctx_per_session
    issued = 0
    deadline = time.monotonic() + args.duration
    with tempfile.TemporaryDirectory(prefix="kvkeep-load-") as tmp:
        workers = [Worker(i, args, stats, n_ctx, Path(tmp)) for i in range(args.clients)]

        async def drive(w: Worker) -> None:
            nonlocal issued
            while issued < args.requests and time.monotonic() < deadline:
                issued += 1  # one event loop: no lock needed
                await w.one(w.rng.choices(names, cum)[0])

        started = time.perf_counter()
        await asyncio.gather(*(drive(w) for w in workers))
        seconds = time.perf_counter() - started
        left = [sid for w in workers for sid in await w.finish(args.keep_sessions)]
    done = sum(len(v) for k, v in stats.latencies.items() if k in OPERATIONS)
    failed = sum(n for k, n in stats.errors_by_op.items() if k.split(":")[0] in OPERATIONS)
    return {
        "clients": args.clients,
        "requests": issued,
        "completed": done,
        "failed": failed,
        "seconds": seconds,
        "throughput": done / seconds if seconds else 0.0,
        "ops": {
            op: {
                "n": len(v),
                "p50_ms": 1000 * percentile(v, 0.50),
                "p99_ms": 1000 * percentile(v, 0.99),
                "errors": sum(n for k, n in stats.errors_by_op.items() if k.startswith(f"{op}:")),
            }
            for op, v in sorted(stats.latencies.items())
        },
        "errors": dict(stats.errors),
        "errors_by_op": dict(stats.errors_by_op),
        "error_samples": stats.samples,
        "sessions": left,
    }


def print_report(report: dict[str, Any]) -> None:
    print(
        f"{report['completed']} of {report['requests']} requests answered in {report['seconds']:.1f} s by "
        f"{report['clients']} clients: {report['throughput']:.1f} requests/s"
    )
    rows = [("operation", "requests", "p50 ms", "p99 ms", "errors")]
    for op, o in report["ops"].items():
        aux = "" if op in OPERATIONS else " (needed by the mix)"
        rows.append((op + aux, str(o["n"]), f"{o['p50_ms']:.1f}", f"{o['p99_ms']:.1f}", str(o["errors"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print("errors by status:", report["errors"] or "none")
    for sample in report["error_samples"]:
        print("  " + sample)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--address", help="a running daemon (default: start one, with the flags after --)")
    parser.add_argument("--token", help="bearer token (a daemon with --auth-file)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--requests", type=int, default=400, help="requests in all (default 400)")
    parser.add_argument(
        "--duration", type=float, default=300, help="stop issuing after S seconds (default 300)"
    )
    parser.add_argument(
        "--timeout", type=float, default=60, help="give a request up after S seconds (default 60)"
    )
    parser.add_argument("--weights", default=DEFAULT_WEIGHTS, help=f"the mix (default {DEFAULT_WEIGHTS})")
    parser.add_argument("--max-tokens", type=int, default=8, help="most tokens per Chat/Generate (default 8)")
    parser.add_argument(
        "--persistent", type=float, default=0.3, help="share of persistent sessions (default 0.3)"
    )
    parser.add_argument(
        "--sessions-per-client", type=int, default=3, help="sessions one client holds (default 3)"
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed of the mix (default 1)")
    parser.add_argument(
        "--keep-sessions", action="store_true", help="leave the sessions open (ids in --json)"
    )
    parser.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    parser.add_argument("daemon_flags", nargs="*", help="flags of the daemon started (after --)")
    args = parser.parse_args()
    if args.clients < 1 or args.requests < 1 or args.sessions_per_client < 1:
        parser.error("--clients, --requests and --sessions-per-client must be at least 1")
    if args.address is None:
        from bench import daemon  # scripts/bench.py: a daemon subprocess on a free port

        with daemon(*(args.daemon_flags or ["--threads", "1"])) as (address, _):
            args.address = address
            report = asyncio.run(run(args))
    else:
        report = asyncio.run(run(args))
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
