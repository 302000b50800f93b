"""kvpool simulate: a discrete-event simulator that drives the system's own policy code (``kvpool.core``).

Imports only the core, the workload and the standard library (matplotlib
lazily, for plots): no grpc, protobuf, torch or transfer engine.
"""
