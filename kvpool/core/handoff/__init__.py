"""The prefill → decode handoff, as both sides agree on it.

Owns where every byte of a request's KV goes and in which writes (the gathered,
large-write layout), and which parts of a receive region have landed.
"""
