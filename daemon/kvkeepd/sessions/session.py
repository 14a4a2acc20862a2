"""Sessions as the daemon records them, and the values the session layer trades in."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from kvkeepd.engine.job import Job, SeqState
from kvkeepd.state import cells as kvstate
from kvkeepd.state.manifest import Snapshot
from kvkeepd.values.constraints import Constraint
from kvkeepd.values.messages import ChatMessage, ContextPolicy
from kvkeepd.values.sampling import SamplingParams
from kvkeepd.values.toolcall import Tool

# Recurrent snapshots a session keeps (models with a recurrent state): the newest turns' starts.
MAX_SNAPSHOTS = 2


@dataclass
class Session:
    """A conversation bound to the loaded model. Where its computed state lives is not
    recorded here: the Residency owns that."""

    session_id: str
    persistent: bool
    params: SamplingParams
    stop: tuple[str, ...]
    created_at: float
    last_used_at: float
    # Whose it is, and the salt its blocks are keyed with (see tenants.py).
    tenant: str = ""
    salt: bytes = b""
    # Its state descends from an imported checkpoint (see apply): for the rest of its life it
    # keys its blocks with that import's salt and is no prefix source for anyone.
    imported: bool = False
    state: SeqState = field(default_factory=SeqState)
    messages: list[ChatMessage] = field(default_factory=list)
    # Recurrent states at earlier positions of this history (see Job.snapshot), oldest first.
    snapshots: list[kvstate.RecurrentCells] = field(default_factory=list)
    # Tokens of the system prompt, and (models with sliding windows or recurrent state) their
    # state at its last block boundary: what other sessions with this prompt attach.
    system_end: int = 0
    boundary: tuple[int, tuple[kvstate.Section, ...]] | None = None
    head_checkpoint_id: str = ""
    # The checkpoint or session it was forked from ("": none): what the console draws its
    # fork under. A persistent session's heads keep it (Persistence.save_head).
    forked_from: str = ""
    # The fencing token of this daemon's lease on it (persistent sessions; 0: none yet).
    lease: int = 0
    # What a chat turn that does not fit does, and what truncating cost.
    context_policy: ContextPolicy = "error"
    truncations: int = 0
    dropped_tokens: int = 0
    # Structured output cut short (max_tokens, a stop string...): the next request without a
    # prompt continues within it (see engine/structured_output.py).
    constraint: Constraint | None = None
    # The tools its chat turns may call, until a turn gives others (kvkeepd.tools).
    tools: tuple[Tool, ...] = ()
    # Changed since its last head save, and the tokens its head's state covers (persistent
    # sessions only: turns since then are in the journal, their KV not yet stored).
    dirty: bool = False
    head_n_kv: int = 0
    # A head save failed, and may have committed all the same (a shared catalog's answer
    # lost): the next turn saves a head, never a journal record that follows the old one.
    head_unsure: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    job: Job | None = None
    closed: bool = False
    # Let go to another daemon (a shared catalog): requests still holding it retry there.
    moved: bool = False

    @classmethod
    def of_head(cls, snap: Snapshot, session_id: str) -> Session:
        """A persistent session as its head's snapshot describes it (its history not yet
        applied: the caller places its state)."""
        return cls(
            session_id,
            True,
            snap.params,
            snap.stop,
            snap.created_at,
            snap.saved_at,
            tenant=snap.tenant,
            salt=bytes.fromhex(snap.salt),
            forked_from=snap.forked_from,
        )

    @property
    def busy(self) -> bool:
        return self.lock.locked()

    def keep_snapshot(self, snap: kvstate.RecurrentCells | None) -> None:
        if snap is not None:
            older = [s for s in self.snapshots if s.pos < snap.pos]
            self.snapshots = [*older[len(older) - MAX_SNAPSHOTS + 1 :], snap]

    def forget_snapshots_after(self, n_tokens: int) -> None:
        """Drop snapshots of positions the history no longer has, and a constraint whose
        output would begin beyond it."""
        self.snapshots = [s for s in self.snapshots if s.pos + 1 <= n_tokens]
        if self.constraint is not None and self.constraint.start > n_tokens:
            self.constraint = None
        if self.boundary is not None and self.boundary[0] > n_tokens:
            self.boundary = None
        self.system_end = min(self.system_end, n_tokens)

    def snapshot(self, label: str, block_tokens: int) -> Snapshot:
        """The session as a manifest would record it (its state pieces filled in on save)."""
        state = self.state
        return Snapshot(
            session_id=self.session_id,
            persistent=self.persistent,
            created_at=self.created_at,
            tokens=list(state.tokens),
            n_kv=state.n_kv,
            logits=state.logits if state.n_kv == len(state.tokens) else None,
            draws=state.draws,
            params=self.params,
            stop=self.stop,
            messages=[replace(m) for m in self.messages],
            fingerprint="",
            kv_layout=None,
            block_tokens=block_tokens,
            label=label,
            salt=self.salt.hex(),
            imported=self.imported,
            tenant=self.tenant,
            constraint=self.constraint,
            tools=self.tools,
            system_end=self.system_end,
            context_policy=self.context_policy,
            truncations=self.truncations,
            dropped_tokens=self.dropped_tokens,
        )

    def apply(self, snap: Snapshot, n_kv: int) -> None:
        """Make this session's history and parameters the snapshot's, with a state that
        covers tokens[:n_kv] (the caller places it).

        A snapshot of imported state brings its salt along, for good: KV this daemon did not
        compute is keyed apart from every block it did (heads, spills and checkpoints after
        it too), so it never stands for them, even under a salt other sessions share."""
        if snap.imported:
            self.salt = bytes.fromhex(snap.salt)
            self.imported = True
        self.state = SeqState(
            tokens=list(snap.tokens),
            n_kv=n_kv,
            logits=snap.logits if n_kv == len(snap.tokens) else None,
            draws=snap.draws,
        )
        self.params = snap.params
        self.stop = snap.stop
        self.messages = [replace(m) for m in snap.messages]
        self.constraint = snap.constraint
        self.tools = snap.tools
        self.system_end = snap.system_end
        self.context_policy = snap.context_policy
        self.truncations = snap.truncations
        self.dropped_tokens = snap.dropped_tokens
        self.snapshots = []
        self.boundary = None

    def before(self) -> Before:
        """The session as it is now, to put back should a change of its history not be
        made durable (`put_back`)."""
        return Before(self.snapshot("", 0), self.salt, self.imported, tuple(self.snapshots), self.boundary)

    def put_back(self, before: Before, n_kv: int) -> None:
        """Make the session what it was (`before`): its history, sampler position, messages
        and parameters, with a state that covers tokens[:n_kv] of that history (the caller
        knows the cells it holds are theirs, and places them). Cells kept keep their epoch
        and window: they are the same bytes."""
        state = self.state
        self.apply(before.snapshot, n_kv)
        self.salt, self.imported = before.salt, before.imported
        self.snapshots, self.boundary = list(before.snapshots), before.boundary
        if n_kv:
            self.state.window_from, self.state.epoch = state.window_from, state.epoch


@dataclass(frozen=True)
class Before:
    """A session as it was before a change of its history (a restore, a rewind): what
    `Session.put_back` makes it again. Its cells are not kept here: the Residency knows
    which still serve."""

    snapshot: Snapshot
    salt: bytes
    imported: bool
    snapshots: tuple[kvstate.RecurrentCells, ...]
    boundary: tuple[int, tuple[kvstate.Section, ...]] | None
