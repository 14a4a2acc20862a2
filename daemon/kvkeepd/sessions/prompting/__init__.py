"""What a conversation becomes before the model sees it: the chat template (templates), its
tokens and what is kept of them (tokens), and what fits in a session's context (fitting).

May import: the sessions' root vocabulary and everything below sessions/.
"""
