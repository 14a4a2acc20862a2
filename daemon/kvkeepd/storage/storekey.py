"""The store key: the HMAC key of manifests and journal records.

Daemons that share a catalog and a block store share it. It comes from the settings — a
file (`--store-key-file`: a Kubernetes secret mounted as a file, systemd's
`LoadCredential=`) or the `KVKEEP_STORE_KEY` variable — else from `state-dir/store.key`,
made (32 random bytes, owner-only) at the first start. A key given by the settings is
never written to the state directory: it stays where the operator keeps secrets.

A key is 32 bytes, given raw or as 64 hexadecimal digits. The daemon names it by its
fingerprint, the first 16 digits of its id (keyed BLAKE2b of a constant, which the catalog
also records): enough to tell two keys apart in logs, nothing from which the key follows.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvkeepd.files import fsync_dir, write_new

KEY_BYTES = 32
FILE_NAME = "store.key"
_HEX = re.compile(rb"^[0-9a-fA-F]{64}$")


def key_id(key: bytes) -> str:
    """The key's id: keyed BLAKE2b of a constant (the catalog records it)."""
    return hashlib.blake2b(b"kvkeep store key id", key=key, digest_size=16).hexdigest()


@dataclass(frozen=True, repr=False)
class StoreKey:
    """The key and where it came from (for the start's log line)."""

    key: bytes
    origin: str

    @property
    def fingerprint(self) -> str:
        return key_id(self.key)[:16]

    def __repr__(self) -> str:  # never the key
        return f"StoreKey({self.fingerprint}, {self.origin})"


def parse_key(data: bytes, where: str) -> bytes:
    """32 bytes from a key's text: raw, or 64 hex digits (surrounding whitespace ignored);
    OSError naming `where` otherwise."""
    text = data.strip()
    if _HEX.match(text):
        return bytes.fromhex(text.decode())
    if len(data) == KEY_BYTES:
        return data
    raise OSError(
        f"{where} is not a store key: it takes 32 bytes, or 64 hexadecimal digits "
        f"(e.g. from `openssl rand -hex 32`)"
    )


def store_key(state_dir: Path, *, text: str = "", file: Path | None = None) -> StoreKey:
    """The store key: `text` (the store-key setting), else the contents of `file`, else
    `state_dir/store.key` (made now if absent). A key given by the settings while the state
    directory holds another one is refused (OSError): its manifests would all be refused."""
    given: StoreKey | None = None
    if text:
        given = StoreKey(parse_key(text.encode(), "the store-key setting"), "the store-key setting")
    elif file is not None:
        given = StoreKey(parse_key(file.read_bytes(), str(file)), f"file {file}")
    path = state_dir / FILE_NAME
    if given is None:
        return StoreKey(_own_key(path, state_dir), f"{path}")
    try:
        held = parse_key(path.read_bytes(), str(path))
    except FileNotFoundError:
        return given
    if held != given.key:
        raise OSError(
            f"{path} holds another store key (fingerprint {key_id(held)[:16]}) than {given.origin} "
            f"({given.fingerprint}): the state directory's manifests are signed with it; remove "
            "the file if they are not needed, or give that key"
        )
    return given


def _own_key(path: Path, state_dir: Path) -> bytes:
    """The state directory's own key, made once: 32 random bytes, readable by owner only."""
    key = secrets.token_bytes(KEY_BYTES)
    try:
        write_new(path, key)
    except FileExistsError:
        return parse_key(path.read_bytes(), str(path))
    fsync_dir(state_dir)
    return key
