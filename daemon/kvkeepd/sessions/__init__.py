"""Sessions: what a session is, and everything done with it. Rooms, lowest first; a module may
import its own room, a lower one, or below sessions/ (scripts/check_imports.py holds it):

- the root: the vocabulary (session, tenants, ops, host, placement, dock_table, lineage,
  whole_states)
- prompting/: templates, tokens and what fits in a context
- durability/: persistence and leases
- memory/: residency (the one writer of placements) and the prefix cache
- flows/: lifecycle, generation, checkpointing, responses, hand-over, head saves, expiry, census
- manager: the registry, and the one façade the doors call

May import: everything below it (leaves, config, engine, state, storage).
"""
