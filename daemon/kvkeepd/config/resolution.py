"""Where each setting's value comes from: flag > environment (KVKEEP_*) > config file >
default, resolved once into Settings (`resolve`, called by `kvkeep serve`), and the
effective settings as `--print-config` prints them (`Resolved.describe`).

Every setting is read through its declaration (kvkeepd.config.settings, kvkeepd.config.option), so a
new setting needs nothing here.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvkeepd.config.settings import ConfigError, Settings, options


@dataclass(frozen=True)
class Resolved:
    """Settings, and for each setting's key where its value came from."""

    settings: Settings
    origins: dict[str, str]

    def describe(self) -> str:
        """Every setting's effective value and origin, as a TOML file `--config` reads back."""
        lines = ["# kvkeep serve: the effective settings; each comment says where the value came from."]
        for option in options():
            value = getattr(self.settings, option.field)
            text = f"# {option.key} is not set" if value is None else f"{option.key} = {option.show(value)}"
            lines.append(f"{text:<44} # {self.origins[option.key]}")
        return "\n".join(lines)


def read_config_file(path: Path) -> dict[str, object]:
    """A TOML file's settings by key (dashes or underscores); ConfigError for an unreadable
    file, or a key that is no setting."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("config", f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{path} is not valid TOML: {e}") from None
    known = {o.key for o in options()}
    out: dict[str, object] = {}
    for name, value in data.items():
        key = name.replace("_", "-")
        if key not in known:
            raise ConfigError(name, "no such setting", f"file {path}")
        if key in out:
            raise ConfigError(name, "given twice", f"file {path}")
        out[key] = value
    return out


def resolve(
    flags: Mapping[str, Any], environ: Mapping[str, str], config_file: Path | None = None
) -> Resolved:
    """Settings from flags (by field name; None: not given) > environment > file > defaults,
    validated. ConfigError names the setting and where its value came from."""
    from_file = read_config_file(config_file) if config_file is not None else {}
    values: dict[str, object] = {}
    origins: dict[str, str] = {}
    for option in options():
        raw: object
        if flags.get(option.field) is not None:
            raw, origin = flags[option.field], f"flag {option.flag}"
        elif option.env in environ:
            raw, origin = environ[option.env], f"environment {option.env}"
        elif option.key in from_file:
            raw, origin = from_file[option.key], f"file {config_file}"
        else:
            origins[option.key] = "default"
            continue
        try:
            values[option.field] = option.parse(raw)
        except ValueError as e:
            raise ConfigError(option.key, str(e), origin) from None
        origins[option.key] = origin
    try:
        settings = Settings(**values).validate()  # type: ignore[arg-type]
    except ConfigError as e:
        raise e.at(origins.get(e.key, "")) from None
    return Resolved(settings, origins)
