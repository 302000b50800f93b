"""The pool master's policy: where every object lives, and what is evicted.

Owns the segment table and each segment's allocator, the object index with its
all-or-none groups, puts from start to commit, read leases, group-LRU eviction
with tenants' shares, block-report recovery after a master restart, placement
of new objects, and the pool client's circuit breaker in front of its master.
"""
