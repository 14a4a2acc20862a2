"""A fault run of a cluster: three daemons behind HAProxy (deploy/haproxy.cfg, a third server
line added) on loopback, sharing a Redis catalog (appendfsync always) and an S3 store (weed
mini), with clients driving persistent sessions (chat, fork, checkpoint, restore) through
the proxy while the faults come:

- every --kill-every seconds a daemon (each in turn) is killed with SIGKILL and started
  again --restart-after seconds later;
- once, Redis is paused (SIGSTOP) for --redis-pause seconds;
- once, the store's connections are cut: weed is killed and started again.

Then it reports: acknowledged turns lost (a turn whose reply a client received, missing from
its session afterwards, or a restore a daemon said failed found made: target 0),
continuations compared (a persistent fork and its session given the same message must reply
the same, however the daemons came and went between: all exact), requests failed and why,
the time a session took to continue after its daemon died (median, p95: from the kill, or
from the request if it came later, to the first answer), and the blocks left in the store
that no checkpoint knows once the collector has had its grace period.

    scripts/cluster-chaos                                   the full run: 10 minutes, 100 sessions
    nice scripts/cluster-chaos --duration 180 --sessions 24 a short one

By hand only: it takes the machine for its duration. Everything runs under a temporary
directory, removed at the end (--keep keeps it, with every server's log).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import redis

import kvkeep

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from servers import HaproxyServer, RedisServer, WeedMini, free_port  # noqa: E402

QUESTIONS = (
    "Name a bird.",
    "And a tree?",
    "Why?",
    "Say it in three words.",
    "What colour is the sea?",
    "Count to four.",
    "Another one.",
)
SYSTEM = "You are a terse assistant. Answer in a few words."
PREFIX = "chaos"
GRACE = 30.0  # --orphan-grace of the daemons: a save has this long to commit


@dataclass
class Daemon:
    """One daemon subprocess, started again on its port and state directory."""

    name: str
    state: Path
    port: int
    args: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        ready = self.state.with_suffix(".ready")
        ready.unlink(missing_ok=True)
        self.state.mkdir(mode=0o700, exist_ok=True)
        command = [sys.executable, "-m", "kvkeepd", "--address", self.address, "--state-dir", str(self.state)]
        command += ["--ready-file", str(ready), "--daemon-name", self.name, *self.args]
        with (self.state.parent / f"{self.name}.log").open("ab") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
            )
        deadline = time.monotonic() + 180
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start (see {self.state.parent / self.name}.log)")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Tracked:
    """A client's session: the history it was acknowledged (role, content), its checkpoints."""

    session: kvkeep.Session
    messages: list[tuple[str, str]]
    checkpoints: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)


@dataclass
class Results:
    acknowledged: int = 0
    lost: int = 0
    compared: int = 0
    mismatched: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    # Each loss: what was found, against what was acknowledged (the tails that differ).
    losses: list[dict[str, Any]] = field(default_factory=list)
    # (session id, start, end) of each answered request, for the times to continue.
    answered: list[tuple[str, float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, what: str, error: BaseException) -> None:
        kind = type(error).__name__
        cause = getattr(error, "cause", "") or str(error).split(";")[0][:70]
        with self.lock:
            self.failures[f"{what}: {kind} ({cause})"] += 1


def history(session: kvkeep.Session) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in session.info().messages]


def lost_turns(acknowledged: list[tuple[str, str]], found: list[tuple[str, str]]) -> int:
    """Assistant replies of the acknowledged history missing from what the session has."""
    same = 0
    while same < min(len(acknowledged), len(found)) and acknowledged[same] == found[same]:
        same += 1
    return sum(1 for role, _ in acknowledged[same:] if role == "assistant")


