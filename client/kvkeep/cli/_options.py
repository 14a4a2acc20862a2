"""Options that several commands share: a reply's length and sampling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from kvkeep._types import SamplingParams

_F = TypeVar("_F", bound=Callable[..., Any])

#: Tokens a reply may take unless --max-tokens says otherwise: a chatty model would otherwise
#: talk to the end of the session's context, after which every turn is refused.
DEFAULT_MAX_TOKENS = 512


def sampling_options(f: _F) -> _F:
    """--temperature and --seed."""
    f = click.option("--seed", type=int, help="Sampling seed, for repeatable output.")(f)
    return click.option("--temperature", type=float, help="Sampling temperature; 0 is greedy.")(f)


def max_tokens_option(f: _F) -> _F:
    """--max-tokens, DEFAULT_MAX_TOKENS unless given."""
    return click.option(
        "--max-tokens",
        type=click.IntRange(min=0),
        metavar="N",
        default=DEFAULT_MAX_TOKENS,
        show_default=True,
        help="Stop each reply after N tokens (0: only at the end of the session's context).",
    )(f)


def token_limit(max_tokens: int) -> int | None:
    """--max-tokens as the SDK takes it (0: no limit)."""
    return max_tokens or None


def sampling_params(temperature: float | None, seed: int | None) -> SamplingParams | None:
    """The sampling options given, None if none was."""
    if temperature is None and seed is None:
        return None
    return SamplingParams(temperature=temperature, seed=seed)
