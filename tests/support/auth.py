"""An auth file naming tenants by their tokens, and the tokens the tests use."""

from __future__ import annotations

from pathlib import Path

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789abc"}


def write_auth(path: Path, tokens: dict[str, str], quotas: dict[str, dict[str, int]] | None = None) -> Path:
    lines = []
    for name, token in tokens.items():
        lines += [f"[tenants.{name}]", f'tokens = ["{token}"]']
        lines += [f"{k} = {v}" for k, v in (quotas or {}).get(name, {}).items()]
    path.write_text("\n".join(lines) + "\n")
    return path