def client_loop(address: str, sessions: list[Tracked], deadline: float, results: Results, seed: int) -> None:
    rng = random.Random(seed)
    with kvkeep.Client(address, timeout=120, retry=kvkeep.Retry(wait=60)) as client:
        for t in sessions:
            t.session = kvkeep.Session(client, t.session.session_id)
        while time.monotonic() < deadline:
            t = rng.choice(sessions)
            op = rng.choices(("chat", "checkpoint", "restore", "fork"), (70, 10, 10, 10))[0]
            started = time.time()
            restoring: list[tuple[str, str]] | None = None
            try:
                if op == "chat":
                    q = rng.choice(QUESTIONS)
                    reply = t.session.chat(q, max_tokens=8)
                    t.messages += [("user", q), ("assistant", reply.text)]
                    with results.lock:
                        results.acknowledged += 1
                elif op == "checkpoint":
                    ck = t.session.checkpoint()
                    t.checkpoints = [*t.checkpoints[-3:], (ck.checkpoint_id, list(t.messages))]
                elif op == "restore" and t.checkpoints:
                    checkpoint_id, restoring = rng.choice(t.checkpoints)
                    t.session.restore(checkpoint_id)
                    t.messages = list(restoring)
                elif op == "fork":
                    compare(t, rng.choice(QUESTIONS), results)
                with results.lock:
                    results.answered.append((t.session.session_id, started, time.time()))
            except kvkeep.KvkeepError as e:
                results.fail(op, e)
                # A restore the daemon answered with an error was not made (or was put
                # back): the session must be as before. One whose call was cut (its daemon
                # killed, the proxy's connection lost) may have been made before the cut.
                also = [restoring] if restoring is not None and not answered(e) else []
                resync(t, results, f"after a failed {op} ({type(e).__name__})", also)


def answered(error: kvkeep.KvkeepError) -> bool:
    """Whether a daemon answered the request with this error (it names a cause, or its
    status is one only a daemon gives), rather than the call being cut or timing out."""
    return bool(error.cause) or error.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN")


def compare(t: Tracked, q: str, results: Results) -> None:
    """A persistent fork and its session, the same message: the same reply, whatever moved."""
    twin = t.session.fork(persistent=True)
    try:
        expected = twin.chat(q, max_tokens=8)
        got = t.session.chat(q, max_tokens=8)
        t.messages += [("user", q), ("assistant", got.text)]
        with results.lock:
            results.acknowledged += 1
            results.compared += 1
            results.mismatched += got.token_ids != expected.token_ids
    finally:
        with contextlib.suppress(kvkeep.KvkeepError):  # left behind: a fork the client lost track of
            twin.close()


def resync(t: Tracked, results: Results, when: str, also: list[list[tuple[str, str]]]) -> None:
    """After a failed request: what the session has now must still begin with what the client
    was acknowledged (else those turns were lost); the client goes on from it."""
    try:
        found = history(t.session)
    except kvkeep.KvkeepError as e:
        results.fail("resync", e)
        return
    if not any(lost_turns(other, found) == 0 for other in also):
        check(t, found, results, when)
    t.messages = found


def check(t: Tracked, found: list[tuple[str, str]], results: Results, when: str) -> None:
    lost = lost_turns(t.messages, found)
    if not lost:
        return
    same = next(
        (i for i, (a, b) in enumerate(zip(t.messages, found, strict=False)) if a != b),
        min(len(t.messages), len(found)),
    )
    with results.lock:
        results.lost += lost
        results.losses.append(
            {
                "session": t.session.session_id,
                "when": when,
                "at": time.time(),
                "acknowledged": [f"{r}: {c[:40]}" for r, c in t.messages[same:]],
                "found": [f"{r}: {c[:40]}" for r, c in found[same:]],
            }
        )


