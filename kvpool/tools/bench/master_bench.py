"""``kvpool bench master``: how much one pool master carries, from outside, on the running code.

One run on one host: a real master and two real stores (``LocalPool``), and
client processes that call the master over gRPC as stage 0 and the stages do.
No byte moves: the master only sees control messages, and this bench measures
the master. Objects have the stages' key shapes (``namespace/chunk-hash/stage``,
a group per chunk of ``STAGES`` members) and ``OBJECT_BYTES`` each; the pool's
capacity is sized so the target count of objects fills it to the high watermark.

For each target count (10^5 and 10^6; ``--quick``: 10^4 and 10^5):

1. **Populate** through real ``PutStart``/``PutEnd`` calls, saves of
   ``SAVE_CHUNKS`` chunks × ``STAGES`` stages, histories of
   ``HISTORY_CHUNKS`` chunks. ``index_bytes_per_object``: the master's resident
   memory (``/proc``) grown since before the first put, over the objects it holds.
2. **Cost per call**, one client calling one after another, the master's CPU
   (``/proc/PID/stat``, user + system) over the calls, divided by their count.
   The pool stands at the high watermark, so the saves evict (the churn is in
   their cost) as the master does by default: a save that passes the high
   watermark evicts down to the low one (0.85), about 5% of the pool at once,
   and the next saves fit until it is passed again. So one measured window
   holds one such burst, or none, or two: on a loaded host, run it more than once.
   Each is measured in two forms side by side, the call pattern of the code
   before this bench (``*_legacy``: unary calls) and today's (messages on the
   client's ``Session`` stream, ``kvpool.pool.session_client``):
   - ``lookup_cpu_ms``: a lookup of one ``HISTORY_CHUNKS``-group history that
     hits, with its release; legacy answers one message per object, today's
     packed arrays in the compact form (``LookupRequest.packed``, ``compact``),
     the history named as the next turn of a session names it: the handle its
     last lookup got (``LookupRequest.history``) for all but its last
     ``--turn-new-chunks`` groups, and their ids. ``lookup_cpu_ms_by_ids``
     names every id (no handle), ``lookup_cpu_ms_full_answer`` also has the
     answer packed in full (before the compact form);
   - ``save_cpu_ms``: a save of ``SAVE_CHUNKS`` chunks over the stages; legacy is
     one put pair per stage, today's one pair for all stages, the put and the
     commit each naming whole groups (``PutGroups``, ``CommitGroups``);
   - today's releases and commits ride on the client's next message
     (``MasterSession.ride``: a message fewer each), as the pool client sends
     them; ``*_rides_off`` (lookup, save, turn) awaits each alone, as before;
   - ``turn_cpu_ms``: the calls of a typical turn (``--turn-*``): a lookup of the
     history (legacy: every group from chunk 0, leased and located; today's:
     the device-held prefix only counted and touched, ``held_prefix``), its
     release (today's: in the save's ``PutStart``), and the save of the turn's
     new chunks; ``turn_cpu_ms_by_ids`` names every id (no handle).
   ``call_floor_cpu_ms`` is the cheapest unary call's (one key's ``Exists``):
   what gRPC itself costs the master per unary call, whatever the call does;
   ``session_floor_cpu_ms`` the cheapest session message's (the release of a
   lease that is not there).
   Before each measurement the bench waits until the stores have
   acknowledged every change (heartbeats carry the master's journal to
   them), so one phase's work does not land in the next one's CPU: about one
   heartbeat period a phase (``--heartbeat-interval-s``, the master's 2 s by default).
3. **Saturation**: ``--clients`` processes calling as fast as the master
   answers, today's forms. ``lookups_per_s`` with ``lookup_ms_p50``/``p99``
   (client-observed, per call) over ``--lookups`` lookups (10^4; quick 10^3)
   while one more client saves without pause (churn at the watermark;
   ``saves_per_s_beside``); ``master_busy`` says how much of one core the
   master used meanwhile (on a small host the clients may be the limit);
   then ``saves_per_s`` with every client saving for ``--seconds``; then
   ``turns_per_s_per_master`` with every client running typical turns. Lookups are of distinct histories
   (each client cycles through the newest ones, so they hit); ``lookup_hit_share``
   says how many found every group.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from kvpool.tools.cluster.parts import LocalPool

STAGES = 4
HISTORY_CHUNKS = 450
SAVE_CHUNKS = 22
OBJECT_BYTES = 256
NAMESPACE = "bench-master-0123456789abcdef"
HIGH_WATERMARK = 0.90
LEASE_MS = 5000
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# the targets, each at 10^6 objects with churn
TARGETS = {"lookup_cpu_ms": 0.5, "save_cpu_ms": 0.5, "turn_cpu_ms": 1.5}


@dataclass(frozen=True, slots=True)
class Turn:
    """A typical turn's calls: its history's length, the share its device holds, the chunks it adds."""

    history_chunks: int = HISTORY_CHUNKS
    device_share: float = 0.6
    new_chunks: int = 8

    @property
    def held(self) -> int:
        return int(self.history_chunks * self.device_share)


# ---- names -------------------------------------------------------------


def group_ids(history: int, first: int = 0, count: int = HISTORY_CHUNKS) -> list[str]:
    """Group ids of chunks [first, first + count) of one history: 32 hex digits as a chunk hash has."""
    return [f"{NAMESPACE}/{history:016x}{chunk:016x}" for chunk in range(first, first + count)]


def keys_of(group: str) -> list[str]:
    return [f"{group}/{stage}" for stage in range(STAGES)]


# ---- the master's process, from /proc ---------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ---- client processes --------------------------------------------------


class Calls:
    """One client's calls, in either form."""

    def __init__(self, master: str) -> None:
        from kvpool import service
        from kvpool.pool.client import put_end_request, put_start_request
        from kvpool.pool.session_client import MasterSession
        from kvpool.rpc import pool_pb2, pool_pb2_grpc

        self.pb = pool_pb2
        # today's PutStart and PutEnd, as the pool client sends them
        self.put_start_request, self.put_end_request = put_start_request, put_end_request
        self.channel = service.channel(master)
        self.stub = pool_pb2_grpc.PoolMasterStub(self.channel)
        self.session = MasterSession(self.channel, self.stub)  # today's calls: messages on one stream
        self.hits = 0
        self.lookups = 0
        self.refused: dict[str, int] = {}  # put items neither reserved nor already there, by status
        self.short: list[int] = []  # how many leading groups a lookup that missed found (the first few)
        # the master's handle for each history's last lookup and how many groups it found, by the first id
        self.handles: dict[str, tuple[int, int]] = {}
        # today's releases and commits ride on the next message (``MasterSession.ride``); off: each awaited alone
        self.rides = True

    async def save(self, groups: list[str], legacy: bool, release: int = 0) -> int:
        """Put every stage's object of ``groups``: one pair for all, its start ending the lease ``release``
        (today), or one pair per stage (legacy, the stages at once). Returns the objects committed."""
        if not legacy:
            return await self._put([k for g in groups for k in keys_of(g)], release)
        done = await asyncio.gather(*(self._put([f"{g}/{stage}" for g in groups], legacy=True)
                                      for stage in range(STAGES)))
        return sum(done)

    async def _call(self, kind: str, unary: Any, request: Any, legacy: bool) -> Any:
        """A unary call (legacy) or the same call as a message on the session stream (today's)."""
        if legacy:
            return await unary(request, timeout=30)
        return await self.session.call(kind, request, unary, timeout=30)

    async def _put(self, keys: list[str], release: int = 0, legacy: bool = False) -> int:
        pb = self.pb
        items = [(k, k.rsplit("/", 1)[0], STAGES, OBJECT_BYTES) for k in keys]
        # today's request names whole groups and its answer is packed (``PutGroups``, ``PackedPutResults``), as
        # the pool client sends it; legacy's one message per item each way
        request = self.put_start_request(items, client_host="bench", release_lease_id=release, packed=True) \
            if not legacy else pb.PutStartRequest(client_host="bench", release_lease_id=release, items=[
                pb.PutItem(key=k, group_id=g, group_size=n, size=size) for k, g, n, size in items])
        started = await self._call("put_start", self.stub.PutStart, request, legacy)
        statuses = list(started.packed.status) if not legacy else [r.status for r in started.results]
        pairs = [(k, i + 1) for i, (k, status) in enumerate(zip(keys, statuses)) if status == pb.PUT_STATUS_RESERVED]
        # today's commit names whole groups and their checksums (``CommitGroups``) where the master takes them, as
        # the pool client sends it (else two flat arrays); legacy's a message per object
        commits = self.put_end_request(pairs, compact=not legacy, groups=not legacy and started.commits_groups)
        for status in statuses:
            if status not in (pb.PUT_STATUS_RESERVED, pb.PUT_STATUS_ALREADY_EXISTS):
                name = pb.PutStatus.Name(status)
                self.refused[name] = self.refused.get(name, 0) + 1
        if pairs and not legacy and self.rides:
            self.session.ride("put_end", commits, self._ride_done)
        elif pairs:
            await self._call("put_end", self.stub.PutEnd, commits, legacy)
        return len(pairs)

    def _ride_done(self, error: Any) -> None:
        if error is not None:
            name = f"ride_{error.code().name}"
            self.refused[name] = self.refused.get(name, 0) + 1

    async def lookup(self, groups: list[str], held: int, legacy: bool, release: bool = True,
                     form: str = "today", new_chunks: int = 0) -> tuple[float, int]:
        """Look a history up and (``release``) release its lease: the lookup's own latency (s), and the lease
        left to release (0 when released or none). ``form``: today's (the history's handle from its last
        lookup for all but its last ``new_chunks`` groups, as the next turn of a session sends it, the answer
        compact), ``by_ids`` (every id, compact), ``full_answer`` (every id, the answer packed in full)."""
        pb = self.pb
        handle, found = self.handles.pop(groups[0], (0, 0)) if form == "today" and not legacy else (0, 0)
        kept = min(len(groups) - new_chunks, found) if handle else 0  # (it stands for what its lookup found)
        request = (pb.LookupRequest(group_ids=groups, lease_ms=LEASE_MS) if legacy else
                   pb.LookupRequest(group_ids=groups[kept:], lease_ms=LEASE_MS, held_prefix=held, packed=True,
                                     packed_bytes=True, compact=form != "full_answer", history=handle,
                                     history_groups=kept))
        t0 = time.perf_counter()
        response = await self._call("lookup", self.stub.Lookup, request, legacy)
        took = time.perf_counter() - t0
        if handle and response.history_groups != kept:
            raise RuntimeError(f"the master did not take a history handle it gave ({response.history_unknown=})")
        if form == "today" and response.history:
            self.handles[groups[0]] = (response.history, response.num_complete)
        self.lookups += 1
        self.hits += response.num_complete == len(groups)
        if response.num_complete != len(groups) and len(self.short) < 8:
            self.short.append(response.num_complete)
        if response.lease_id and release and not legacy and self.rides:
            self.session.ride("release_lease", pb.ReleaseLeaseRequest(lease_id=response.lease_id), self._ride_done)
            return took, 0
        if response.lease_id and release:
            await self._call("release_lease", self.stub.ReleaseLease,
                             pb.ReleaseLeaseRequest(lease_id=response.lease_id), legacy)
            return took, 0
        return took, response.lease_id

    async def floor(self) -> None:
        """The cheapest call: one key's ``Exists`` (what any unary call costs the master)."""
        await self.stub.Exists(self.pb.ExistsRequest(keys=[f"{NAMESPACE}/floor/0"]), timeout=30)

    async def session_floor(self) -> None:
        """The cheapest session message: the release of a lease that is not there."""
        await self.session.call("release_lease", self.pb.ReleaseLeaseRequest(lease_id=1 << 62),
                                self.stub.ReleaseLease, timeout=30)

    async def close(self) -> None:
        await self.session.close()
        await self.channel.close()


