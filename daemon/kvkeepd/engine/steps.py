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
a long prompt is answered after the step under way and one short step of its own.

The chunk is sized by time (`Pace`): a token's cost grows with the context it attends to
(for the default model on two cores, 2.8 ms a token over a 1,024-token prompt, 4.9 ms over
an 8,000-token one), so a fixed chunk that makes a short step early in a long prompt makes
a long one at its end. The
engine times each shared step and gives the next one as many prompt tokens as keep it near
`--step-target`, at most `--prefill-chunk`. Smaller chunks cost more per token (each step
reads the weights again, and threads wait on each other): `scripts/bench fairness` measures
the three figures this trades.

Chunking changes no token's logits in exact mode: each session's cells are a stream of their
own, attention reads only its own stream, and the start-up probe checks that a token's
logits do not depend on the chunk it was evaluated in, alone or beside another sequence
(design/exactness.md).
"""

from __future__ import annotations

from collections.abc import Sequence

#: The fewest prompt tokens a shared step takes, however slow tokens are: below it a step's
#: fixed cost (the weights read once per step) outweighs its tokens.
MIN_CHUNK = 16
#: How much each timed step moves the estimate of a token's cost (an exponential average).
_WEIGHT = 0.3


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


class Pace:
    """How many prompt tokens a step shared with other work takes: as many as keep it near
    `target` seconds by the cost per token of the steps timed before it, within
    [MIN_CHUNK, most]; `most` where `target` is 0 or before any step was timed.

    The estimate is seconds per token of whole steps (their fixed cost spread over their
    tokens), so it settles where a step takes about `target`. Owned by the engine's thread.
    """

    def __init__(self, target: float, most: int) -> None:
        self.target = target
        self.most = most
        self._per_token = 0.0

    def chunk(self) -> int:
        if self.target <= 0 or self._per_token <= 0:
            return self.most
        return max(MIN_CHUNK, min(self.most, int(self.target / self._per_token)))

    def took(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` tokens (a prompt chunk of at least MIN_CHUNK among them) took
        `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        per_token = seconds / tokens
        old = self._per_token
        self._per_token = per_token if old <= 0 else old + _WEIGHT * (per_token - old)
