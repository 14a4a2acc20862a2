"""Sampling parameters: a session's, and the fields a request overrides."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np
import numpy.typing as npt

from kvkeepd.errors import InvalidRequest

Logits = npt.NDArray[np.float32]

MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """A session's sampling parameters. `seed` is always set once a session exists.

    The one declaration of the sampling fields: the proto writes them out (a format),
    everything else, the manifest included, derives them from this class's fields."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    penalty_last_n: int = 64
    seed: int = 0

    def validate(self) -> SamplingParams:
        """Raise InvalidRequest for any value a sampler cannot use; return self."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidRequest(f"{f.name} must be a finite number, got {value}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 <= self.top_k <= 1_000_000:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repeat_penalty <= 10.0:
            raise InvalidRequest(f"repeat_penalty must be in (0, 10], got {self.repeat_penalty}")
        if self.penalty_last_n < -1:
            raise InvalidRequest(f"penalty_last_n must be >= -1, got {self.penalty_last_n}")
        if not 0 <= self.seed <= MAX_SEED:
            raise InvalidRequest(f"seed must be in [0, 2^64), got {self.seed}")
        return self

    def merged(self, overrides: SamplingOverrides) -> SamplingParams:
        """This value with the overrides' fields replaced, validated."""
        changes = dict(overrides.values)
        return replace(self, **changes).validate() if changes else self  # type: ignore[arg-type]


SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))


@dataclass(frozen=True)
class SamplingOverrides:
    """Sampling fields a request or a session creation gives (the others keep their value):
    a subset of SamplingParams' fields, by name (`of` checks them)."""

    values: tuple[tuple[str, float | int], ...] = ()

    @staticmethod
    def of(**given: float | int | None) -> SamplingOverrides:
        """The fields given (None: not given); a name that is no sampling field is a bug."""
        unknown = set(given) - set(SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"no sampling fields {sorted(unknown)}")
        return SamplingOverrides(tuple((k, v) for k, v in given.items() if v is not None))

    def get(self, name: str) -> float | int | None:
        return dict(self.values).get(name)

    def apply(self, base: SamplingParams) -> SamplingParams:
        return base.merged(self)

    def without(self, name: str) -> SamplingOverrides:
        return SamplingOverrides(tuple((k, v) for k, v in self.values if k != name))