def _run(job: dict[str, Any]) -> dict[str, Any]:
    import uvloop

    return uvloop.run(_job(job))


async def _job(job: dict[str, Any]) -> dict[str, Any]:
    calls = Calls(job["master"])
    try:
        start_at = job.get("start_at")
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        return await _KINDS[job["kind"]](calls, job)
    finally:
        await calls.close()


async def _populate(calls: Calls, job: dict[str, Any]) -> dict[str, Any]:
    committed = 0
    for history in job["histories"]:
        for first in range(0, HISTORY_CHUNKS, SAVE_CHUNKS):
            count = min(SAVE_CHUNKS, HISTORY_CHUNKS - first)
            committed += await calls.save(group_ids(history, first, count), legacy=False)
    return {"committed": committed, "refused": calls.refused}


def _loop_until(job: dict[str, Any]) -> tuple[float, int]:
    """(deadline as perf_counter, most calls) of a timed job."""
    return time.perf_counter() + job.get("seconds", math.inf), job.get("count", 1 << 62)


async def _ops(calls: Calls, job: dict[str, Any]) -> dict[str, Any]:
    """One kind of operation as fast as answered; the master's CPU read around the loop when ``pid`` is given."""
    op, legacy, turn = job["op"], job["legacy"], Turn(**job["turn"])
    form = job.get("form", "today")
    calls.rides = form != "rides_off"
    histories, fresh = job["histories"], job["fresh_from"]
    pid = job.get("pid")
    deadline, most = _loop_until(job)
    latencies: list[float] = []
    done = committed = 0
    cpu0 = cpu_seconds(pid) if pid else 0.0
    t0 = time.perf_counter()
    stop_file = job.get("stop_file")
    while done < most and time.perf_counter() < deadline and not (stop_file and os.path.exists(stop_file)):
        if op == "floor":
            await calls.floor()
        elif op == "session_floor":
            await calls.session_floor()
        lease = 0
        if op in ("lookup", "turn"):
            history = histories[done % len(histories)]
            held = turn.held if op == "turn" else 0
            # today a turn's save ends its lookup's lease in its first call; legacy releases on its own
            took, lease = await calls.lookup(group_ids(history), held, legacy, release=op == "lookup" or legacy,
                                             form="today" if form == "rides_off" else form,
                                             new_chunks=turn.new_chunks)
            latencies.append(took)
        if op in ("save", "turn"):
            count = SAVE_CHUNKS if op == "save" else turn.new_chunks
            # fresh chunks of a history nobody looks up: every save reserves, and at the watermark evicts
            committed += await calls.save(group_ids(fresh, done * count, count), legacy, lease)
        done += 1
    await calls.session.flush()  # the last call's rides, within what is counted
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(pid) - cpu0 if pid else 0.0
    return {"done": done, "wall_s": wall, "master_cpu_s": cpu, "latencies": latencies, "committed": committed,
            "hits": calls.hits, "lookups": calls.lookups, "short": calls.short, "refused": calls.refused}


