"""Which pieces hold a state: its keys, positions and sizes on the block grid.

The full-attention KV is cut into blocks of `block_tokens` positions (keys: the hash chain
over the tokens, started from the salt), the sliding-window KV of the window is cut on the
same grid (keys derived from the chain key of the block a piece lies in, and the piece's
first position in it), and the recurrent state is one piece (key derived from the last chain
key). Equal tokens under the same salt give equal keys, so states with a common prefix share
its pieces.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeAlias

from kvkeepd.state import cells, pieces
from kvkeepd.state import frames as blk
from kvkeepd.state.layout import StateLayout


@dataclass(frozen=True)
class Piece:
    """One stored piece of a state: its key, positions, and the payload size it must have."""

    key: str
    start: int
    end: int
    size: int


#: Full-attention blocks, sliding-window pieces, the recurrent state (or None).
Plan: TypeAlias = tuple[list[Piece], list[Piece], Piece | None]


def plan(
    lay: StateLayout,
    fingerprint: str,
    layout_desc: str,
    tokens: list[int],
    n: int,
    block_tokens: int,
    salt: str,
) -> Plan:
    """The pieces that hold the state after tokens[:n] of a model (`fingerprint`) whose
    states have layout `lay` (described as `layout_desc`, which the keys include)."""
    if n == 0:
        return [], [], None
    keys = blk.chain(
        tokens[:n],
        fingerprint=fingerprint,
        layout=layout_desc,
        block_tokens=block_tokens,
        salt=bytes.fromhex(salt),
    )
    full: list[Piece] = []
    if lay.full is not None:
        cell = lay.full.cell_bytes
        for i, key in enumerate(keys):
            a, b = i * block_tokens, min((i + 1) * block_tokens, n)
            full.append(Piece(key, a, b, (b - a) * cell))
    window: list[Piece] = []
    if lay.windowed is not None:
        cell = lay.windowed.cell_bytes
        a = lay.windowed.first(n)
        while a < n:
            i = a // block_tokens
            b = min((i + 1) * block_tokens, n)
            window.append(Piece(blk.derived(keys[i], "win", a - i * block_tokens), a, b, (b - a) * cell))
            a = b
    rec = None
    if lay.recurrent is not None:
        rec = Piece(blk.derived(keys[-1], "rec"), n - 1, n, lay.recurrent.nbytes)
    return full, window, rec


def payloads(
    kv: cells.SeqKv | None, full: list[Piece], window: list[Piece], rec: Piece | None
) -> Iterator[tuple[Piece, Callable[[], bytes]]]:
    """Each piece of a plan with a function that cuts its payload from `kv` (called only for
    the pieces a store lacks)."""
    if kv is None:
        return
    for section in kv.sections:
        if isinstance(section, cells.RecurrentCells):
            if rec is not None:
                yield rec, functools.partial(bytes, section.data)
            continue
        for p in window if section.layout.window else full:
            yield p, functools.partial(pieces.cut, section, p.start, p.end)
