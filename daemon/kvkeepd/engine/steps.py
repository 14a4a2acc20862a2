"""Step planning: which tokens of which generations go into the next batch.

Continuous batching: every active generation contributes its pending tokens to one batch.
A decoding session (one pending token: the last sampled one) always gets its token in. A
prompt evaluated alone takes whole batches: that is its fastest. While anything else runs,
prompts share at most `prefill_chunk` tokens a step, the prompts with the fewest tokens
left first: a step is what everyone else waits for (a stream for its next token, a new
request for its prompt to begin), and a step's time grows with its prompt tokens, about
12 ms each for the default model at 2,000 tokens of context on two cores, more as the
context grows. Prompts that end within the step go in whole, alone with the decoding
tokens; only when none does, the shortest takes the chunk. A short request arriving beside
a long prompt is answered after the step under way and one short step of its own. Smaller
chunks cost more per token where threads wait on each other (twice the CPU time at 128
than at 512 on a loaded two-core machine, the same with one thread): `scripts/bench
fairness` measures the three figures this trades.

Chunking changes no token's logits in exact mode: each session's cells are a stream of their
own, attention reads only its own stream, and the start-up probe checks that a token's
logits do not depend on the chunk it was evaluated in, alone or beside another sequence
(design/exactness.md).
"""

from __future__ import annotations

from collections.abc import Sequence


def plan(pending: Sequence[int], batch_size: int, prefill_chunk: int) -> list[int]:
    """How many tokens each generation puts into the batch, given its pending count.

    Generations with nothing pending (their next token is sampled from stored logits) get 0.
    """
    out = [1 if p == 1 else 0 for p in pending]
    alone = sum(1 for p in pending if p) == 1
    budget = batch_size - sum(out) if alone else min(batch_size - sum(out), prefill_chunk)
    prompts = sorted((i for i, p in enumerate(pending) if p > 1), key=lambda i: pending[i])
    for i in prompts:
        if pending[i] > budget:
            # A prompt that ends in this step goes without a longer one's chunk: the step
            # stays short, and the long prompt waits one short step.
            if i == prompts[0]:
                out[i] = max(budget, 0)
            break
        out[i] = pending[i]
        budget -= pending[i]
    return out
