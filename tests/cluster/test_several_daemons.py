"""`scripts/several-daemons` as docs/deploying.md gives it: Redis and two daemons sharing its
catalog and block store on one machine; a persistent session made on one continues on the
other, and Ctrl-C stops every process it started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

from daemons import GREEDY, PROBE_CACHE, SERVING, health_status, wait_until
from servers import free_port

import kvkeep

ROOT = Path(__file__).resolve().parents[2]


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_two_daemons_on_one_box_serve_one_persistent_session(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster"
    redis_port = free_port()
    env = {
        **os.environ,
        "KVKEEP_CLUSTER_DIR": str(cluster),
        "KVKEEP_REDIS_PORT": str(redis_port),
        "KVKEEP_BASE_PORT": "0",
        "KVKEEP_BASE_HTTP_PORT": "0",
    }
    flags = ["--threads", "1", "--slots", "2", "--ctx-per-session", "1024", "--probe-cache", str(PROBE_CACHE)]
    log = tmp_path / "script.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(ROOT / "scripts" / "several-daemons"), "2", "--", *flags],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    ports: list[int] = []
    try:

        def bound(i: int) -> int | None:
            assert proc.poll() is None, log.read_text()
            ready = cluster / f"daemon{i}.ready"
            text = ready.read_text() if ready.exists() else ""
            return int(text) if text.endswith("\n") else None

        ports = [wait_until(lambda i=i: bound(i), 180, f"daemon{i}'s ready file") for i in (1, 2)]
        first, second = (f"127.0.0.1:{p}" for p in ports)
        for address in (first, second):
            wait_until(lambda a=address: health_status(a) == SERVING, 60, f"{address} to serve")

        with kvkeep.Client(first) as one, kvkeep.Client(second) as two:
            made = one.create_session("Be brief.", persistent=True, sampling=GREEDY)
            made.chat("My name is Ada.", max_tokens=8)
            listed = {s.session_id: s.holder for s in two.list_sessions()}
            assert listed.get(made.session_id) == "daemon1"
            taken = two.session(made.session_id)
            assert taken.chat("What is my name?", max_tokens=8).text
            assert [m.role for m in taken.info().messages] == [
                "system",
                "user",
                "assistant",
                "user",
                "assistant",
            ]
            taken.close()
            assert made.session_id not in {s.session_id for s in one.list_sessions()}
        assert "store key" in (cluster / "daemon2.log").read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        returncode = proc.wait(90)
    assert returncode == 130, log.read_text()
    # Nothing it started is left running.
    assert not listening(redis_port)
    assert not any(listening(p) for p in ports)
