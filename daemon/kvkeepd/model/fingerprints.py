"""Model files: identity by content fingerprint, cached by (path, size, mtime)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from kvkeepd.files import read_private, write_private

log = logging.getLogger(__name__)

_CHUNK = 8 * 1024 * 1024


def fingerprint(path: Path, cache_dir: Path) -> str:
    """BLAKE2b-256 of the whole file, hex. Reuses a cached value while size and mtime match."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    cache_file = cache_dir / "fingerprints.json"
    cache: dict[str, str] = {}
    try:
        loaded = json.loads(read_private(cache_file))
        if isinstance(loaded, dict):
            cache = {str(k): str(v) for k, v in loaded.items()}
    except (OSError, ValueError):
        pass
    if key in cache:
        return cache[key]
    digest = hashlib.blake2b(digest_size=32)
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    value = digest.hexdigest()
    cache[key] = value
    try:
        write_private(cache_file, json.dumps(cache).encode())
    except OSError as e:  # a read-only state dir only costs a re-hash next time
        log.warning("cannot cache the model fingerprint: %s", e)
    return value
