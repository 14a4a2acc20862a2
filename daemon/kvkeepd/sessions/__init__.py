"""Sessions: what a session is, and everything done with it. Rooms, lowest first; a module may
import its own room, a lower one, or below sessions/ (scripts/check_imports.py holds it):

the root's modules, the vocabulary; prompting/ and durability/; memory/; flows/; and
manager.py, the registry and the one façade the doors call.

<!-- generated: modules -->
- dock_table.py: Docks: which idle session each dock holds (a KV stream beside the slots, in
  device memory on a GPU: engine/streams.py), and which to give up when all are taken.
- host.py: SessionHost: what the session flows need of the registry that holds the sessions.
- ledger.py: Ledger: the running counts of what requests cost, daemon-wide and per tenant,
  written in one place; and the counters GetInfo and the metrics report.
- lineage.py: Which checkpoints a session's cells still are: the record behind a rollback that
  keeps the cells (`Residency.rewind_to`).
- manager.py: SessionManager: the registry of sessions and the flows of the RPCs that act on
  them.
- ops.py: Operations that run to their end: what a request starts, its cancellation cannot cut
  short.
- placement.py: Where a session's computed state is: one `Placement` value per session, kept
  with the slot and dock tables in `Placements`, which its subclass the Residency
  (sessions/memory/residency.py) alone writes; everyone else reads.
- session.py: Sessions as the daemon records them, and the values the session layer trades in.
- tenants.py: Tenants: who a caller is (a bearer token), what they may hold (quotas), and the
  salt that keeps their cached prompt blocks apart from everybody else's.
- whole_states.py: Whole states of ephemeral sessions' recent checkpoints, kept in the RAM
  budget's free room.
- durability/: How a session survives its daemon: heads, checkpoints and journal records written
  and read back (persistence), and which daemon holds a shared session (leases).
- flows/: What the doors ask of sessions, each flow over the registry (a SessionHost) and the
  rooms below it: create and close (lifecycle), turns (generation), checkpoints, restores and
  forks (checkpointing), stored responses (responses, response_list), moving a session between
  daemons (handover), head saves, expiry and the census of counters.
- memory/: Where each session's state lives now: the one writer of placements across slots,
  device docks, RAM and disk (residency), and the prefixes kept to be shared (prefix_cache).
- prompting/: What a conversation becomes before the model sees it: the chat template
  (templates), its tokens and what is kept of them (tokens), and what fits in a session's
  context (fitting).
<!-- end -->

May import: everything below it (leaves, config, engine, state, storage).
"""
