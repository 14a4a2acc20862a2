"""Step planning: which tokens of which generations go into the next batch.

Continuous batching: every active generation contributes its pending tokens to one batch.
A decoding session (one pending token: the last sampled one) always gets its token in;
sessions with prompt left share the rest of the batch. While anything else is decoding,
prompt chunks stay small, so that other streams keep moving (a 512-token chunk stalls
them about a second on two cores).
"""

from __future__ import annotations

from collections.abc import Sequence

# Tokens of a prompt chunk while other sessions decode or other prompts share the batch.
BUSY_PREFILL_CHUNK = 64


def plan(pending: Sequence[int], batch_size: int) -> list[int]:
    """How many tokens each generation puts into the batch, given its pending count.

    Generations with nothing pending (their next token is sampled from stored logits) get 0.
    """
    decoding = sum(1 for p in pending if p == 1)
    prefilling = sum(1 for p in pending if p > 1)
    if not prefilling:
        return [1 if p == 1 else 0 for p in pending]
    budget = batch_size - decoding
    share = max(budget // prefilling, 1)
    chunk = min(share, BUSY_PREFILL_CHUNK) if (decoding or prefilling > 1) else share
    out = []
    used = decoding
    for p in pending:
        if p == 1:
            out.append(1)
        elif p > 1:
            take = max(0, min(p, chunk, batch_size - used))
            out.append(take)
            used += take
        else:
            out.append(0)
    return out
