"""A block store in RAM: ephemeral sessions' checkpoints, which never touch the disk."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvkeepd.storage.blocks.base import check_key


class MemoryBlockStore:
    in_process = True
    remote = False

    def __init__(self) -> None:
        self._blocks: dict[str, bytes] = {}
        self._bytes = 0

    def has(self, key: str) -> bool:
        return check_key(key) in self._blocks

    def present(self, keys: Sequence[str]) -> set[str]:
        return {k for k in keys if self.has(k)}

    def get(self, key: str) -> bytes:
        return self._blocks[check_key(key)]

    def read_into(self, key: str, parts: Sequence[memoryview]) -> bool:
        """Its blocks are in RAM already: a `get` copies nothing."""
        return False

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        return {k: self._blocks[k] for k in keys if self.has(k)}

    def put(self, key: str, data: bytes) -> int:
        if check_key(key) in self._blocks:
            return 0
        self._blocks[key] = bytes(data)
        self._bytes += len(data)
        return len(data)

    def delete(self, key: str) -> None:
        data = self._blocks.pop(check_key(key), None)
        if data is not None:
            self._bytes -= len(data)

    def block_keys(self) -> Iterator[str]:
        return iter(list(self._blocks))

    def total_bytes(self) -> int:
        return self._bytes
