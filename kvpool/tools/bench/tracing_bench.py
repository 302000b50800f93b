"""``kvpool bench tracing``: what tracing costs a call, off and on, side by side in one run.

A real pool master and store (``LocalPool``) per mode, and a pool client in this process calling its master as
a request's hop would, its request id bound: a unary ``Exists``, and a ``Session`` lookup of 16 groups with its
release (two messages). Per mode, the CPU (user + system) the calls cost, divided by their count: the master's
(``/proc``) and this client process's, apart.

- ``off``: neither ``KVPOOL_RPC_TRACE`` nor ``KVPOOL_OTLP_ENDPOINT`` set (the default);
- ``file``: every span a JSON line in a file (what ``kvpool bench path`` reads);
- ``otlp``: spans batched to an OTLP/gRPC collector (``--otlp-endpoint``). The collector is a receiver in this
  process, so the client's figure in this mode includes taking the master's spans in: an upper bound.

``*_extra_cpu_ms_<mode>`` is a mode's cost less ``off``'s, master and client together. The modes run in turn,
``--rounds`` times, and each figure is the median over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvpool.tools.bench.master_bench import cpu_seconds
from kvpool.tools.cluster.parts import LocalPool
from kvpool.tracing import OTLP_ENV, TRACE_ENV, flush, tracing_children

MODES = ("off", "file", "otlp")
GROUPS = 16


async def _calls(master: str, pid: int, calls: int, env: dict[str, str]) -> dict[str, float]:
    """CPU per call of each kind, ``{kind}_{end}``: this client's tracing as ``env`` says."""
    from kvpool.pool.client import PoolClient
    from kvpool.request_id import bound_request_id

    saved = {key: os.environ.pop(key, None) for key in (TRACE_ENV, OTLP_ENV)}
    os.environ.update(env)  # the client's channel and session read it when made
    try:
        client = PoolClient(master, None, host_name="bench")
    finally:
        for key in (TRACE_ENV, OTLP_ENV):
            os.environ.pop(key, None)
        os.environ.update({k: v for k, v in saved.items() if v is not None})
    ids = [f"bench-tracing/{g:032x}" for g in range(GROUPS)]
    try:
        reserved = await client.reserve([(f"{g}/{stage}", g, 4, 4096) for g in ids for stage in range(4)])
        await client.commit([(loc.key, 1) for loc in reserved if hasattr(loc, "key")])
        with bound_request_id("bench-tracing-warmup"):
            found = await client.lookup(ids, lease_ms=1000)
            assert found.num_complete == GROUPS, found.num_complete
            await client.release(found.lease_id)
            await client.exists(["x"])
        out = {}
        for name in ("unary", "session"):
            master0, client0 = cpu_seconds(pid), time.process_time()
            for i in range(calls):
                with bound_request_id(f"bench-tracing-{i}"):
                    if name == "unary":
                        await client.exists([ids[0] + "/0"])
                    else:
                        found = await client.lookup(ids, lease_ms=1000)
                        await client.release(found.lease_id)
            messages = calls * (1 if name == "unary" else 2)  # the session's figure: one of its messages
            out[f"{name}_master"] = (cpu_seconds(pid) - master0) * 1e3 / messages
            out[f"{name}_client"] = (time.process_time() - client0) * 1e3 / messages
        return out
    finally:
        await client.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = [0]

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received[0] += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    calls = args.calls or (300 if args.quick else 2000)
    rounds = args.rounds or (2 if args.quick else 5)
    samples: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-tracing-") as tmp, ExitStack() as pools:
        spans_file = Path(tmp) / "spans.jsonl"
        endpoint = f"127.0.0.1:{port}"
        envs = {"off": {}, "file": {TRACE_ENV: str(spans_file)}, "otlp": {OTLP_ENV: endpoint}}
        started: dict[str, LocalPool] = {}
        for mode in MODES:
            with ExitStack() as env:
                if mode == "file":
                    env.enter_context(tracing_children(spans_file))
                pool = LocalPool(num_stores=1, segment_size="16MiB", workdir=Path(tmp) / mode,
                                 master_args=["--otlp-endpoint", endpoint] if mode == "otlp" else [])
                started[mode] = pools.enter_context(pool)

        async def measure() -> None:  # one event loop for every round: grpc.aio keeps to the first loop it ran on
            for _ in range(rounds):
                for mode in MODES:
                    master = started[mode].master
                    assert master is not None
                    measured = await _calls(started[mode].master_address, int(master.ready["pid"]), calls,
                                            envs[mode])
                    for key, value in measured.items():
                        samples[mode].setdefault(key, []).append(value)

        asyncio.run(measure())
        flush()  # this process's last spans reach their exporters
        pools.close()  # a stopping master sends what it has left
        lines = len(spans_file.read_text().splitlines()) if spans_file.exists() else 0
    time.sleep(0.5)
    collector.stop(None)
    report: dict[str, Any] = {"calls_per_round": calls, "rounds": rounds, "groups_per_lookup": GROUPS,
                              "cpus": os.cpu_count(), "file_spans": lines, "otlp_spans_received": received[0]}
    for mode in MODES:
        for key, values in samples[mode].items():
            report[f"{key}_cpu_ms_{mode}"] = round(statistics.median(values), 4)
    for mode in ("file", "otlp"):
        for name in ("unary", "session"):
            report[f"{name}_extra_cpu_ms_{mode}"] = round(
                sum(report[f"{name}_{end}_cpu_ms_{mode}"] - report[f"{name}_{end}_cpu_ms_off"]
                    for end in ("master", "client")), 4)
    return report


def main(args: argparse.Namespace) -> int:
    report = run(args)
    print(f"kvpool bench tracing: {report['calls_per_round']} calls x {report['rounds']} rounds, CPU per call "
          "(ms):")
    for mode in MODES:
        print(f"  {mode:5s} unary: master {report[f'unary_master_cpu_ms_{mode}']:.4f}, client "
              f"{report[f'unary_client_cpu_ms_{mode}']:.4f}; session message: master "
              f"{report[f'session_master_cpu_ms_{mode}']:.4f}, client {report[f'session_client_cpu_ms_{mode}']:.4f}")
    print(f"  spans: {report['file_spans']} to the file, {report['otlp_spans_received']} to the collector")
    if args.json:
        print(json.dumps(report))
    return 0
