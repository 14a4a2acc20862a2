"""The start-up exactness probe, and its results kept by everything that picks llama.cpp's kernels.

The probe (batch_dependence) evaluates about 520 tokens: seconds for a small model on a
CPU, minutes for a large one. Its answer depends only on which kernels run, and
those follow from the llama.cpp build, the model file, the context's settings, the probe
itself, the CPU's features, the devices and ggml's environment variables. A result is
reused when all of these are the same; anything else probes again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvkeepd.engine import backend
from kvkeepd.engine.context import BatchItem, LlamaContext
from kvkeepd.files import write_private
from kvkeepd.values import Logits

log = logging.getLogger(__name__)

# The start-up exactness probe (see batch_dependence): one sequence this long,
# evaluated in one chunk, then in chunks of these sizes and one token at a time to its end,
# its last PROBE_BESIDE tokens beside another sequence's.
PROBE_TOKENS = 260
PROBE_CHUNKS = (1, 36, 4, 4, 19, 128, 64)
PROBE_SINGLES = 4
PROBE_BESIDE = 2
PLAN = {"tokens": PROBE_TOKENS, "chunks": PROBE_CHUNKS, "singles": PROBE_SINGLES, "beside": PROBE_BESIDE}

# Entries kept per file: one per configuration a machine's daemons ran.
MAX_ENTRIES = 64
_ENV_PREFIXES = ("GGML_", "LLAMA_", "CUDA_", "HIP_", "ROCR_", "OMP_", "VK_", "METAL_", "MTL_")


def exact(ctx: LlamaContext) -> str | None:
    """None where the context, configured for the exact mode, is exact on this machine (the
    probe found no batch dependence); else why not: the probe's finding (logged), or that
    the settings ask for the compact mode. Never assumed, on a GPU either: the probe decides."""
    if not ctx.cfg.exact:
        return "the settings ask for the compact mode"
    found = finding(ctx, backend.build_facts())
    if found is not None:
        log.warning("a token's logits depend on how it was batched: %s", found)
    return found


def finding(ctx: LlamaContext, build: dict[str, Any]) -> str | None:
    """The probe's finding for this context (see batch_dependence): kept in the context's
    probe cache for this machine key, or probed now. `build`: what llama.cpp says of itself."""
    key = machine_key(dataclasses.replace(ctx.cfg, probe_cache=None), PLAN, build)
    return cached(ctx.cfg.probe_cache, key, lambda: batch_dependence(ctx))


def probe_plan(n: int, batch: int) -> list[int]:
    """The probe's chunk sizes for a sequence of n tokens: PROBE_CHUNKS (each at most a
    batch), then single tokens, at least PROBE_SINGLES of them."""
    sizes: list[int] = []
    at = 0
    for size in PROBE_CHUNKS:
        size = min(size, batch, n - PROBE_SINGLES - at)
        if size <= 0:
            break
        sizes.append(size)
        at += size
    return sizes + [1] * (n - at)


def batch_dependence(ctx: LlamaContext) -> str | None:
    """Where the probe found a token's logits depend on how its sequence was batched in
    `ctx`; None: nowhere it looked.

    Sampling, resumes and restores by re-evaluation are bit-exact only when they do not.
    One sequence of PROBE_TOKENS is evaluated twice in slot 0: as one chunk, and as
    chunks of 1 to 128 tokens then one token at a time, the last ones beside a token of
    another sequence (slot 1). Each chunk's last logits must equal the first run's.
    The sizes reach every kernel choice seen to depend on the batch: tinyBLAS
    (GGML_LLAMAFILE) serves 2+ columns only; repacked weights take a gemv for one column;
    ggml's tiled K-quant matmul starts at 8 rows; flash attention has one kernel below 64
    queries and a tiled one from 64, and for a single query over 512 KV cells or more
    (past 256 positions) it splits the cells among threads, unless another sequence
    shares the batch.
    """
    n = min(PROBE_TOKENS, ctx.cfg.ctx_per_session)
    batch = ctx.cfg.batch_size
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, ctx.n_vocab, n)]
    plan = probe_plan(n, batch)
    marks = {end - 1 for end in itertools.accumulate(plan)}
    beside_from = len(plan) - PROBE_BESIDE if ctx.cfg.slots > 1 else len(plan)
    try:
        reference: dict[int, Logits] = {}
        for at in range(0, n, batch):
            part = range(at, min(at + batch, n))
            rows = ctx.decode([BatchItem(0, tokens[p], p, p in marks) for p in part])
            reference.update(zip(sorted(marks.intersection(part)), rows, strict=True))
        ctx.clear(0)
        at = 0
        for k, size in enumerate(plan):
            last = at + size - 1
            items = [BatchItem(0, tokens[p], p, p == last) for p in range(at, last + 1)]
            if k >= beside_from:
                q = k - beside_from
                items.append(BatchItem(1, tokens[q], q, False))
            row = ctx.decode(items)[0]
            if not np.array_equal(row, reference[last]):
                how = f"in a chunk of {size}" if size > 1 else "alone"
                how = "beside another sequence's token" if k >= beside_from else how
                delta = float(np.max(np.abs(row - reference[last])))
                return (
                    f"position {last} evaluated {how} (after chunks of {plan[:k]}) has logits "
                    f"up to {delta:.3g} away from those of one chunk of {n}"
                )
            at = last + 1
    finally:
        ctx.clear(0)
        if ctx.cfg.slots > 1:
            ctx.clear(1)
    return None


def machine_key(config: Any, probe: dict[str, Any], build: dict[str, Any]) -> str:
    """A digest of everything that decides the probe's answer for this context: `config` (a
    dataclass with the `model_path` it loads), the model file, the probe's own plan, and
    `build`, what llama.cpp says of itself (version, libraries, CPU features, devices)."""
    model_path: Path = config.model_path
    st = model_path.stat()
    facts = {
        "probe": probe,
        "context": {k: str(v) for k, v in dataclasses.asdict(config).items()},
        "model": [str(model_path.resolve()), st.st_size, st.st_mtime_ns],
        "build": build,
        "cpu": _cpu_identity(),
        "platform": [platform.system(), platform.release(), platform.machine()],
        "env": sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)),
    }
    return hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=20).hexdigest()


def cached(path: Path | None, key: str, probe: Callable[[], str | None]) -> str | None:
    """The probe's finding (None: the logits did not depend on batching) for this key: read
    from the file at `path` when it holds one, else probed and written there. With no path,
    always probed."""
    if path is None:
        return _timed(probe, "at every start (--probe-cache none)")
    entries = _read(path)
    entry = entries.get(key)
    kept = entry.get("found", 0) if isinstance(entry, dict) else 0
    if kept is None or isinstance(kept, str):
        assert entry is not None
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(entry.get("at", 0))))
        log.info("exactness probe: not run again, its result of %s is kept in %s", when, path)
        return kept
    found = _timed(probe, f"once for this llama.cpp build, model and settings, kept in {path}")
    entries[key] = {"found": found, "at": time.time()}
    newest = sorted(entries.items(), key=lambda kv: float(kv[1].get("at", 0)), reverse=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, json.dumps(dict(newest[:MAX_ENTRIES]), indent=1).encode())
    except OSError as e:  # unwritable: the next start probes again
        log.warning("cannot keep the exactness probe's result in %s: %s", path, e)
    return found


def _timed(probe: Callable[[], str | None], kept: str) -> str | None:
    """Run the probe, saying what it checks before and how long it took after."""
    log.info(
        "exactness probe: checking that a token's logits do not depend on how it is batched "
        "(%d tokens, seconds on a small model; %s)",
        2 * PROBE_TOKENS,
        kept,
    )
    started = time.monotonic()
    found = probe()
    log.info(
        "exactness probe: %s in %.1f s",
        "found a dependence" if found else "passed",
        time.monotonic() - started,
    )
    return found


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(loaded, dict):
        return {}
    return {str(k): v for k, v in loaded.items() if isinstance(v, dict)}


def _cpu_identity() -> list[str]:
    """The CPU's model and feature lines (Linux), or what platform says elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return [platform.processor()]
    wanted = ("model name", "flags", "features", "cpu part", "cpu implementer", "isa")
    lines = {line.strip() for line in text.splitlines() if line.lower().startswith(wanted)}
    return sorted(lines) or [platform.processor()]