_KINDS = {"populate": _populate, "ops": _ops}


# ---- one scale ------------------------------------------------------------


class Run:
    def __init__(self, pool: LocalPool, executor: ProcessPoolExecutor, clients: int, seconds: float,
                 cost_seconds: float, turn: Turn, leader: tuple[str, int] | None = None) -> None:
        """``leader``: (address, pid) of the master to measure (with standbys: the leader), else the one master."""
        self.pool = pool
        assert pool.master is not None
        self.master, self.pid = leader or (pool.master_address, int(pool.master.ready["pid"]))
        self.executor = executor
        self.clients = clients
        self.seconds = seconds
        self.cost_seconds = cost_seconds
        self.turn = turn
        self.fresh = 1 << 40  # histories past every populated one: each job's saves get their own
        self.unsettled: dict[str, dict[str, int]] = {}
        self.refused: dict[str, int] = {}
        self.workers = 0  # the most jobs submitted at once so far: the executor's processes already started

    def _fresh(self) -> int:
        self.fresh += 1
        return self.fresh

    def jobs(self, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.workers = max(self.workers, len(jobs))
        futures = [self.executor.submit(_run, {"master": self.master, **job}) for job in jobs]
        return [f.result() for f in futures]

    def populate(self, objects: int) -> dict[str, Any]:
        histories = math.ceil(objects / (HISTORY_CHUNKS * STAGES))
        rss0 = rss_bytes(self.pid)
        t0 = time.perf_counter()
        parts = [list(range(i, histories, self.clients)) for i in range(self.clients)]
        done = self.jobs([{"kind": "populate", "histories": part} for part in parts if part])
        wall = time.perf_counter() - t0
        stats = self.stats()
        resident = stats.num_objects
        return {"histories": histories, "committed": sum(d["committed"] for d in done), "populate_s": round(wall, 1),
                "resident_objects": resident, "used_share": round(stats.used_bytes / stats.capacity_bytes, 3),
                "index_bytes_per_object": round((rss_bytes(self.pid) - rss0) / max(1, resident))}

    def stats(self) -> Any:
        from kvpool import service
        from kvpool.rpc import pool_pb2, pool_pb2_grpc

        async def ask() -> Any:
            async with service.channel(self.master) as channel:
                return await pool_pb2_grpc.PoolMasterStub(channel).Stats(pool_pb2.StatsRequest(), timeout=10)
        return asyncio.run(ask())

    def settle(self, phase: str, timeout_s: float = 120.0) -> None:
        """Wait until every store has acknowledged every change to its segment (the heartbeats that carry
        them are the master's work too, and must not spill into the next measurement); a phase measured
        without that is named in ``unsettled`` with what was left."""
        deadline = time.monotonic() + timeout_s
        while True:
            segments = self.stats().segments
            if all(s.acked_sequence == s.sequence for s in segments):
                return
            if time.monotonic() > deadline:
                self.unsettled[phase] = {s.segment_id: s.sequence - s.acked_sequence for s in segments}
                return
            time.sleep(0.1)

    def refresh(self, histories: list[int]) -> None:
        """Put back whatever of ``histories`` the churn evicted (what is there is left alone), so their
        lookups hit."""
        parts = [histories[i::self.clients] for i in range(self.clients)]
        for done in self.jobs([{"kind": "populate", "histories": part} for part in parts if part]):
            for status, count in done["refused"].items():  # why a history might not hit (should stay empty)
                self.refused[status] = self.refused.get(status, 0) + count
        # and each looked up once, so all of it is newer than whatever the phases before saved: a put leaves a
        # group that was there where it was in the order, and the next phase's saves would evict those first
        self.jobs([{"kind": "ops", "op": "lookup", "legacy": False, "turn": _turn(self.turn), "histories": histories,
                    "fresh_from": self._fresh(), "count": len(histories)}])

    def cost(self, op: str, legacy: bool, histories: list[int], form: str = "today") -> dict[str, Any]:
        """The master's CPU per operation, one client calling one after another (``form``: a lookup's, as
        ``Calls.lookup`` takes it)."""
        if op in ("lookup", "turn"):
            self.refresh(histories)
        self.settle(f"{op}_cpu_ms" + ("_legacy" if legacy else ""))
        job = {"kind": "ops", "op": op, "legacy": legacy, "turn": _turn(self.turn), "form": form,
               "histories": histories, "fresh_from": self._fresh(), "pid": self.pid, "seconds": self.cost_seconds}
        if op == "turn":  # its saves evict: at most half of what the pool holds beside the histories it looks up
            spare = self.stats().num_objects - len(histories) * HISTORY_CHUNKS * STAGES
            job["count"] = max(1, spare // 2 // (self.turn.new_chunks * STAGES))
        (result,) = self.jobs([job])
        return {"cpu_ms": round(result["master_cpu_s"] * 1e3 / max(1, result["done"]), 3), "calls": result["done"],
                "hit_share": _share(result["hits"], result["lookups"]), "short": result["short"]}

    def saturate(self, op: str, histories: list[int], churn: bool = False, at_least: int = 0) -> dict[str, Any]:
        """Every client at once for ``seconds``, or until they made ``at_least`` calls together (plus one saver
        while they run when ``churn``); the master's CPU over them."""
        if op in ("lookup", "turn"):
            self.refresh(histories)
        self.settle(f"{op}s_per_s")
        # after every process started: a spawned one takes seconds, one started by an earlier phase none
        start_at = time.time() + (3.0 if self.clients + churn > self.workers else 0.5)
        self.workers = max(self.workers, self.clients + churn)
        timed = {"count": -(-at_least // self.clients)} if at_least else {"seconds": self.seconds}
        base = {"kind": "ops", "legacy": False, "turn": _turn(self.turn), "start_at": start_at}
        per = max(1, len(histories) // self.clients)
        jobs = [{**base, **timed, "op": op, "fresh_from": self._fresh(),
                 "histories": histories[i * per:(i + 1) * per] or histories} for i in range(self.clients)]
        stop_file = Path(tempfile.mkdtemp(prefix="kvpool-bench-master-stop-")) / "stop"
        if churn:  # saves without pause until every other client is done
            jobs.append({**base, "op": "save", "histories": histories, "fresh_from": self._fresh(),
                         "stop_file": str(stop_file)})
        evicted0 = self.stats().evicted_groups
        futures = [self.executor.submit(_run, {"master": self.master, **job}) for job in jobs]
        time.sleep(max(0.0, start_at - time.time()))
        cpu0 = cpu_seconds(self.pid)
        results = [f.result() for f in futures[:self.clients]]
        cpu = cpu_seconds(self.pid) - cpu0
        stop_file.touch()
        results += [f.result() for f in futures[self.clients:]]
        stop_file.unlink()
        stop_file.parent.rmdir()
        wall = max(r["wall_s"] for r in results)
        mine = results[:self.clients]
        latencies = sorted(x for r in mine for x in r["latencies"])
        out: dict[str, Any] = {
            "calls": sum(r["done"] for r in mine), "per_s": round(sum(r["done"] for r in mine) / wall, 1),
            "master_busy": round(cpu / wall, 2), "evicted_groups": self.stats().evicted_groups - evicted0,
        }
        if latencies:
            out["lookup_ms_p50"] = round(statistics.median(latencies) * 1e3, 2)
            out["lookup_ms_p99"] = round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3, 2)
            out["hit_share"] = _share(sum(r["hits"] for r in mine), sum(r["lookups"] for r in mine))
        if churn:
            out["saves_per_s_beside"] = round(results[-1]["done"] / wall, 1)
        return out


def _turn(turn: Turn) -> dict[str, Any]:
    return {"history_chunks": turn.history_chunks, "device_share": turn.device_share, "new_chunks": turn.new_chunks}


def _leader(pool: LocalPool) -> tuple[str, int]:
    """The elected leader's address and pid (with standbys), once the stores have mounted on it."""
    from kvpool.tools.bench.faults_leader import leader

    assert pool.cluster is not None and pool.cluster.etcd is not None
    etcd = pool.cluster.etcd.endpoint
    deadline = time.monotonic() + 30.0
    while True:
        address, _ = asyncio.run(leader(etcd))
        if address:
            stats = asyncio.run(_segments(address))
            if stats == 2:
                return address, int(pool.candidate_at(address).ready["pid"])
        if time.monotonic() > deadline:
            raise RuntimeError("no leader with both stores mounted within 30 s")
        time.sleep(0.1)


async def _segments(address: str) -> int:
    import grpc

    from kvpool import service
    from kvpool.rpc import pool_pb2, pool_pb2_grpc

    async with service.channel(address) as channel:
        try:
            stats = await pool_pb2_grpc.PoolMasterStub(channel).Stats(pool_pb2.StatsRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return 0
    return len(stats.segments)


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 3) if whole else None


def measure(objects: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    turn = Turn(HISTORY_CHUNKS, args.turn_device_share, args.turn_new_chunks)
    capacity = math.ceil(objects * OBJECT_BYTES / HIGH_WATERMARK)
    segment = math.ceil(capacity / 2 / (1 << 20)) << 20
    context = get_context("spawn")
    standbys = getattr(args, "master_standbys", 0)
    with LocalPool(num_stores=2, segment_size=str(segment), workdir=workdir, master_standbys=standbys,
                   master_args=["--high-watermark", str(HIGH_WATERMARK),
                                "--heartbeat-interval-s", str(args.heartbeat_interval_s)]) as pool, \
            ProcessPoolExecutor(max_workers=args.clients + 1, mp_context=context) as executor:
        run = Run(pool, executor, args.clients, args.seconds, args.cost_seconds, turn,
                  _leader(pool) if standbys else None)
        report: dict[str, Any] = {"objects": objects, **run.populate(objects),
                                  "index_order": run.stats().index_order or "unknown"}
        newest = list(range(report["histories"]))[-max(1, min(64, report["histories"] // 2)):]
        report["call_floor_cpu_ms"] = run.cost("floor", False, newest)["cpu_ms"]
        report["session_floor_cpu_ms"] = run.cost("session_floor", False, newest)["cpu_ms"]
        # each op in the older call pattern and today's, side by side; a lookup and a turn also by every id (no
        # history handle), and a lookup with its answer packed in full besides (before the compact form)
        forms = [("lookup", True, "today"), ("lookup", False, "today"), ("lookup", False, "by_ids"),
                 ("lookup", False, "full_answer"), ("lookup", False, "rides_off"), ("save", True, "today"),
                 ("save", False, "today"), ("save", False, "rides_off"), ("turn", True, "today"),
                 ("turn", False, "today"), ("turn", False, "by_ids"), ("turn", False, "rides_off")]
        for op, legacy, form in forms:
            key = f"{op}_cpu_ms" + ("_legacy" if legacy else "") + ("" if form == "today" else f"_{form}")
            cost = run.cost(op, legacy, newest, form)
            report[key] = cost["cpu_ms"]
            report.setdefault("cost_calls", {})[key] = cost["calls"]
            if cost["hit_share"] is not None:
                report.setdefault("cost_hit_share", {})[key] = cost["hit_share"]
            if cost["short"]:  # a miss: the leading groups its lookups found (why, next to refresh_refused)
                report.setdefault("cost_misses_found", {})[key] = cost["short"]
        lookups = run.saturate("lookup", newest, churn=True, at_least=args.lookups)
        report.update(lookups_per_s=lookups["per_s"], lookup_ms_p50=lookups["lookup_ms_p50"],
                      lookup_ms_p99=lookups["lookup_ms_p99"], lookup_hit_share=lookups["hit_share"],
                      lookups_measured=lookups["calls"], saves_per_s_beside=lookups["saves_per_s_beside"],
                      master_busy_lookups=lookups["master_busy"],
                      evicted_groups_during_lookups=lookups["evicted_groups"])
        saves = run.saturate("save", newest)
        report.update(saves_per_s=saves["per_s"], master_busy_saves=saves["master_busy"])
        turns = run.saturate("turn", newest)
        report.update(turns_per_s_per_master=turns["per_s"], master_busy_turns=turns["master_busy"],
                      turns_per_s_from_cpu=round(1e3 / report["turn_cpu_ms"], 1) if report["turn_cpu_ms"] else None)
        final = run.stats()
        report["resident_objects_after"] = final.num_objects
        report["unsettled"] = run.unsettled  # phases measured while the stores still caught up (should be none)
        report["refresh_refused"] = run.refused  # put items a refresh could not store, by status (should be none)
        report["evicted_groups_total"] = final.evicted_groups
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.seconds = args.seconds or (3.0 if args.quick else 8.0)
    args.cost_seconds = args.cost_seconds or (1.5 if args.quick else 3.0)
    args.lookups = args.lookups or (1000 if args.quick else 10_000)
    scales = [int(s) for s in args.objects.split(",")] if args.objects else (
        [10_000, 100_000] if args.quick else [100_000, 1_000_000])
    report: dict[str, Any] = {"stages": STAGES, "history_chunks": HISTORY_CHUNKS, "save_chunks": SAVE_CHUNKS,
                              "object_bytes": OBJECT_BYTES, "clients": args.clients,
                              "turn": _turn(Turn(HISTORY_CHUNKS, args.turn_device_share, args.turn_new_chunks)),
                              "cpus": os.cpu_count(), "master_standbys": getattr(args, "master_standbys", 0),
                              "heartbeat_interval_s": args.heartbeat_interval_s}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-master-") as tmp:
        for objects in scales:
            report.setdefault("scales", []).append(measure(objects, args, Path(tmp) / str(objects)))
    # the order of groups the measured master ran, as it says (C where it built kvpool/native/lru.c, else Python);
    # "unknown" from a master that does not say
    report["index_order"] = report["scales"][0]["index_order"]
    largest = max(report["scales"], key=lambda at: at["objects"])
    report["targets"] = {key: {"at": max(scales), "value": largest[key], "target": limit,
                               "met": largest[key] <= limit} for key, limit in TARGETS.items()}
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"kvpool bench master: {report['stages']} stages, histories of {report['history_chunks']} chunks, "
             f"{report['clients']} clients, {report['cpus']} CPUs"]
    for value in report["scales"]:
        lines.append(f"{value['objects']:,} objects ({value['resident_objects']:,} resident, "
                     f"{value['index_bytes_per_object']} B each in the master); the cheapest call costs the "
                     f"master {value['call_floor_cpu_ms']} ms, a session message "
                     f"{value['session_floor_cpu_ms']} ms:")
        for op in ("lookup", "save", "turn"):
            full = f", answer in full {value['lookup_cpu_ms_full_answer']}" if op == "lookup" else ""
            full = (f", by ids {value[f'{op}_cpu_ms_by_ids']}" if op != "save" else "") + full
            full += f", rides off {value[f'{op}_cpu_ms_rides_off']}" if f"{op}_cpu_ms_rides_off" in value else ""
            lines.append(f"  {op}_cpu_ms {value[f'{op}_cpu_ms']} (legacy {value[f'{op}_cpu_ms_legacy']}{full})")
        lines.append(f"  lookups/s {value['lookups_per_s']} (p50 {value['lookup_ms_p50']} ms, p99 "
                     f"{value['lookup_ms_p99']} ms, hits {value['lookup_hit_share']}), saves/s {value['saves_per_s']}, "
                     f"turns/s {value['turns_per_s_per_master']}")
    for key, target in report["targets"].items():
        lines.append(f"{key} at {target['at']:,}: {target['value']} (target <= {target['target']}: "
                     f"{'met' if target['met'] else 'NOT met'})")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    report = run(args)
    print(format_report(report))
    if args.json:
        print(json.dumps(report))
    return 0
