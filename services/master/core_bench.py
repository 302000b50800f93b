"""``kvpool bench master-core``: the master's own work per call, in this process, without gRPC.

It runs the master's servicer in the command's own process, so it lives with the master (the tools start the
services, never import them; ``kvpool``'s launcher dispatches this one bench here).

``kvpool bench master`` measures a real master over gRPC: on a shared host the
session message's own floor and the host's load move its figures by a third
between runs. This one runs the same index and servicer (``PoolIndex``,
``PoolMasterServicer.session_answer``, the stores' heartbeats through
``heartbeat_response``) in one process, so what it reads is the index's and the
servicer's CPU alone, and both forms of a comparison alternate call by call.

1. **Populate** ``--objects`` objects by saves of ``SAVE_CHUNKS`` chunks × ``STAGES``
   stages (one ``PutStart`` of whole groups, its commit riding on the next save,
   as the pool client sends them), into two segments sized so the objects fill
   them to the high watermark; then ``CHURN_HISTORIES`` histories more, so saves
   evict as they go. Every ``BEAT_SAVES`` saves each store's heartbeat takes the
   journal's changes (grouped, serialized) and acknowledges them, as a store does.
2. **Save**: ``--saves`` saves, the process's CPU (``time.process_time``) of each
   save's message (its ``PutStart`` and the previous commit riding) and of the
   heartbeats, over the saves. The commits alternate, ``FORM_BLOCK`` saves at a
   time, between whole groups (``CommitGroups``: ``save_cpu_ms``) and two flat
   arrays (``save_cpu_ms_flat_commits``), each save's CPU counted to the form its
   ride took; ``save_ms_p50`` and ``save_ms_flat_commits_p50`` are the medians of
   single saves (a save that evicts toward the low watermark costs several times
   the others: the means carry those, the medians do not).
3. **Lookup**: a ``HISTORY_CHUNKS``-chunk lookup of each of the newest histories the
   pool holds (at most ``LOOKUP_HISTORIES``) by
   the handle its last lookup got (the next turn's form), the answer compact, its
   release riding on the next message: ``lookup_cpu_ms`` the mean, ``lookup_ms_p50``
   the median.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from typing import Any

# bench master's shapes (kvpool/tools/bench/master_bench.py; a role never imports the tools, a test holds them equal)
STAGES = 4
HISTORY_CHUNKS = 450
SAVE_CHUNKS = 22
OBJECT_BYTES = 256
NAMESPACE = "bench-master-0123456789abcdef"
HIGH_WATERMARK = 0.9
BEAT_SAVES = 20  # saves between the stores' heartbeats
CHURN_HISTORIES = 80  # histories saved past the populate, so saves evict as they go
LOOKUP_HISTORIES = 40  # the newest histories the lookups cycle through
LEASE_MS = 30_000
# saves in a row whose commits take one form before the other's turn: many evictions toward the low watermark in
# each block (one every dozen saves or so), so both forms' means carry their share (alternating save by save,
# those bursts fell on one form's saves)
FORM_BLOCK = 100


class Core:
    """A master's index and servicer in this process, two segments, and what a client and two stores send it."""

    def __init__(self, objects: int) -> None:
        from prometheus_client import CollectorRegistry

        from kvpool.core.pool.index import PoolIndex
        from kvpool.core.pool.settings import IndexSettings
        from kvpool.services.master.metrics import MasterMetrics
        from kvpool.services.master.servicer import PoolMasterServicer

        capacity = math.ceil(objects * OBJECT_BYTES / HIGH_WATERMARK)
        segment = math.ceil(capacity / 2 / (1 << 20)) << 20
        self.index = PoolIndex(IndexSettings(high_watermark=HIGH_WATERMARK))
        for i in range(2):
            self.index.mount_segment(f"store{i}", f"127.0.0.1:{9000 + i}", "bench", (i + 1) << 40, segment)
        self.servicer = PoolMasterServicer(self.index, "bench", 2.0, MasterMetrics(CollectorRegistry()))
        self.acked = {"store0": 0, "store1": 0}
        self.rides: list[tuple[str, Any]] = []
        self.calls = 0
        self.saves = 0
        self.histories = 0  # histories saved so far
        self.handles: dict[int, tuple[int, int]] = {}
        self.cpu = {True: 0.0, False: 0.0}  # by whether the save's ride was a commit of whole groups
        self.count = {True: 0, False: 0}
        self.each: dict[bool, list[float]] = {True: [], False: []}
        self.measuring = False
        self.block = FORM_BLOCK  # saves a commit form keeps before the other's turn

    def message(self, **body: Any) -> Any:
        from kvpool.rpc import pool_pb2

        self.calls += 1
        message = pool_pb2.SessionRequest(call=self.calls, **body)
        for kind, request in self.rides:
            getattr(message.rides.add(), kind).CopyFrom(request)
        self.rides.clear()
        return message

    def answer(self, message: Any) -> tuple[Any, float]:
        """The servicer's answer to a message as it arrives (parsed from bytes) and leaves (serialized), and
        the process's CPU it took."""
        from kvpool.rpc import pool_pb2

        data = message.SerializeToString()
        t0 = time.process_time()
        answer = self.servicer.session_answer(pool_pb2.SessionRequest.FromString(data))
        answer.SerializeToString()
        took = time.process_time() - t0
        if answer.code or answer.ride_failures:
            raise RuntimeError(f"the master refused a call: {answer.code} {answer.message} {answer.ride_failures}")
        return answer, took

    def save(self, history: int, first: int, whole_groups: bool) -> None:
        from kvpool.pool.client import put_end_request, put_start_request
        from kvpool.rpc import pool_pb2

        keys = [f"{group_id(history, c)}/{s}" for c in range(first, first + SAVE_CHUNKS) for s in range(STAGES)]
        items = [(key, key.rpartition("/")[0], STAGES, OBJECT_BYTES) for key in keys]
        form = bool(self.rides) and self.rides[0][1].HasField("groups")
        answer, took = self.answer(self.message(put_start=put_start_request(items, client_host="bench",
                                                                               packed=True)))
        statuses = answer.put_start.packed.status
        pairs = [(key, i + 1) for i, (key, status) in enumerate(zip(keys, statuses))
                 if status == pool_pb2.PUT_STATUS_RESERVED]
        if pairs:
            self.rides.append(("put_end", put_end_request(
                pairs, groups=whole_groups and answer.put_start.commits_groups)))
        self.saves += 1
        if self.saves % BEAT_SAVES == 0:
            took += self.beat()
        if self.measuring:
            self.cpu[form] += took
            self.count[form] += 1
            self.each[form].append(took)

    def beat(self) -> float:
        """Each store's heartbeat: the journal's changes, grouped and serialized, acknowledged; the CPU it took."""
        from kvpool.services.master.servicer import heartbeat_response

        t0 = time.process_time()
        for segment_id, acked in self.acked.items():
            more = True
            while more:
                changes, more = self.index.heartbeat_changes(segment_id, acked)
                grouped = heartbeat_response(changes, "grouped", master_incarnation="bench", more=more)
                grouped.SerializeToString()
                sent = grouped.grouped_changes
                if sent.first:
                    acked = max(f + n - 1 for f, n in zip(sent.first, sent.count))
            self.acked[segment_id] = acked
        return time.process_time() - t0

    def save_histories(self, count: int) -> None:
        """``count`` whole histories more, a save of ``SAVE_CHUNKS`` at a time, the commits alternating forms
        (``FORM_BLOCK``)."""
        for _ in range(count):
            for first in range(0, HISTORY_CHUNKS - HISTORY_CHUNKS % SAVE_CHUNKS, SAVE_CHUNKS):
                self.save(self.histories, first, whole_groups=self.saves // self.block % 2 == 0)
            self.histories += 1
            if self.histories % 5 == 0:
                gc.freeze()  # as the master's sweep does (kvpool.heap)

    def lookup(self, history: int) -> tuple[float, int]:
        from kvpool.rpc import pool_pb2

        groups = [group_id(history, c) for c in range(HISTORY_CHUNKS)]
        handle, found = self.handles.pop(history, (0, 0))
        kept = min(HISTORY_CHUNKS - 8, found) if handle else 0
        request = pool_pb2.LookupRequest(group_ids=groups[kept:], lease_ms=LEASE_MS, packed=True, packed_bytes=True,
                                         compact=True, history=handle, history_groups=kept)
        answer, took = self.answer(self.message(lookup=request))
        found_now = answer.lookup
        if found_now.history:
            self.handles[history] = (found_now.history, found_now.num_complete)
        if found_now.lease_id:
            self.rides.append(("release_lease", pool_pb2.ReleaseLeaseRequest(lease_id=found_now.lease_id)))
        return took, found_now.num_complete


def group_id(history: int, chunk: int) -> str:
    return f"{NAMESPACE}/{history:016x}{chunk:016x}"


def measure(objects: int, saves: int, lookups: int) -> dict[str, Any]:
    core = Core(objects)
    t0 = time.perf_counter()
    per_history = HISTORY_CHUNKS // SAVE_CHUNKS * SAVE_CHUNKS * STAGES
    core.save_histories(math.ceil(objects / per_history))
    populate_s = time.perf_counter() - t0
    core.save_histories(CHURN_HISTORIES)
    core.beat()
    core.block = max(1, min(FORM_BLOCK, saves // 4))  # (both forms take turns in a short run too)
    core.measuring = True
    evicted = core.index.counters.evicted_groups
    core.save_histories(math.ceil(saves / (HISTORY_CHUNKS // SAVE_CHUNKS)))
    core.measuring = False
    evicted = core.index.counters.evicted_groups - evicted
    # the newest histories the pool holds whole (at most LOOKUP_HISTORIES): past its low watermark, older ones go
    held = max(1, min(LOOKUP_HISTORIES, int(core.index.num_objects * 0.8) // per_history))
    recent = list(range(core.histories - held, core.histories))
    for history in recent:  # each history's handle from a first lookup, as a session's last turn left it
        core.lookup(history)
    times: list[float] = []
    found: list[int] = []
    while len(times) < lookups:
        for history in recent:
            took, complete = core.lookup(history)
            times.append(took)
            found.append(complete)
    ms = 1e3
    return {
        "objects": core.index.num_objects,
        "populate_s": round(populate_s, 1),
        "saves_measured": core.count[True] + core.count[False],
        "evicted_groups_while_saving": evicted,
        "save_cpu_ms": round(core.cpu[True] / max(1, core.count[True]) * ms, 3),
        "save_cpu_ms_flat_commits": round(core.cpu[False] / max(1, core.count[False]) * ms, 3),
        "save_ms_p50": round(statistics.median(core.each[True]) * ms, 3),
        "save_ms_flat_commits_p50": round(statistics.median(core.each[False]) * ms, 3),
        "lookup_cpu_ms": round(statistics.mean(times) * ms, 3),
        "lookup_ms_p50": round(statistics.median(times) * ms, 3),
        "lookup_groups_found": statistics.median(found),
        "lookups_measured": len(times),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvpool.core.pool import allocator, lru

    scales = [10**4] if args.quick else [args.objects] if args.objects else [10**5, 10**6]
    saves = args.saves or (200 if args.quick else 2000)
    lookups = args.lookups or (80 if args.quick else 400)
    return {
        "stages": STAGES, "save_chunks": SAVE_CHUNKS, "history_chunks": HISTORY_CHUNKS, "object_bytes": OBJECT_BYTES,
        "index_order": "c" if lru.native() else "python",
        "allocator": "c" if allocator.native_allocator_class() is not None else "python",
        "scales": [measure(objects, saves, lookups) for objects in scales],
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [f"kvpool bench master-core: the master's index and servicer in one process (order "
             f"{report['index_order']}, allocator {report['allocator']})"]
    for scale in report["scales"]:
        lines.append(f"  {scale['objects']:>9,} objects: save {scale['save_cpu_ms']:.3f} ms "
                     f"(flat commits {scale['save_cpu_ms_flat_commits']:.3f}; p50 {scale['save_ms_p50']:.3f} / "
                     f"{scale['save_ms_flat_commits_p50']:.3f}), lookup {scale['lookup_cpu_ms']:.3f} ms "
                     f"(p50 {scale['lookup_ms_p50']:.3f}, {scale['lookup_groups_found']:.0f} groups found), "
                     f"{scale['evicted_groups_while_saving']:,} groups evicted over "
                     f"{scale['saves_measured']:,} saves")
    return "\n".join(lines)


MIN_OBJECTS = 5000  # a few whole histories (1,760 objects each) must fit for the lookups to find one


def main(args: argparse.Namespace) -> int:
    if args.objects is not None and args.objects < MIN_OBJECTS:
        raise SystemExit(f"kvpool bench master-core: --objects must be at least {MIN_OBJECTS}, got {args.objects}")
    for flag in ("saves", "lookups"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise SystemExit(f"kvpool bench master-core: --{flag} must be positive, got {value}")
    report = run(args)
    print(json.dumps(report) if args.json else format_report(report))
    return 0
