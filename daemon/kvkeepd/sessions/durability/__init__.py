"""How a session survives its daemon: heads, checkpoints and journal records written and read
back (persistence), and which daemon holds a shared session (leases).

May import: the sessions' root vocabulary and everything below sessions/.
"""
