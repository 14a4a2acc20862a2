"""Cancellation at random moments leaves every session exact and the daemon consistent.

Many clients act on more sessions than slots with deadlines of a few milliseconds, and some
leave in the middle of a stream: during swaps, closes, forks, restores, rewinds and
generations. Afterwards:

- every session continues exactly as a fresh evaluation of its own history (its state is
  the state of its tokens: no cells of another session, no positions without context);
- every session restored to its checkpoint continues exactly as the undisturbed control run;
- the daemon answers GetInfo at once, and its invariant holds (the subprocess runs with
  --check-invariants, so every idle moment of the run was checked, too);
- CloseSession was all or nothing: a session is either fully there (found, listed, back
  after a restart) or fully gone.

``KVKEEP_CHAOS_OPS`` sets the number of random operations (default 600; run thousands by
hand).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from checkpoint_helpers import SPAWN_ARGS, Trace, continues_like_its_history, gen
from daemons import DaemonProcess

import kvkeep
from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeep.v1 import kvkeep_pb2_grpc as pb_grpc

OPS = int(os.environ.get("KVKEEP_CHAOS_OPS", "600"))
SESSIONS = 6
DEADLINES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.2, 2.0)
# What a cut-short call may answer; anything else (INTERNAL, DATA_LOSS...) is a bug.
EXPECTED = {
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.NOT_FOUND,  # a fork that another thread closed
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # the slot queue, under this load
    grpc.StatusCode.OUT_OF_RANGE,  # a session whose context filled up
}


@dataclass
class World:
    """What the chaos threads share: the sessions, their checkpoints, the forks, outcomes."""

    address: str
    targets: list[str]
    checkpoints: dict[str, str]
    forks: list[str] = field(default_factory=list)
    closing: set[str] = field(default_factory=set)
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, what: str, e: grpc.RpcError | None) -> None:
        code = e.code() if e is not None else grpc.StatusCode.OK
        with self.lock:
            self.outcomes[f"{what}:{code.name}"] += 1
            # A rewind's length was read before another thread shortened the history.
            raced = what == "rewind" and code == grpc.StatusCode.INVALID_ARGUMENT
            if e is not None and code not in EXPECTED and not raced:
                self.errors.append(f"{what}: {code.name} {e.details()}")


def _one(world: World, stub: pb_grpc.KvKeepStub, rng: random.Random) -> None:
    deadline = rng.choice(DEADLINES)
    with world.lock:
        pool = world.targets + world.forks
    sid = rng.choice(pool)
    kind = rng.choice(
        ["generate", "generate", "chat", "checkpoint", "restore", "fork", "rewind", "close", "info"]
    )
    try:
        if kind in ("generate", "chat"):
            sampling = pb.SamplingParams(temperature=0.8, seed=rng.randrange(1 << 30))
            if kind == "generate":
                call = stub.Generate(
                    pb.GenerateRequest(
                        session_id=sid, prompt=" Then", max_tokens=rng.randint(1, 24), sampling=sampling
                    ),
                    timeout=deadline,
                )
            else:
                call = stub.Chat(
                    pb.ChatRequest(
                        session_id=sid, message="And then?", max_tokens=rng.randint(1, 24), sampling=sampling
                    ),
                    timeout=deadline,
                )
            leave_after = rng.choice([None, 0, 1, 2])  # a client that disconnects mid-stream
            for i, _ in enumerate(call):
                if leave_after is not None and i >= leave_after:
                    call.cancel()
                    world.record(f"{kind}-left", None)
                    return
        elif kind == "checkpoint":
            stub.Checkpoint(pb.CheckpointRequest(session_id=sid), timeout=deadline)
        elif kind == "restore":
            target = rng.choice(world.targets)
            stub.RestoreCheckpoint(
                pb.RestoreCheckpointRequest(session_id=sid, checkpoint_id=world.checkpoints[target]),
                timeout=deadline,
            )
        elif kind == "fork":
            source = pb.ForkSessionRequest(session_id=sid, persistent=rng.random() < 0.5)
            if rng.random() < 0.5:
                source = pb.ForkSessionRequest(checkpoint_id=world.checkpoints[rng.choice(world.targets)])
            forked = stub.ForkSession(source, timeout=deadline)
            with world.lock:
                world.forks.append(forked.session.session_id)
        elif kind == "rewind":
            n = stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=2).session.n_tokens
            stub.Rewind(
                pb.RewindRequest(session_id=sid, n_tokens=rng.randint(max(0, n - 30), n)), timeout=deadline
            )
        elif kind == "close":
            with world.lock:
                if not world.forks:
                    return
                sid = rng.choice(world.forks)
                world.closing.add(sid)
            try:
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=deadline)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            with world.lock:  # closed now, or by another thread before
                if sid in world.forks:
                    world.forks.remove(sid)
        else:
            stub.GetInfo(pb.GetInfoRequest(), timeout=deadline)
    except grpc.RpcError as e:
        world.record(kind, e)
        return
    world.record(kind, None)


def _chaos(world: World, n_ops: int, threads: int = 6) -> None:
    def worker(seed: int, count: int) -> None:
        rng = random.Random(seed)
        with grpc.insecure_channel(world.address) as channel:
            stub = pb_grpc.KvKeepStub(channel)
            for _ in range(count):
                _one(world, stub, rng)

    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(worker, 100 + i, n_ops // threads) for i in range(threads)]:
            f.result()


def test_random_cancellations_leave_every_session_exact(
    spawn_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    d = spawn_daemon(*SPAWN_ARGS, "--slots", "2", "--max-queue", "16")
    after: dict[str, Trace] = {}
    with kvkeep.Client(d.address, timeout=60) as client:
        checkpoints = {}
        for i in range(SESSIONS):
            s = client.create_session(
                sampling=kvkeep.SamplingParams(temperature=0.8, seed=i), persistent=i % 2 == 0
            )
            gen(s, f"Story {i}: the lighthouse keeper", 8)
            checkpoints[s.session_id] = s.checkpoint("base").checkpoint_id
            after[s.session_id] = gen(s, "", 12)  # the undisturbed control run
        world = World(d.address, list(checkpoints), checkpoints)

        started = time.monotonic()
        _chaos(world, OPS)
        chaos_seconds = time.monotonic() - started
        print(f"{OPS} operations in {chaos_seconds:.1f} s:", dict(sorted(world.outcomes.items())))
        assert not world.errors, world.errors

        started = time.monotonic()
        assert kvkeep.Client(d.address, timeout=2).info().slots == 2
        assert time.monotonic() - started < 2

        listed = {s.session_id for s in client.list_sessions()}
        for sid in world.closing:  # all or nothing: found and listed, or neither
            try:
                client.session(sid).info()
                assert sid in listed, f"{sid} is found but not listed"
            except kvkeep.NotFoundError:
                assert sid not in listed, f"{sid} is listed but not found"
        for sid in sorted(listed):
            continues_like_its_history(client, sid, tmp_path)
        for sid, ck in checkpoints.items():
            client.session(sid).restore(ck)
            assert gen(client.session(sid), "", 12) == after[sid], sid
        persistent = {s.session_id for s in client.list_sessions() if s.persistent}

    d.restart(kill=True)
    with kvkeep.Client(d.address, timeout=60) as client:
        back = {s.session_id for s in client.list_sessions()}
        assert back == persistent
        for sid, ck in checkpoints.items():
            if sid in back:
                client.session(sid).restore(ck)
                assert gen(client.session(sid), "", 12) == after[sid], sid