def start_servers(
    work: Path, args: argparse.Namespace
) -> tuple[RedisServer, WeedMini, list[Daemon], HaproxyServer]:
    redis_server = RedisServer(work / "redis").start()
    weed = WeedMini(work / "weed", bucket="chaos").start()
    s3 = weed.server
    env = {**s3.env, "KVKEEP_STORE_KEY": secrets.token_hex(32)}
    flags = [
        "--catalog", f"{redis_server.url}?prefix={PREFIX}",
        "--store", f"s3://{s3.bucket}/blocks",
        "--s3-endpoint", s3.endpoint_url,
        "--slots", "4", "--ctx-per-session", "2048", "--threads", "1",
        "--lease-seconds", str(args.lease_seconds),
        "--orphan-grace", str(GRACE),
        "--sweep-interval", "2",
        "--persistent-ttl", "0",
        "--grace-seconds", "2",
        "--http", "off",  # gRPC through the proxy only: three daemons on one host
    ]  # fmt: skip
    daemons = [Daemon(f"d{i}", work / f"state{i}", free_port(), flags, env) for i in (1, 2, 3)]
    try:
        for d in daemons:
            d.start()
    except BaseException:  # nothing left running (a daemon that cannot start says why in its log)
        for d in daemons:
            d.kill()
        weed.stop()
        redis_server.stop()
        raise
    config = work / "haproxy.cfg"
    text = (ROOT / "deploy" / "haproxy.cfg").read_text()
    line = '    server kvkeep2 "${KVKEEP_DAEMON_2-127.0.0.1:50052}"\n'
    config.write_text(text.replace(line, line + '    server kvkeep3 "${KVKEEP_DAEMON_3-127.0.0.1:50053}"\n'))
    address = f"127.0.0.1:{free_port()}"
    proxy_env = {
        "KVKEEP_PROXY_ADDRESS": address,
        **{f"KVKEEP_DAEMON_{i + 1}": d.address for i, d in enumerate(daemons)},
    }

    def answers() -> bool:
        with kvkeep.Client(address, timeout=5, retry=None) as probe:
            try:
                return probe.info().slots > 0
            except kvkeep.KvkeepError:
                return False

    proxy = HaproxyServer(config, proxy_env, work / "haproxy.log").start(answers)
    return redis_server, weed, daemons, proxy


