"""Sessions and the flows that act on them: the registry and its lifecycle, where
each session's state lives (the Residency), persistence, the prefix cache, generation,
checkpoints, expiry, tenants and hand-over between daemons.

May import: everything below it (leaves, config, engine, state, storage).
"""
