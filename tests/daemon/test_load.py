"""Load: scripts/load.py's mix of every operation, from concurrent clients, against a real daemon
with fewer slots than sessions. A short run (``KVKEEP_LOAD_REQUESTS``, default 150; the
script itself runs any size by hand) must end with:

- every request answered, and no error of any status;
- every operation of the mix exercised;
- the sessions listed exactly those the clients hold, each continuing exactly like a fresh
  session given its whole history (greedy token ids and log-probabilities);
- the daemon's invariant (checked after the test, as after every test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from checkpoint_helpers import continues_like_its_history
from daemons import InProcessDaemon

import kvkeep

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = int(os.environ.get("KVKEEP_LOAD_REQUESTS", "150"))
OPERATIONS = ("chat", "generate", "checkpoint", "restore", "fork", "rewind", "close", "export", "import")


@pytest.mark.timeout(300)
def test_a_load_of_every_operation_ends_without_errors_and_every_session_exact(
    start_daemon: Callable[..., InProcessDaemon], tmp_path: Path
) -> None:
    d = start_daemon(slots=2)
    report_path = tmp_path / "load.json"
    command = [
        sys.executable,
        str(ROOT / "scripts" / "load.py"),
        "--address",
        d.address,
        "--clients",
        "4",
        "--requests",
        str(REQUESTS),
        "--duration",
        "120",
        "--timeout",
        "60",
        "--max-tokens",
        "6",
        "--keep-sessions",
        "--json",
        str(report_path),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    print(run.stdout)
    assert report_path.exists(), run.stdout + run.stderr
    report = json.loads(report_path.read_text())
    assert report["errors"] == {}, report["error_samples"]
    assert run.returncode == 0, run.stderr
    assert report["completed"] == report["requests"] == REQUESTS
    assert {op for op in OPERATIONS if report["ops"].get(op, {}).get("n")} == set(OPERATIONS)

    with kvkeep.Client(d.address, timeout=60) as client:
        listed = {s.session_id for s in client.list_sessions()}
        assert listed == set(report["sessions"])
        for sid in sorted(listed):
            continues_like_its_history(client, sid, tmp_path)
