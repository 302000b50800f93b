"""The policy core: every decision kvpool makes, as plain code.

One package per concern: ``pool`` (the master's index, allocation, group-LRU
eviction, placement), ``admission`` (the router's tickets, queue, retries and
routing), ``prefill`` (stage 0's block table, hit planning, a request's life,
its queue), ``sessions``, ``decode``, ``handoff``, ``tenancy``, ``api`` (the
front door's request checks) and ``supervision`` (processes' lives). At the top
level only the primitives every package shares: ``errors``, ``setting`` (one
declaration per setting) and ``chunk_hash`` (the names device blocks and pool
objects share).

Nothing here imports grpc, protobuf, torch, the transfer engine, asyncio
networking, files or sockets; time comes from an injectable clock. The
services wrap these modules, and benchmarks and the simulator run the very
same code (``tests/core/test_purity.py`` holds it to that).
"""
