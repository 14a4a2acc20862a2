"""Generated tokens' log probabilities as OpenAI's chat completions and Responses API write them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvkeepd.values.generation import GeneratedToken


def logprobs(tokens: Sequence[GeneratedToken], top: int) -> list[dict[str, Any]]:
    """Each token with its log probability and bytes, and the `top` likeliest in its place."""
    return [
        {
            "token": g.sampled.text,
            "logprob": g.sampled.logprob,
            "bytes": list(g.sampled.text.encode()),
            "top_logprobs": [
                {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())} for t in g.top[:top]
            ],
        }
        for g in tokens
    ]
