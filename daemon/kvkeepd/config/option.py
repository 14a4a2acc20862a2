"""A setting's declaration, and how flags, environment variables and file keys read it.

`Spec` is what a field of a settings dataclass declares besides its type and default (made
with `spec(...)`); `declared` turns those fields into `Option`s, which parse a value from
text or TOML, check its bounds, and show it as --help and --print-config do. Which settings
there are is kvkeepd.config.settings's; where each value comes from is kvkeepd.config.resolution's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvkeepd.urls import redacted

ENV_PREFIX = "KVKEEP_"

_SPEC = "kvkeep"
_BYTE_UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_BYTES = re.compile(r"^\s*(\d+)\s*([kmgt]ib)?\s*$", re.IGNORECASE)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Spec:
    """What a setting's declaration says besides its type and default."""

    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    multiple_of: int = 0
    # "bytes": an integer that may carry a KiB/MiB/GiB/TiB suffix.
    unit: str = ""
    # A path that must name an existing file.
    file: bool = False
    # A prefix of values that stand for a file fetched at start instead (`hf:`).
    fetched: str = ""
    # The name of flag, variable and file key, when not the field's (`model` for model_path).
    key: str = ""
    # How --help shows a default computed at start (the CPU count, a path), or what an
    # empty default means (sqlite in the state directory, off).
    shown: str = ""
    # A URL that may carry a password: --print-config shows it as `***`.
    url: bool = False
    # A secret: --print-config shows `***` for it, whatever it is.
    secret: bool = False


class ConfigError(ValueError):
    """A setting is missing, malformed or out of bounds; raised before anything heavy starts.

    `key` names the setting as the outside sees it (`ctx-per-session`), `origin` where the
    value came from (`flag --ctx-per-session`, `environment KVKEEP_...`, `file PATH`)."""

    def __init__(self, key: str, problem: str, origin: str = "") -> None:
        super().__init__(key, problem, origin)
        self.key = key
        self.problem = problem
        self.origin = origin

    def at(self, origin: str) -> ConfigError:
        return ConfigError(self.key, self.problem, origin)

    def __str__(self) -> str:
        where = f" ({self.origin})" if self.origin else ""
        return f"{self.key}{where}: {self.problem}"


def spec(help: str, **bounds: Any) -> dict[str, Spec]:
    """The metadata of a setting's field: its help and the other fields of Spec."""
    return {_SPEC: Spec(help, **bounds)}


@dataclass(frozen=True)
class Option:
    """One declared setting: `key` is its flag (`--key`), its file key and, upper-cased,
    its environment variable."""

    field: str
    key: str
    kind: type
    optional: bool
    spec: Spec
    _field: dataclasses.Field[object]

    def default(self) -> object:
        if self._field.default_factory is not dataclasses.MISSING:
            return self._field.default_factory()
        return self._field.default

    @property
    def flag(self) -> str:
        return f"--{self.key}"

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper().replace("-", "_")

    @property
    def metavar(self) -> str:
        if self.spec.choices:
            return "[" + "|".join(self.spec.choices) + "]"
        if self.spec.unit == "bytes":
            return "BYTES"
        return {int: "INTEGER", float: "NUMBER", Path: "PATH"}.get(self.kind, "TEXT")

    def bounds(self) -> str:
        """The bounds in words ("" if none)."""
        s = self.spec
        if s.choices:
            return "one of " + ", ".join(s.choices)
        parts = []
        if s.low is not None and s.high is not None:
            parts.append(f"in [{_number(s.low)}, {_number(s.high)}]")
        elif s.low is not None:
            parts.append(f">= {_number(s.low)}")
        if s.multiple_of:
            parts.append(f"a multiple of {s.multiple_of}")
        return ", ".join(parts)

    def shown_default(self) -> str:
        """The default as --help shows it."""
        if self.spec.shown:
            return self.spec.shown
        value = self.default()
        if value is None or value == "":
            return "none"
        if isinstance(value, bool):
            return "on" if value else "off"
        if self.spec.unit == "bytes" and isinstance(value, int):
            unit = next(
                (u for u in ("TiB", "GiB", "MiB", "KiB") if value and value % _BYTE_UNITS[u.lower()] == 0), ""
            )
            if unit:
                return f"{value // _BYTE_UNITS[unit.lower()]}{unit}"
        return self.show(value)

    def parse(self, raw: object) -> object:
        """A value from a flag or variable (text) or a TOML file (text, number or bool);
        ValueError says what is wrong."""
        if self.optional and raw == "":
            return None
        if self.kind is bool:
            return _parse_bool(raw)
        if self.kind is int:
            return _parse_int(raw, self.spec.unit == "bytes")
        if self.kind is float:
            return _parse_float(raw)
        if not isinstance(raw, str):
            raise ValueError(f"not a string: {raw!r}")
        if self.kind is Path and not raw:
            raise ValueError("must not be empty")
        return Path(raw) if self.kind is Path else raw

    def check(self, value: object) -> str:
        """What is wrong with a value of the right type ("" if nothing)."""
        s = self.spec
        if value is None:
            return "" if self.optional else "must be set"
        if s.choices and value not in s.choices:
            return f"must be {self.bounds()}, got {value!r}"
        if isinstance(value, int | float) and not isinstance(value, bool):
            too_low = s.low is not None and value < s.low
            too_high = s.high is not None and value > s.high
            if too_low or too_high or (s.multiple_of and int(value) % s.multiple_of):
                return f"must be {self.bounds()}, got {_number(value)}"
        # An empty path is one not given (the model's, when none is installed): the
        # settings' own validation says so.
        fetched = bool(s.fetched) and str(value).startswith(s.fetched)
        if s.file and isinstance(value, Path) and value != Path("") and not fetched and not value.is_file():
            return f"no file {value}"
        return ""

    def show(self, value: object) -> str:
        """A value as TOML writes it (a URL's password as `***`)."""
        if self.spec.url and isinstance(value, str):
            value = redacted(value)
        if self.spec.secret and value:
            value = "***"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, int | float):
            return _number(value)
        return json.dumps(str(value), ensure_ascii=False)  # a JSON string is a TOML basic string


def _parse_bool(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
        return raw.strip().lower() in _TRUE
    raise ValueError(f"not a boolean (true or false): {raw!r}")


def _parse_int(raw: object, size: bool) -> int:
    """An integer; a size may carry a binary suffix (`512MiB`)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        if size and (m := _BYTES.match(raw)):
            return int(m[1]) * _BYTE_UNITS[(m[2] or "").lower()]
        if re.fullmatch(r"\s*[-+]?\d+\s*", raw):
            return int(raw)
    suffix = " (or with a KiB, MiB, GiB or TiB suffix)" if size else ""
    raise ValueError(f"not an integer{suffix}: {raw!r}")


def _parse_float(raw: object) -> float:
    value: float | None = None
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw)
        except ValueError:
            value = None
    if value is None or not math.isfinite(value):
        raise ValueError(f"not a number: {raw!r}")
    return value


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and not isinstance(value, float) else repr(value)


def declared(settings: type) -> tuple[Option, ...]:
    """The settings a dataclass declares (each field made with `spec`), in its order."""
    hints = typing.get_type_hints(settings)
    out = []
    for f in dataclasses.fields(settings):
        spec = f.metadata[_SPEC]
        hint = hints[f.name]
        optional = isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
        kind = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
        out.append(Option(f.name, spec.key or f.name.replace("_", "-"), kind, optional, spec, f))
    return tuple(out)
