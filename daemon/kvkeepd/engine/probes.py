"""The start-up exactness probe, and its results kept by everything that picks llama.cpp's kernels.

The probe (batch_dependence) evaluates about 520 tokens: seconds for a small model on a
CPU, minutes for a large one. Its answer depends only on which kernels run, and
those follow from the llama.cpp build, the model file, the context's settings, the probe
itself, the CPU's features, the devices and ggml's environment variables. A result is
reused when all of these are the same; anything else probes again. The file is not trusted
blindly: an entry that is not a result (a wrong type, a missing field, a time that is not
one) or a file that is not JSON is ignored with a warning, and a kept finding that is not one
this probe could report for these settings (a position it does not look at) does not turn
exact mode off: the probe runs again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvkeepd.engine import backend
from kvkeepd.engine.context import BatchItem, LlamaContext
from kvkeepd.engine.context_config import ContextConfig
from kvkeepd.files import write_private
from kvkeepd.values.sampling import Logits

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
    layout = _layout(ctx.cfg)
    return cached(
        ctx.cfg.probe_cache,
        _key(ctx.cfg, build),
        lambda: batch_dependence(ctx),
        lambda f: _could_find(layout, f),
    )


def kept(cfg: ContextConfig, build: dict[str, Any]) -> tuple[bool, str | None]:
    """Whether the probe cache holds a valid result for a context of `cfg` (made with the
    environment kernel_environment sets) without making one, and that result."""
    if cfg.probe_cache is None:
        return False, None
    entry = _read(cfg.probe_cache, quiet=True).get(_key(cfg, build))  # what is wrong is said when probing
    layout = _layout(cfg)
    if entry is None or _problem(entry, lambda f: _could_find(layout, f)):
        return False, None
    found: str | None = entry["found"]
    return True, found


def _key(cfg: ContextConfig, build: dict[str, Any]) -> str:
    """The probe cache's key for a context of `cfg` (wherever its results are kept)."""
    return machine_key(dataclasses.replace(cfg, probe_cache=None), PLAN, build)


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
    n, plan, beside_from = layout = _layout(ctx.cfg)
    batch = ctx.cfg.batch_size
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, ctx.n_vocab, n)]
    marks = {end - 1 for end in itertools.accumulate(plan)}
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
                delta = float(np.max(np.abs(row - reference[last])))
                return _finding(layout, k, f"{delta:.3g}")
            at = last + 1
    finally:
        ctx.clear(0)
        if ctx.cfg.slots > 1:
            ctx.clear(1)
    return None


def _layout(cfg: Any) -> tuple[int, list[int], int]:
    """The probe's sequence length, its chunk sizes and the first chunk evaluated beside
    another sequence (none with one slot), for a context of `cfg`."""
    n = min(PROBE_TOKENS, cfg.ctx_per_session)
    plan = probe_plan(n, cfg.batch_size)
    return n, plan, len(plan) - PROBE_BESIDE if cfg.slots > 1 else len(plan)


def _finding(layout: tuple[int, list[int], int], k: int, delta: str) -> str:
    """What the probe reports where the `k`th chunk's last logits differ by `delta`."""
    n, plan, beside_from = layout
    size, last = plan[k], sum(plan[: k + 1]) - 1
    how = f"in a chunk of {size}" if size > 1 else "alone"
    how = "beside another sequence's token" if k >= beside_from else how
    return (
        f"position {last} evaluated {how} (after chunks of {plan[:k]}) has logits "
        f"up to {delta} away from those of one chunk of {n}"
    )


def _could_find(layout: tuple[int, list[int], int], found: str) -> bool:
    """Whether `found` is a finding the probe could report with this layout: one of the
    positions it compares, evaluated as it evaluates it, and a difference that is one."""
    for k in range(len(layout[1])):
        head, _, tail = _finding(layout, k, "\0").partition("\0")
        if found.startswith(head) and found.endswith(tail) and len(found) > len(head) + len(tail):
            try:
                delta = float(found[len(head) : len(found) - len(tail)])
            except ValueError:
                return False
            return not delta <= 0  # NaN included: a NaN among the logits differs too
    return False


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


