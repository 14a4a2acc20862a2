"""The engine's start, on its thread: the model loaded and its context made, the start-up
exactness probe run (probes.py) — on exact mode's batch-invariant flash attention first and,
where it finds a dependence, on attention without flash — and the memory the first restores
would otherwise fault in mapped. A start given up from another thread (a Halt set) stops at
the load's next progress report or the probe's next graph node."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from kvkeepd.engine import backend, probes
from kvkeepd.engine.context import LlamaContext, ModelInfo
from kvkeepd.engine.context_config import ContextConfig, kernel_environment
from kvkeepd.state import pieces

log = logging.getLogger(__name__)

# The most memory mapped at start for assembling states (twice: see open_context); a larger
# state grows the buffer when it first comes.
_PREMAPPED = 256 << 20


def open_context(
    config: ContextConfig, halt: backend.Halt
) -> tuple[LlamaContext, ModelInfo, backend.Scratch]:
    """The context, what the model is (exact as the probe found), and the buffer where states
    are assembled for it. Whatever fails closes what was made."""
    started = time.monotonic()
    config, flash_note = _known_attention(config)
    ctx = LlamaContext(config, halt)
    try:
        log.info("model loaded in %.1f s", time.monotonic() - started)
        note: str | None = None
        if config.batch_invariant_flash:
            note = probes.finding(ctx, backend.build_facts())
            if note is not None:  # attention without flash, probed in its turn
                ctx.close()
                config, flash_note = _without_flash(config, note)
                ctx = LlamaContext(config, halt)
        if not config.batch_invariant_flash:
            note = probes.exact(ctx)
        info = ctx.info()
        halt.release()
        info = dataclasses.replace(info, exact=note is None, exact_note=note or "", flash_note=flash_note)
        scratch = backend.Scratch(gpu=bool(backend.gpus(ctx.devices)))
        # NOTE: the KV buffers are written once now (all slots): a slot's first load after a
        # start otherwise faulted in its pages, 20-30 ms of a 1,900-token restore.
        ctx.wipe()
        if info.layout is not None:
            # Mapped now, not by the first restore after a start: a state of one full slot,
            # up to a limit (np.zeros would leave the pages unmapped until written).
            bound = min(pieces.blob_bound(info.layout, config.ctx_per_session), _PREMAPPED)
            scratch.take(bound).fill(0)
            # As much again, freed at once: glibc keeps it (heap.keep_freed_memory), so the
            # first export and block reads after a start find memory mapped, as later ones do.
            np.empty(bound, np.uint8).fill(0)
    except BaseException:
        ctx.close()
        raise
    return ctx, info, scratch


def _known_attention(config: ContextConfig) -> tuple[ContextConfig, str]:
    """The config to open: exact mode's batch-invariant flash attention is not tried again
    where the probe cache already holds that it is not exact here."""
    if not config.batch_invariant_flash:
        return config, ""
    kernel_environment(config)  # the probe's key holds ggml's environment
    known, found = probes.kept(config, backend.build_facts())
    return _without_flash(config, found) if known and found is not None else (config, "")


def _without_flash(config: ContextConfig, found: str) -> tuple[ContextConfig, str]:
    """Exact mode without flash attention, and why (said once, in one line)."""
    note = f"flash attention is not batch-invariant on this llama.cpp build and machine ({found})"
    log.warning("exact mode evaluates without flash attention: %s", note)
    return dataclasses.replace(config, exact_flash=False), note
