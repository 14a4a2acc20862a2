"""Tenants: who a caller is (a bearer token), what they may hold (quotas), and the salt that
keeps their cached prompt blocks apart from everybody else's.

The auth file is TOML, one table per tenant:

    [tenants.alice]
    tokens = ["..."]               # bearer tokens (16+ characters)
    max_sessions = 100             # optional quotas; else --tenant-quota's
    max_parked_bytes = 1_000_000_000
    max_stored_bytes = 5_000_000_000

Tokens are kept as SHA-256 digests only; a presented token's digest is compared with every
known one in constant time, and tokens are never logged. Without an auth file the daemon
serves one anonymous tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvkeepd.errors import InvalidRequest, Unauthenticated

log = logging.getLogger(__name__)

ANONYMOUS = ""
MIN_TOKEN = 16
MIN_SALT = 16
MAX_SALT = 256
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class AuthFileError(ValueError):
    """The auth file cannot be used; the message names the problem (never a token)."""


@dataclass(frozen=True)
class Quota:
    """Limits of one tenant; 0 means none."""

    max_sessions: int = 0
    max_parked_bytes: int = 0
    max_stored_bytes: int = 0


@dataclass(frozen=True)
class Tenant:
    name: str
    quota: Quota = field(default_factory=Quota)

    @property
    def salt(self) -> bytes:
        """The cache salt of this tenant's blocks when a session gives none of its own."""
        return hashlib.blake2b(b"kvkeep-tenant\0" + self.name.encode(), digest_size=32).digest()


def session_salt(tenant: Tenant, cache_salt: bytes) -> bytes:
    """The salt a session's blocks are keyed with: its tenant's, or one it chose (shared by
    whoever presents the same bytes, across tenants)."""
    if not cache_salt:
        return tenant.salt
    if not MIN_SALT <= len(cache_salt) <= MAX_SALT:
        raise InvalidRequest(
            f"cache_salt must have {MIN_SALT} to {MAX_SALT} bytes, got {len(cache_salt)}", "cache_salt"
        )
    return hashlib.blake2b(b"kvkeep-salt\0" + cache_salt, digest_size=32).digest()


def check_salt(tenant: Tenant, cache_salt: bytes, salt: bytes) -> None:
    """Refuse a request that gives a `cache_salt` other than the one a session's blocks are
    keyed with (`salt`): a session keeps the salt it was made with (none given: any)."""
    if cache_salt and session_salt(tenant, cache_salt) != salt:
        raise InvalidRequest(
            "cache_salt differs from the session's: a session keeps the cache salt it was made with",
            "cache_salt",
        )


class Tenants:
    """The tenants a daemon serves and the tokens that name them."""

    def __init__(self, tenants: dict[str, Tenant], tokens: dict[bytes, str], default_quota: Quota) -> None:
        self._tenants = tenants
        self._by_digest = tokens
        self.default_quota = default_quota

    @property
    def authenticated(self) -> bool:
        """Whether callers must present a token (an auth file was given)."""
        return bool(self._by_digest)

    @classmethod
    def anonymous(cls, quota: Quota = Quota()) -> Tenants:
        return cls({ANONYMOUS: Tenant(ANONYMOUS, quota)}, {}, quota)

    @classmethod
    def load(cls, path: Path, default_quota: Quota) -> Tenants:
        """Read an auth file; AuthFileError if anything in it is off."""
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise AuthFileError(f"cannot read the auth file {path}: {e}") from None
        tables = data.get("tenants")
        if not isinstance(tables, dict) or not tables:
            raise AuthFileError(f"{path}: no [tenants.NAME] tables")
        tenants: dict[str, Tenant] = {}
        digests: dict[bytes, str] = {}
        for name, table in tables.items():
            if not isinstance(table, dict) or not name or not set(name) <= _NAME_CHARS:
                raise AuthFileError(f"{path}: tenant {name[:40]!r}: a name of letters, digits, _ - .")
            tokens = table.get("tokens")
            if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
                raise AuthFileError(f"{path}: tenant {name}: tokens must be a list of strings")
            for token in tokens:
                if len(token) < MIN_TOKEN:
                    raise AuthFileError(f"{path}: tenant {name}: tokens need {MIN_TOKEN}+ characters")
                digest = _digest(token)
                if digest in digests:
                    raise AuthFileError(f"{path}: tenant {name}: a token is given twice")
                digests[digest] = name
            tenants[name] = Tenant(name, _quota(path, name, table, default_quota))
        return cls(tenants, digests, default_quota)

    def resolve(self, authorization: str | None) -> Tenant:
        """The tenant a request's `authorization` metadata names; Unauthenticated if none."""
        if not self.authenticated:
            return self._tenants[ANONYMOUS]
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("a bearer token is required (authorization: Bearer TOKEN)")
        digest = _digest(token.strip())
        found = None
        for known, name in self._by_digest.items():  # every one, in constant time each
            if hmac.compare_digest(known, digest):
                found = name
        if found is None:
            raise Unauthenticated("the token is not valid")
        return self._tenants[found]

    def replace_with(self, other: Tenants) -> None:
        """Take the tenants of an auth file read again (SIGHUP), in place: whoever holds
        this object (the doors, the Residency's quotas) sees them from now on."""
        self._tenants, self._by_digest, self.default_quota = (
            other._tenants,
            other._by_digest,
            other.default_quota,
        )

    def get(self, name: str) -> Tenant:
        """A tenant by name (sessions loaded at start name theirs); unknown names keep the
        default quota, so that a tenant removed from the auth file keeps its data."""
        return self._tenants.get(name) or Tenant(name, self.default_quota)

    def stored_quota(self, name: str) -> int:
        """A tenant's stored-bytes quota by its name (0: none), as the auth file has it now."""
        return self.get(name).quota.max_stored_bytes

    @property
    def names(self) -> list[str]:
        return sorted(self._tenants)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _quota(path: Path, name: str, table: dict[str, Any], default: Quota) -> Quota:
    values = {}
    for key in ("max_sessions", "max_parked_bytes", "max_stored_bytes"):
        value = table.get(key, getattr(default, key))
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise AuthFileError(f"{path}: tenant {name}: {key} must be an integer >= 0")
        values[key] = value
    unknown = set(table) - {"tokens", *values}
    if unknown:
        raise AuthFileError(f"{path}: tenant {name}: unknown keys {sorted(unknown)}")
    return Quota(**values)
