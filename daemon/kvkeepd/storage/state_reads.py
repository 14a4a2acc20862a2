"""A state read back from its blocks: each block read once and checked (frame, size,
checksum), a damaged one of the store removed; from a file store with a plain layout, each
block straight into the blob llama.cpp takes (pieces.Scatter), so that a restore from disk
copies the state once from the files and once into llama.cpp, as llama-server's slot restore
does. CheckpointStore's reading half: it checks the manifest and plans the pieces first.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from kvkeepd.errors import CorruptCheckpoint, KvkeepError
from kvkeepd.heap import state_buffer
from kvkeepd.state import cells as kvstate
from kvkeepd.state import frames as blk
from kvkeepd.state import layout as kvlayout
from kvkeepd.state import pieces
from kvkeepd.state.plan import Piece
from kvkeepd.storage.blocks.base import BlockStore

log = logging.getLogger(__name__)

Blob = npt.NDArray[np.uint8]

# Eight, whatever the cores: a restore's block reads mostly wait for the disk, and more of
# them at once keep it busy (a 47 MB state read cold in 31-35 ms with eight, 41-43 with four).
_READERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvkeep-read")


class StateReads:
    """Reads of states from `store`, whose layout this context has. `lock`: held while a
    damaged block is removed (the checkpoint store's writes hold it too)."""

    def __init__(self, store: BlockStore, layout: kvlayout.StateLayout | None, lock: threading.Lock) -> None:
        self.store = store
        self.layout = layout
        self._lock = lock

    @property
    def in_place(self) -> bool:
        """Whether states are read straight into the blob llama.cpp takes: a store of files
        (not in this process's memory, not on a server) and a plain layout."""
        local = not self.store.in_process and not self.store.remote
        return local and self.layout is not None and pieces.Scatter.fits(self.layout)

    def buffer(self, n: int) -> Blob | None:
        """Memory for a state of n positions where it is read in place (None elsewhere), to be
        allocated by the thread that will also free it: glibc then reuses one arena's freed
        states instead of faulting in tens of MB of new memory for each, as a worker thread's
        arena does. Its contents are not kept."""
        if not self.in_place or not n:
            return None
        assert self.layout is not None
        return state_buffer(pieces.Scatter.size(self.layout, n))

    def state(
        self,
        n: int,
        full: list[Piece],
        window: list[Piece],
        rec: Piece | None,
        read: Callable[[str], bytes],
        into: Blob | None = None,
    ) -> kvstate.SeqKv:
        """The state after n positions from its pieces, each read once and checked (read in
        place, into `into` if given, where the store and the layout allow)."""
        lay = self.layout
        assert lay is not None
        wanted = [*full, *window, *([rec] if rec else [])]
        ours = read == self.store.get
        if ours and self.in_place and full:
            return self._in_place(n, full, into)
        if ours and self.store.remote:
            # All at once: a remote store pipelines or parallelises what one get per piece
            # would wait for in turn.
            frames = self.store.get_many([p.key for p in wanted])
            read = frames.__getitem__  # an absent piece is the KeyError `get` gives

        def payload(p: Piece) -> bytes | memoryview:
            return self.block(p.key, p.size, read, ours=ours)[1]

        if ours and self.store.in_process:
            # Nothing to read or check (see block): handing pieces to threads cost more.
            found = {p.key: payload(p) for p in wanted}
        else:
            # File reads and CRC-32 release the GIL: pieces are read and checked on every core.
            found = dict(zip((p.key for p in wanted), _READERS.map(payload, wanted), strict=True))
        sections: list[kvstate.Section] = []
        for section in lay.sections:
            if isinstance(section, kvlayout.RecurrentLayout):
                assert rec is not None
                sections.append(pieces.recurrent_from(section, n - 1, found[rec.key]))
                continue
            mine = window if section.window else full
            runs = [pieces.piece(section, found[p.key], p.end - p.start) for p in mine]
            sections.append(pieces.cells_from(section, mine[0].start, runs))
        return pieces.build(lay, n, sections)

    def _in_place(self, n: int, full: list[Piece], into: Blob | None) -> kvstate.SeqKv:
        """The state after n positions, each piece read from its file straight into the blob
        llama.cpp takes (pieces.Scatter) and checked there. A piece that is not a raw frame
        of its size with a good checksum is read again the ordinary way (`block`), which
        decodes it, or names the damage and removes the block."""
        lay = self.layout
        assert lay is not None
        if [p.start for p in full] != [0, *(p.end for p in full[:-1])] or full[-1].end != n:
            raise CorruptCheckpoint("the checkpoint's blocks do not cover its state")
        size = pieces.Scatter.size(lay, n)
        if into is None or into.shape != (size,):
            into = state_buffer(size)
        blob = pieces.Scatter(lay, n, into)

        def fill(p: Piece) -> None:
            parts = blob.regions(p.start, p.end)
            header = bytearray(blk.FRAME_HEADER)
            try:
                whole = self.store.read_into(p.key, [memoryview(header), *parts])
            except KeyError:
                raise CorruptCheckpoint(f"a KV block of the checkpoint is missing ({p.key[:12]})") from None
            if not (whole and blk.raw_frame_holds(header, parts, p.size)):
                blob.place(p.start, p.end, self.block(p.key, p.size, self.store.get, ours=True)[1])

        # File reads and CRC-32 release the GIL: pieces are read and checked on every core.
        for _ in _READERS.map(fill, full):
            pass
        return blob.state()

    def block(
        self, key: str, size: int, read: Callable[[str], bytes], *, ours: bool | None = None
    ) -> tuple[bytes, bytes | memoryview]:
        """One block, read once and checked: (its frame, its payload). A damaged block of
        this store (`ours`; by default when `read` is the store's) is removed, so that the
        next checkpoint holding those tokens writes it again instead of reusing it."""
        try:
            data = read(key)
        except KeyError:
            raise CorruptCheckpoint(f"a KV block of the checkpoint is missing ({key[:12]})") from None
        # NOTE: blocks that never left this process's memory are not checksummed again: at
        # 3.5 GB/s that was 12 ms of a 2,000-token restore from RAM.
        trusted = read == self.store.get and self.store.in_process
        try:
            return data, blk.unframe(data, size, checksum=not trusted)
        except CorruptCheckpoint:
            if ours or (ours is None and read == self.store.get):
                log.error("removing damaged block %s", key)
                with self._lock, contextlib.suppress(OSError, KvkeepError):
                    self.store.delete(key)
            raise
