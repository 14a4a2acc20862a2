"""What the doors ask of sessions, each flow over the registry (a SessionHost) and the rooms
below it: create and close (lifecycle), turns (generation), checkpoints, restores and forks
(checkpointing), stored responses (responses, response_list), moving a session between
daemons (handover), head saves, expiry and the census of counters.

May import: the root vocabulary, prompting/, durability/, memory/ and everything below sessions/.
"""
