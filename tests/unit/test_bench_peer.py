"""scripts/bench peer: its arguments, and a refusal before anything starts when the
llama-server it is given is not there (the benchmark itself runs by hand)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_peer_lists_its_options() -> None:
    done = _bench("peer", "--help")
    assert done.returncode == 0, done.stderr
    options = ("LLAMA_SERVER", "--tokens", "--repeat", "--restarts", "--flash-attn", "--no-cold")
    for option in (*options, "--concurrent-rounds", "--concurrency-only", "--stream-rounds"):
        assert option in done.stdout


def test_peer_needs_a_llama_server(tmp_path: Path) -> None:
    missing = tmp_path / "llama-server"
    done = _bench("peer", str(missing))
    assert done.returncode != 0
    assert f"not an executable: {missing}" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing was started or written
    done = _bench("peer")
    assert done.returncode == 2 and "LLAMA_SERVER" in done.stderr
    done = _bench("peer", str(missing), "--flash-attn", "maybe")
    assert done.returncode == 2 and "invalid choice" in done.stderr
