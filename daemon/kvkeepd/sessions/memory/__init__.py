"""Where each session's state lives now: the one writer of placements across slots, device
docks, RAM and disk (residency), and the prefixes kept to be shared (prefix_cache).

May import: the root vocabulary, prompting/, durability/ and everything below sessions/.
"""
