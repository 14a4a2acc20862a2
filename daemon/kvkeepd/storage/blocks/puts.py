"""A save's blocks framed and put: one at a time into a store on this machine, a few at a
time into a remote one (each put is a round trip)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from kvkeepd.state import frames as blk
from kvkeepd.state.plan import Piece
from kvkeepd.storage.blocks.base import BlockStore

# Puts to a remote store in flight at once, per daemon: each is a round trip, and a state in
# flight is at most this many blocks (~1.5 MB each) beyond the one being saved.
_WRITERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvkeep-write")


def put_framed(
    store: BlockStore,
    codec: str,
    items: Sequence[tuple[Piece, Callable[[], bytes]]],
    written: dict[str, tuple[int, int]],
) -> None:
    """Frame and put each piece's payload, recording in `written` key -> (its frame's size,
    bytes written: 0 if the store had it) as each put succeeds; the first failure is raised
    once every put has ended."""

    def put(item: tuple[Piece, Callable[[], bytes]]) -> None:
        piece, payload = item
        block = blk.frame(payload(), codec)
        written[piece.key] = (len(block), store.put(piece.key, block))

    if not store.remote or len(items) < 2:
        for item in items:
            put(item)
        return
    puts = [_WRITERS.submit(put, item) for item in items]
    wait(puts)
    for done in puts:
        if (error := done.exception()) is not None:
            raise error
