"""scripts/bench scale on a tiny generated model: every figure is measured as it says (restores
load a state, parked sessions are in RAM), and a delta checkpoint grows with its new tokens,
not with the context."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--threads", "1", "scale", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_scale_measures_each_length(tmp_path: Path) -> None:
    repeat, sessions = 2, 5
    done = _bench(
        *("--shape", "tiny", "--lengths", "128,1024", "--repeat", str(repeat)),
        *("--sessions", str(sessions), "--out", str(tmp_path), "--work", str(tmp_path)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| random tiny | 1,024 " in done.stdout and "note:" not in done.stdout
    result = json.loads((tmp_path / "scale-random-tiny.json").read_text())
    short, long = result["lengths"]["128"]["kvkeep"], result["lengths"]["1024"]["kvkeep"]
    for n, k in ((128, short), (1024, long)):
        assert k["evaluated"] == n  # the baseline evaluated the whole prompt
        assert k["ram_from"] == ["warm"]  # the RAM turns found the session parked in RAM
        assert k["disk_loads"] == 2 * repeat  # every restore from disk loaded a state
        assert k["sessions"]["swap_ins"] == sessions  # each round-robin turn swapped one in
        assert k["e_delta_tokens"] == 65 and k["p_delta_tokens"] == 65
        assert 0 < k["vmhwm"] <= result["peak_rss"]
    assert 6 < long["disk_bytes"] / short["disk_bytes"] < 9  # the state grows with the context
    assert long["e_full_bytes"] > 4 * long["e_delta_bytes"]
    assert long["e_delta_bytes"] < 1.5 * short["e_delta_bytes"]  # the delta does not
    assert long["p_delta_bytes"] < 1.5 * short["p_delta_bytes"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("kvkeep-scale-")]  # cleaned up


def test_scale_refuses_a_missing_peer(tmp_path: Path) -> None:
    missing = tmp_path / "llama-server"
    done = _bench("--peer", str(missing), "--work", str(tmp_path))
    assert done.returncode != 0 and f"not an executable: {missing}" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing was started or written
