"""Admission at the router: a request gets its decode room before any prefill work.

Owns the tickets that hold each decode shard's and prefill pipeline's room,
the bounded queue of requests waiting for room, where a failed request may be
retried, and which pipeline and shard a request is routed to.
"""
