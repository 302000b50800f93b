"""Sessions: what the cluster remembers of a conversation between its turns.

Owns when each session was last active and when its next turn is expected,
the prefetch policy that stages a session's history ahead of its next turn,
and what the router remembers of a session's prompts.
"""