def faults(
    args: argparse.Namespace, started: float, stop: threading.Event, daemons: list[Daemon],
    redis_server: RedisServer, weed: WeedMini, address: str, log: list[dict[str, Any]],
) -> None:  # fmt: skip
    """The fault schedule, until `stop`: kills every --kill-every s, Redis paused at 40% of
    the run, the store's connections cut at 60%."""
    plan = [(k * args.kill_every, "kill") for k in range(1, int(args.duration // args.kill_every) + 1)]
    plan += [(0.4 * args.duration, "pause redis"), (0.6 * args.duration, "cut store")]
    victims = iter(daemons * 100)
    for at, what in sorted(plan):
        if stop.wait(max(0.0, started + at - time.monotonic())):
            return
        event: dict[str, Any] = {"at": round(time.monotonic() - started, 1), "what": what}
        if what == "kill":
            victim = next(victims)
            try:
                with kvkeep.Client(address, timeout=30) as c:
                    held = [i.session_id for i in c.list_sessions() if i.holder == victim.name]
            except kvkeep.KvkeepError:
                held = []
            event.update(daemon=victim.name, sessions=held, time=time.time())
            victim.kill()
            log.append(event)
            stop.wait(args.restart_after)
            victim.start()
        elif what == "pause redis":
            assert redis_server.proc is not None
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            log.append(event)
            stop.wait(args.redis_pause)
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        else:
            assert weed.proc is not None
            weed.proc.kill()
            weed.proc.wait(30)
            log.append(event)
            weed.start()


def continue_times(kills: list[dict[str, Any]], answered: list[tuple[str, float, float]]) -> list[float]:
    """Per session its daemon held at a kill: seconds from the kill (or from the request, if
    it came later) to its first answer that ended after the kill."""
    out = []
    for kill in kills:
        for sid in kill["sessions"]:
            after = [(end, start) for s, start, end in answered if s == sid and end > kill["time"]]
            if after:
                end, start = min(after)
                out.append(end - max(kill["time"], start))
    return out


def orphans(weed: WeedMini, redis_server: RedisServer) -> tuple[int, int]:
    """(blocks in the store no checkpoint knows, blocks in the store)."""
    s3 = weed.server
    client = boto3.client(
        "s3",
        endpoint_url=s3.endpoint_url,
        aws_access_key_id=s3.access_key,
        aws_secret_access_key=s3.secret_key,
        region_name=s3.region,
    )
    stored = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix="blocks/"):
        stored |= {item["Key"].removeprefix("blocks/") for item in page.get("Contents", ())}
    known = {k.decode() for k in redis.Redis.from_url(redis_server.url).hkeys(f"{PREFIX}:blocks")}
    return len(stored - known), len(stored)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    redis_server, weed, daemons, proxy = start_servers(work, args)
    address = proxy.env["KVKEEP_PROXY_ADDRESS"]
    try:
        results = Results()
        groups: list[list[Tracked]] = [[] for _ in range(args.clients)]
        with kvkeep.Client(address, timeout=120) as setup:
            for i in range(args.sessions):
                s = setup.create_session(SYSTEM, persistent=True, sampling=kvkeep.SamplingParams(seed=i))
                groups[i % args.clients].append(Tracked(s, history(s)))
        started = time.monotonic()
        stop = threading.Event()
        events: list[dict[str, Any]] = []
        chaos = threading.Thread(
            target=faults, args=(args, started, stop, daemons, redis_server, weed, address, events)
        )
        chaos.start()
        deadline = started + args.duration
        workers = [
            threading.Thread(target=client_loop, args=(address, g, deadline, results, n))
            for n, g in enumerate(groups)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        stop.set()
        chaos.join()
        for d in daemons:  # every daemon up for the checks
            if d.proc is None or d.proc.poll() is not None:
                d.start()
        # Every session's history against what its client was acknowledged.
        checked = 0
        with kvkeep.Client(address, timeout=120, retry=kvkeep.Retry(wait=60)) as checker:
            for t in (t for g in groups for t in g):
                try:
                    found = history(kvkeep.Session(checker, t.session.session_id))
                except kvkeep.KvkeepError as e:
                    results.fail("final check", e)
                    continue
                check(t, found, results, "at the end")
                checked += 1
        # The collector's grace period, and a few of its passes.
        time.sleep(GRACE + 10)
        left, stored = orphans(weed, redis_server)
        times = sorted(continue_times([e for e in events if e["what"] == "kill"], results.answered))
        return {
            "duration_s": args.duration,
            "sessions": args.sessions,
            "clients": args.clients,
            "faults": [{k: v for k, v in e.items() if k not in ("sessions", "time")} for e in events],
            "requests_answered": len(results.answered),
            "turns_acknowledged": results.acknowledged,
            "acknowledged_turns_lost": results.lost,
            "sessions_checked": checked,
            "continuations_compared": results.compared,
            "continuations_differing": results.mismatched,
            "requests_failed": sum(results.failures.values()),
            "failures": dict(results.failures.most_common()),
            "sessions_whose_daemon_died": len(times),
            "continue_after_death_median_s": round(statistics.median(times), 2) if times else None,
            "continue_after_death_p95_s": round(times[int(0.95 * (len(times) - 1))], 2) if times else None,
            "losses": results.losses,
            "kills": [{"daemon": e["daemon"], "time": e["time"]} for e in events if e["what"] == "kill"],
            "orphaned_blocks_after_collector": left,
            "blocks_in_store": stored,
            "takeovers": sum(
                (work / f"{d.name}.log").read_text(errors="replace").count("taken over") for d in daemons
            ),
        }
    finally:
        proxy.stop()
        for d in daemons:
            d.stop()
        weed.stop()
        redis_server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--kill-every", type=float, default=60.0)
    parser.add_argument("--restart-after", type=float, default=5.0)
    parser.add_argument("--redis-pause", type=float, default=10.0)
    parser.add_argument("--lease-seconds", type=float, default=3.0)
    parser.add_argument("--keep", action="store_true", help="keep the working directory and its logs")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvkeep-chaos-"))
    try:
        report = run(args, work)
    finally:
        if args.keep:
            print(f"logs in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
