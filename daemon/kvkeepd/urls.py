"""Where a daemon's stores and catalog are: the URLs of `--store` and `--catalog`, checked and
shown without their passwords. A leaf: the settings check these values, the storage backends
connect to them.
"""

from __future__ import annotations

import re
import urllib.parse


def redacted(url: str) -> str:
    """A URL with its password replaced by `***` (for logs and --print-config)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    auth, _, host = rest.rpartition("@")
    user, colon, _ = auth.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}"


_CATALOG_PREFIX = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def catalog_url(url: str) -> tuple[str, str]:
    """(the URL the Redis client connects to, the key prefix) of a `--catalog` value,
    `redis://[:PASSWORD@]HOST:PORT/DB?prefix=NAME` (also `rediss://`, `unix://`); the
    prefix defaults to `kvkeep`. ValueError says what is wrong."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"must be empty (sqlite) or a redis://, rediss:// or unix:// URL, got {redacted(url)!r}"
        )
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    prefixes = [v for k, v in query if k == "prefix"]
    prefix = prefixes[-1] if prefixes else "kvkeep"
    if not _CATALOG_PREFIX.match(prefix):
        raise ValueError(f"prefix must be 1-64 letters, digits, '.', '_' or '-', got {prefix[:80]!r}")
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "prefix"])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), prefix


def is_local(address: str) -> bool:
    """Whether an address is a unix socket or on loopback."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


# S3's bucket names: 3-63 lower-case letters, digits, dots and hyphens.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def store_problem(store: str) -> str:
    """What is wrong with a --store value ("" if nothing)."""
    if store == "local":
        return ""
    if store.startswith("s3://"):
        bucket, _, prefix = store.removeprefix("s3://").partition("/")
        if not _BUCKET.match(bucket):
            return f"the bucket of an s3:// store must be 3-63 of a-z, 0-9, '.' and '-', got {bucket!r}"
        if any(c.isspace() for c in prefix) or "//" in prefix.strip("/"):
            return f"the prefix of an s3:// store must not hold spaces or '//', got {prefix!r}"
        return ""
    if store.startswith(("redis://", "rediss://")):
        host = store.partition("://")[2].rpartition("@")[2]
        if not re.match(r"^[^/\s]+(/\d+)?/?$", host):
            return "a redis:// store is redis://[USER:PASSWORD@]HOST[:PORT][/DB]"
        return ""
    return "must be local, s3://BUCKET/PREFIX, redis://HOST:PORT/DB or rediss://..."
