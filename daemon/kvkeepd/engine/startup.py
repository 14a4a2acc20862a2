"""The engine's start, on its thread: the model loaded and its context made, the start-up
exactness probe run (probes.py), and the memory the first restores would otherwise fault in
mapped. A start given up from another thread (a Halt set) stops at the load's next progress
report or the probe's next graph node."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from kvkeepd.engine import backend, probes
from kvkeepd.engine.context import ContextConfig, LlamaContext, ModelInfo
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
    ctx = LlamaContext(config, halt)
    try:
        log.info("model loaded in %.1f s", time.monotonic() - started)
        info = ctx.info()
        note = probes.exact(ctx)
        halt.release()
        info = dataclasses.replace(info, exact=note is None, exact_note=note or "")
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