def cached(
    path: Path | None, key: str, probe: Callable[[], str | None], could_find: Callable[[str], bool]
) -> str | None:
    """The probe's finding (None: the logits did not depend on batching) for this key: read
    from the file at `path` when it holds a valid one (a finding only where `could_find` says
    the probe could report it), else probed and written there. With no path, always probed.
    A file or an entry that is not valid is ignored with a warning."""
    if path is None:
        return _timed(probe, "at every start (--probe-cache none)")
    entries = {k: v for k, v in _read(path).items() if k == key or not _malformed(v)}
    if key in entries:
        entry = entries[key]
        problem = _problem(entry, could_find)
        if not problem:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry["at"]))
            log.info("exactness probe: not run again, its result of %s is kept in %s", when, path)
            found: str | None = entry["found"]
            return found
        log.warning(
            "exactness probe: ignoring the result kept for these settings in %s (%s); probing again",
            path,
            problem,
        )
    found = _timed(probe, f"once for this llama.cpp build, model and settings, kept in {path}")
    entries[key] = {"found": found, "at": time.time()}
    newest = sorted(entries.items(), key=lambda kv: float(kv[1]["at"]), reverse=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, json.dumps(dict(newest[:MAX_ENTRIES]), indent=1).encode())
    except OSError as e:  # unwritable: the next start probes again
        log.warning("cannot keep the exactness probe's result in %s: %s", path, e)
    return found


def _problem(entry: Any, could_find: Callable[[str], bool]) -> str:
    """What keeps `entry` from being a kept result for these settings ("" if nothing): it is
    malformed, or holds a finding that `could_find` says the probe does not report."""
    problem = _malformed(entry)
    if not problem and isinstance(entry["found"], str) and not could_find(entry["found"]):
        problem = f"a finding this probe does not report: {_clip(entry['found'])}"
    return problem


def _malformed(entry: Any) -> str:
    """What keeps `entry` from being a kept result, `{"found": null or a finding, "at": a
    time}` ("" if nothing). A time ahead of the clock by more than a day is not one."""
    if not isinstance(entry, dict):
        return f"not an object: {_clip(entry)}"
    if "found" not in entry or not (entry["found"] is None or isinstance(entry["found"], str)):
        return f"'found' is neither null nor a string: {_clip(entry.get('found'))}"
    at = entry.get("at")
    if (
        isinstance(at, bool)
        or not isinstance(at, int | float)
        or not math.isfinite(at)
        or not 0 <= at <= time.time() + 86400
    ):
        return f"'at' is not a time: {_clip(at)}"
    return ""


def _clip(value: Any) -> str:
    """A value for a log line: its JSON, cut at 80 characters."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


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


def _read(path: Path, *, quiet: bool = False) -> dict[str, Any]:
    """The file's entries by key ({} if there is none); a file that cannot be read, is not
    JSON or not an object is ignored with a warning (none if `quiet`; the probe runs again)."""
    try:
        loaded = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON (cut short)
        why = (e.strerror or str(e)) if isinstance(e, OSError) else f"not JSON: {e}"
        if not quiet:
            log.warning("exactness probe: ignoring the results kept in %s (%s); probing again", path, why)
        return {}
    if not isinstance(loaded, dict):
        if not quiet:
            log.warning(
                "exactness probe: ignoring the results kept in %s (not a JSON object); probing again", path
            )
        return {}
    return {str(k): v for k, v in loaded.items()}


def _cpu_identity() -> list[str]:
    """The CPU's model and feature lines (Linux), or what platform says elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return [platform.processor()]
    wanted = ("model name", "flags", "features", "cpu part", "cpu implementer", "isa")
    lines = {line.strip() for line in text.splitlines() if line.lower().startswith(wanted)}
    return sorted(lines) or [platform.processor()]
