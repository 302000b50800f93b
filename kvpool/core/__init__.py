"""The policy core: every decision kvpool makes, as plain code.

Chunk hashing, the segment allocator, the pool index with group-LRU eviction
and placement, the device block manager, the hit planner and the prefill
request's life. Nothing here imports grpc, protobuf, torch, the transfer
engine, asyncio networking, files or sockets; time comes from an injectable
clock. The services wrap these modules, and benchmarks and the simulator run
the very same code (``tests/core/test_purity.py`` holds it to that).
"""
