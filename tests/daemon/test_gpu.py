"""GPU-side paths, tested on the CPU build: the KV streams a budget sizes (slots, docks, the
scratch), the dock table's choices, what GetInfo says of the backend and devices, a layer
count refused where there is no GPU, and sessions docked and undocked bit-exactly (a dock is
a KV stream in the context's memory: RAM on a CPU build, device memory on a GPU).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from checkpoint_helpers import GREEDY, gen
from daemons import InProcessDaemon, model_path

import kvkeep
from kvkeepd.api.convert import device_fields
from kvkeepd.engine import backend, streams
from kvkeepd.engine.context import LlamaContext
from kvkeepd.engine.context_config import ContextConfig
from kvkeepd.errors import KvkeepError
from kvkeepd.sessions.dock_table import Docks
from kvkeepd.sessions.session import Session
from kvkeepd.values.sampling import SamplingParams as kvkeep_sampling

# SmolLM2-135M: 30 layers, 3 KV heads of 64.
SMOL = streams.ModelShape(n_layer=30, n_head_kv=3, head_k=64, head_v=64)
CTX = 256
STREAM = streams.row_bytes(SMOL, "f16") * CTX


def test_a_token_row_is_its_k_and_v_over_all_layers() -> None:
    assert streams.row_bytes(SMOL, "f16") == 30 * 2 * 3 * 64 * 2
    assert streams.row_bytes(SMOL, "q8_0") == 30 * 2 * 6 * 34  # blocks of 32 values, 34 bytes
    assert streams.row_bytes(SMOL, "q4_0") == 30 * 2 * 6 * 18


def test_a_budget_sizes_the_streams_slots_first_then_docks_and_a_scratch() -> None:
    assert streams.plan(4, STREAM, 0, unified=False, recurrent=False) == streams.StreamPlan(4, 0, STREAM)
    p = streams.plan(2, STREAM, 10 * STREAM + STREAM // 2, unified=False, recurrent=False)
    assert (p.slots, p.docks, p.total, p.scratch) == (2, 7, 10, 9)
    assert [p.dock_id(i) for i in range(p.docks)] == list(range(2, 9))
    # One stream beyond the slots cannot be both a dock and the scratch: no docks.
    assert streams.plan(2, STREAM, 3 * STREAM, unified=False, recurrent=False).docks == 0
    # llama.cpp's cap of 256 sequences.
    assert streams.plan(2, STREAM, 10_000 * STREAM, unified=False, recurrent=False).total == 256
    # A recurrent state is not in the KV streams: no docks for it.
    assert streams.plan(2, STREAM, 10 * STREAM, unified=False, recurrent=True).docks == 0


def test_a_budget_too_small_or_with_one_shared_buffer_is_refused() -> None:
    with pytest.raises(KvkeepError, match=r"holds 3 KV streams .* fewer than --slots 4"):
        streams.plan(4, STREAM, 3 * STREAM, unified=False, recurrent=False)
    with pytest.raises(KvkeepError, match="not with --kv-unified"):
        streams.plan(4, STREAM, 100 * STREAM, unified=True, recurrent=False)


def _session(sid: str, used: float) -> Session:
    return Session(sid, False, kvkeep_sampling(), (), created_at=0.0, last_used_at=used)


def test_the_dock_given_up_is_the_least_recently_used_idle_one() -> None:
    docks = Docks(3)
    a, b, c = _session("a", 3.0), _session("b", 1.0), _session("c", 2.0)
    for place, s in enumerate((a, b, c)):
        assert docks.free_place() == place
        docks.hold(place, s)
    assert docks.free_place() is None
    assert docks.victim() is b
    assert docks.victim(keep=b) is c

    async def busy_b() -> Session | None:
        async with b.lock:  # a request holds it: giving it up would wait
            return docks.victim()

    assert asyncio.run(busy_b()) is c
    with pytest.raises(ValueError, match="taken"):
        docks.hold(0, b)
    docks.vacate(1)
    assert docks.free_place() == 1
    assert docks.owners() == [a, None, c]


CPU = backend.Device("CPU", "a CPU", "cpu", "CPU", 64 << 30, 32 << 30)
H200 = backend.Device("CUDA0", "NVIDIA H200", "gpu", "CUDA", 141 << 30, 120 << 30)


def test_a_layer_count_needs_a_gpu_and_all_or_none_runs_anywhere() -> None:
    for layers in (-1, 0):
        backend.check_offload(layers, [CPU])
    backend.check_offload(12, [CPU, H200])
    with pytest.raises(KvkeepError, match=r"no GPU backend .* KVKEEP_ACCEL=cuda scripts/setup"):
        backend.check_offload(12, [CPU])


def test_getinfo_shows_the_gpus_where_there_are_any_else_the_cpu() -> None:
    assert device_fields([CPU, H200]) == {
        "backend": "CUDA",
        "device": "CUDA0: NVIDIA H200",
        "device_memory_total": 141 << 30,
        "device_memory_free": 120 << 30,
    }
    assert device_fields([CPU])["backend"] == "CPU"


def test_a_cpu_build_refuses_a_layer_count_before_loading() -> None:
    cfg = ContextConfig(
        model_path=model_path(), slots=1, ctx_per_session=CTX, batch_size=64,
        threads=1, gpu_layers=3, kv_type="f16", kv_unified=False,
    )  # fmt: skip
    with pytest.raises(KvkeepError, match=r"--gpu-layers 3: this llama\.cpp build has no GPU backend"):
        LlamaContext(cfg)


def test_getinfo_reports_backend_device_and_the_probe(client: kvkeep.Client) -> None:
    info = client.info()
    assert info.backend == "CPU" and info.device.startswith("CPU: ")
    assert info.device_memory_total > 0
    assert info.gpu_layers == -1  # all, by default: a CPU build runs them on the CPU
    assert (info.docks, info.sessions_docked, info.pinned_transfers) == (0, 0, False)
    assert info.kv_stream_bytes == streams.row_bytes(SMOL, "f16") * info.ctx_per_session
    assert info.mode == "exact" and info.mode_note == ""


def test_docked_sessions_come_back_bit_exact(start_daemon: Callable[..., InProcessDaemon]) -> None:
    # One slot, three docks and the scratch: five sessions take turns in the slot, so each
    # is docked, and the fourth to leave sends the oldest docked one to RAM.
    d = start_daemon(slots=1, ctx_per_session=CTX, batch_size=64, gpu_kv_budget=5 * STREAM + 1)
    with kvkeep.Client(d.address, timeout=60) as client:
        assert client.info().docks == 3
        prompts = [f"Story {i}: the keeper of lighthouse number {i} wrote that" for i in range(5)]
        sessions = [client.create_session(sampling=GREEDY) for _ in prompts]
        firsts = [gen(s, p, 6) for s, p in zip(sessions, prompts, strict=True)]
        info = client.info()
        assert info.sessions_docked == 3 and info.sessions_hot == 1
        # A checkpoint of a session docked just now reads its dock before any decode has
        # made the pending copy (the scratch makes it first).
        docked = sessions[3]
        checkpoint = docked.checkpoint("docked").checkpoint_id
        for s, p, first in zip(sessions, prompts, firsts, strict=True):
            again = gen(s, "", 6)  # undocked (or loaded from RAM) and continued
            reference = client.create_session(sampling=GREEDY)
            assert gen(reference, p, 12) == first + again
            reference.close()
        fork = docked.fork(checkpoint)
        assert gen(fork, "", 6) == gen(client.create_session(sampling=GREEDY), prompts[3], 12)[6:]
        assert client.info().swap_ins >= 5


def test_the_gpu_check_runs_its_steps_on_the_cpu_build(tmp_path: Path) -> None:
    """scripts/gpu-check --cpu: the device run's checks and measurements, on a tiny model."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [str(root / "scripts" / "gpu-check"), "--cpu", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "KVKEEP_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["broken"] == []
    plain, flash, compact = report["runs"]
    assert [r["attention"] for r in report["runs"]] == [
        "exact mode, flash attention off",
        "exact mode, batch-invariant flash attention",
        "flash attention on (compact mode)",
    ]
    for exact in (plain, flash):
        assert exact["exact"] and set(exact["checks"].values()) == {"same"}
        # 6 ways to the same state, and 6 suffixes after a cached prefix, alone and beside another
        assert len(exact["checks"]) == 18
    assert compact["mode_note"] == "the settings ask for the compact mode" and "probe" in compact
    for run in report["runs"]:
        assert run["streams"] == {"slots": 16, "docks": 2, "stream_bytes": run["streams"]["stream_bytes"]}
        assert set(run["met"]) == set(report["targets"])
        assert run["state_bytes"] > 0 and run["reprefill_ms"] > 0 and run["decode_tok_s_16"] > 0
    assert "| host_restore_gb_s |" in (tmp_path / "gpu-check.md").read_text()
    assert not list(tmp_path.glob("*.gguf"))  # the model does not go back
