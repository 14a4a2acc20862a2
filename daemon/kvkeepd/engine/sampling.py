"""Token sampling that is identical whether a session runs fresh or resumed.

The filtering chain runs on a copy of one logits row, in llama.cpp's default order, after
a structured-output mask where there is one (structured_output.py): repetition penalty over
the last `penalty_last_n` tokens of history (prompt included), top-k, top-p, min-p, then
temperature. Draw i of a session takes its uniform from
numpy's counter-based Philox generator keyed by (seed, i), so the RNG position is a
single integer that survives checkpoints and is the same on every platform.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvkeepd.values.sampling import Logits, SamplingParams


def uniform(seed: int, draw: int) -> float:
    """The uniform in [0, 1) of draw number `draw` of a session seeded with `seed`."""
    bits = np.random.Philox(key=seed, counter=draw).random_raw()
    # 53 high bits, as numpy's own double conversion does.
    return float(int(bits) >> 11) * (1.0 / 9007199254740992.0)


def _penalizes(history: Sequence[int], penalty: float, last_n: int) -> bool:
    """Whether the repetition penalty changes any logit."""
    return penalty != 1.0 and last_n != 0 and bool(history)


def apply_penalty(row: Logits, history: Sequence[int], penalty: float, last_n: int) -> Logits:
    """llama.cpp's repetition penalty over the last `last_n` history tokens (-1: all)."""
    if not _penalizes(history, penalty, last_n):
        return row
    window = history if last_n < 0 else history[-last_n:]
    ids = np.unique(np.asarray(window, dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < row.shape[0])]
    vals = row[ids]
    row[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return row


def sample(
    logits: Logits,
    history: Sequence[int],
    params: SamplingParams,
    draw: int,
    allowed: npt.NDArray[np.bool_] | None = None,
) -> int:
    """Pick the next token from one logits row, among the `allowed` ones (a grammar's mask;
    None: all). Does not modify `logits`."""
    greedy = params.temperature <= 0.0 and logits.dtype == np.float32
    if greedy and allowed is None and not _penalizes(history, params.repeat_penalty, params.penalty_last_n):
        # Greedy with nothing to change the row: its argmax, without copying it first.
        return int(np.argmax(logits))
    row = logits.astype(np.float32, copy=True)
    if allowed is not None:
        # -inf before anything else: masked tokens take no part in top-k, top-p or min-p.
        row[~allowed] = -np.inf
    row = apply_penalty(row, history, params.repeat_penalty, params.penalty_last_n)
    if params.temperature <= 0.0:
        return int(np.argmax(row))
    n_vocab = row.shape[0]
    if 0 < params.top_k < n_vocab:
        candidates = np.argpartition(-row, params.top_k - 1)[: params.top_k]
    else:
        candidates = np.arange(n_vocab)
    # Sort by logit, descending; ties broken by token id so the order is total.
    order = np.lexsort((candidates, -row[candidates]))
    candidates = candidates[order]
    cand_logits = row[candidates].astype(np.float64)
    probs = np.exp(cand_logits - cand_logits[0])
    probs /= probs.sum()
    # Masked tokens sort last; none of them may be drawn, not even by rounding at the edge.
    keep = int(np.count_nonzero(np.isfinite(cand_logits))) if allowed is not None else len(candidates)
    if params.top_p < 1.0:
        cumulative = np.cumsum(probs)
        keep = min(keep, int(np.searchsorted(cumulative, params.top_p)) + 1)
    if params.min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(probs[:keep] >= params.min_p * probs[0]))))
    scaled = cand_logits[:keep] / params.temperature
    final = np.exp(scaled - scaled[0])
    cumulative = np.cumsum(final)
    target = uniform(params.seed, draw) * cumulative[-1]
    index = min(int(np.searchsorted(cumulative, target, side="right")), keep - 1)
    return int(candidates[index])


def top_logprobs(logits: Logits, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of `token` under the model's raw distribution, and the top `n`."""
    row = logits.astype(np.float64)
    shifted = row - row.max()
    log_z = math.log(float(np.exp(shifted).sum()))
    logprobs = shifted - log_z
    top: list[tuple[int, float]] = []
    if n > 0:
        ids = np.argpartition(-logprobs, n - 1)[:n]
        ids = ids[np.lexsort((ids, -logprobs[ids]))]
        top = [(int(i), float(logprobs[i])) for i in ids]
    return float(logprobs[token]), top
