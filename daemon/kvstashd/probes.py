"""The start-up exactness probe's results, kept by everything that picks llama.cpp's kernels.

The probe (LlamaContext.batch_dependence) evaluates about 520 tokens: seconds for a small
model on a CPU, minutes for a large one. Its answer depends only on which kernels run, and
those follow from the llama.cpp build, the model file, the context's settings, the probe
itself, the CPU's features, the devices and ggml's environment variables. A result is
reused when all of these are the same; anything else probes again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstashd.statedir import write_private

log = logging.getLogger(__name__)

# Entries kept per file: one per configuration a machine's daemons ran.
MAX_ENTRIES = 64
_ENV_PREFIXES = ("GGML_", "LLAMA_", "CUDA_", "HIP_", "ROCR_", "OMP_", "VK_", "METAL_", "MTL_")


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
        return probe()
    entries = _read(path)
    entry = entries.get(key)
    kept = entry.get("found", 0) if isinstance(entry, dict) else 0
    if kept is None or isinstance(kept, str):
        assert entry is not None
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(entry.get("at", 0))))
        log.info("exactness probe: the result of %s, kept in %s", when, path)
        return kept
    found = probe()
    entries[key] = {"found": found, "at": time.time()}
    newest = sorted(entries.items(), key=lambda kv: float(kv[1].get("at", 0)), reverse=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, json.dumps(dict(newest[:MAX_ENTRIES]), indent=1).encode())
    except OSError as e:  # unwritable: the next start probes again
        log.warning("cannot keep the exactness probe's result in %s: %s", path, e)
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
