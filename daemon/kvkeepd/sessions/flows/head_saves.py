"""The head save that ends a change of a persistent session's history (a restore, a rewind):
the change happens whole, in memory and durably, or not at all.

The change is made in memory first (cells cut or a checkpoint's state loaded, the history
and messages replaced), then the session's new head is saved. Should that save fail (the
store or catalog unreachable, a full disk, the lease lost), the session is put back as it
was — history, sampler position, messages, parameters — over the cells that are still that
history's: a cut keeps those below it, a loaded state none (the history is evaluated again,
exact because evaluation does not depend on how tokens are chunked: docs/design/
exactness.md). So it serves what it served before the request, and its durable state (the
old head and turn record) agrees. A change once begun ends either way: it runs inside an
operation its requester's cancellation does not cut short (ops.py).
"""

from __future__ import annotations

from kvkeepd.errors import KvkeepError, noted
from kvkeepd.sessions.memory.residency import Residency
from kvkeepd.sessions.session import Before, Session

UNDONE = "the session is as it was before this request"


async def save_or_put_back(residency: Residency, session: Session, before: Before, *, cells: bool) -> None:
    """Save the session's head as it is now, or put it back as it was (`before`) and raise.
    `cells`: the cells it holds are the start of that history (a cut), so they stay."""
    try:
        await residency.save_head(session)
    except Exception as e:
        if not cells:
            await residency.drop_state(session, "a change of history that was not saved was undone")
        session.put_back(before, session.state.n_kv if cells else 0)
        if isinstance(e, KvkeepError):
            raise noted(e, UNDONE) from None
        raise
