"""``kvpool bench faults``' leader scenario: a master and a standby elected through etcd, under load.

Real processes on this host: etcd, two master candidates, two stores, and
this process's pool client (it follows the leader through etcd) with a
writer that saves groups in a loop and readers that read acknowledged
groups back and compare every byte.

1. The leader is killed with SIGKILL ``leader_kills`` times under that load
   (each time the killed candidate comes back as a standby before the next):
   ``failover_s`` from the kill to the first lookup the new leader answers
   with a hit (the client's own lookups, so its switch through the etcd
   watch counts).
2. ``objects_lost``: after the kills, every object whose ``PutEnd`` was
   acknowledged and is not found (or not read back equal).
3. ``fenced``: the leader paused with SIGSTOP past its lease, resumed once
   another leads: it answers nothing, and a put it had reserved before the
   pause does not commit.
4. ``leader_changes_without_kills``: leader changes over ``quiet_s`` of the
   same load with no fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvpool import service
from kvpool.ha.election import LEADER_KEY, leader_of
from kvpool.ha.etcd_client import EtcdClient
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import PutObject, PutResult
from kvpool.rpc import pool_pb2, pool_pb2_grpc
from kvpool.tools.cluster import LocalPool
from kvpool.transfer import HostBuffer, TransferEngine

KB = 1024
MEMBERS = 4
OBJECT_BYTES = 16 * KB
SEGMENT_SIZE = "256MiB"  # two: room for every group the run writes below the eviction watermark
SLOTS = 256  # groups whose sources live in the buffer; group g's bytes are slot g % SLOTS's
READERS = 2
FAILOVER_DEADLINE_S = 30.0


SOURCE_BYTES = SLOTS * MEMBERS * OBJECT_BYTES


def fill_sources(buffer: HostBuffer) -> None:
    """Random bytes in every slot: what the groups are saved from and compared with."""
    rng = np.random.default_rng(11)
    view = np.frombuffer(buffer.view(0, SOURCE_BYTES), dtype=np.uint8)
    view[:] = rng.integers(0, 256, size=SOURCE_BYTES, dtype=np.uint8)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else 0.0


@dataclass(slots=True)
class Load:
    """A writer of new groups and readers of acknowledged ones, through one pool client."""

    client: PoolClient
    buffer: HostBuffer
    acknowledged: list[str] = field(default_factory=list)  # groups whose every PutEnd was answered
    puts: int = 0
    puts_not_stored: int = 0
    reads: int = 0
    read_misses: int = 0
    wrong_bytes: int = 0
    failed: int = 0  # calls that raised instead of answering (a request that would fail)
    pause_s: float = 0.02  # between saves: the writer's pace (the quiet window slows it, so nothing is evicted)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def source_bytes(self) -> int:
        return SOURCE_BYTES

    def source(self, g: int, m: int) -> int:
        return ((g % SLOTS) * MEMBERS + m) * OBJECT_BYTES

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._write())]
        self._tasks += [asyncio.create_task(self._read(r)) for r in range(READERS)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def put_group(self, g: int) -> bool:
        group_id = f"bench-leader/g{g}"
        objects = [PutObject(f"{group_id}/{m}", group_id, MEMBERS, self.buffer.address + self.source(g, m),
                             OBJECT_BYTES) for m in range(MEMBERS)]
        try:
            results = await self.client.put(objects)
        except grpc.aio.AioRpcError:
            self.failed += 1
            return False
        self.puts += 1
        if results == [PutResult.STORED] * MEMBERS:
            self.acknowledged.append(group_id)
            return True
        self.puts_not_stored += 1  # not acknowledged: the caller would recompute, nothing is wrong
        return False

    async def _write(self) -> None:
        g = 0
        while not self._stop.is_set():
            stored = await self.put_group(g)
            g += 1
            await asyncio.sleep(self.pause_s if stored else max(self.pause_s, 0.05))

    async def read_group(self, group_id: str, reader: int) -> tuple[bool, int]:
        """(found and read back equal, wrong bytes)."""
        g = int(group_id.rsplit("g", 1)[1])
        found = await self.client.lookup([group_id], lease_ms=5000)
        if not found.groups:
            return False, 0
        try:
            members = found.groups[0].members
            base = self.source_bytes + reader * MEMBERS * OBJECT_BYTES
            items = [(members[f"{group_id}/{m}"], self.buffer.address + base + m * OBJECT_BYTES)
                     for m in range(MEMBERS)]
            verified = await self.client.read(items)
            wrong = 0
            for m, ok in enumerate(verified):
                if ok:
                    got = np.frombuffer(self.buffer.view(base + m * OBJECT_BYTES, OBJECT_BYTES), dtype=np.uint8)
                    want = np.frombuffer(self.buffer.view(self.source(g, m), OBJECT_BYTES), dtype=np.uint8)
                    wrong += int(np.count_nonzero(got != want))
            return all(verified) and wrong == 0, wrong
        finally:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.client.release(found.lease_id)

    async def _read(self, reader: int) -> None:
        rng = random.Random(reader)
        while not self._stop.is_set():
            if not self.acknowledged:
                await asyncio.sleep(0.05)
                continue
            try:
                ok, wrong = await self.read_group(rng.choice(self.acknowledged), 1 + reader)
            except grpc.aio.AioRpcError:
                self.failed += 1
                ok, wrong = False, 0
            self.reads += 1
            self.read_misses += not ok
            self.wrong_bytes += wrong
            await asyncio.sleep(0.01 if ok else 0.05)


async def leader(etcd: str) -> tuple[str, int]:
    client = EtcdClient(etcd)
    try:
        kv, _ = await client.get(LEADER_KEY)
    finally:
        await client.close()
    found = leader_of(kv) if kv is not None else None
    return (found.address, int(found.epoch)) if found is not None else ("", 0)


async def _wait(check: Any, what: str, timeout_s: float) -> float:
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def _kill_once(pool: LocalPool, load: Load, etcd: str) -> float:
    address, epoch = await leader(etcd)
    victim = pool.candidate_at(address)
    probe = load.acknowledged[-1]

    async def served_by_new_leader() -> bool:
        found = await load.client.lookup([probe])  # a miss while no leader answers: the caller would compute
        if found.lease_id:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await load.client.release(found.lease_id)
        return found.num_complete == 1 and load.client.link.epoch > epoch

    victim.kill()
    failover_s = await _wait(served_by_new_leader, "the first lookup served by the new leader", FAILOVER_DEADLINE_S)
    assert pool.cluster is not None
    await asyncio.to_thread(pool.cluster.restart_candidate, victim.name)  # back as a standby
    return failover_s


async def _fenced(pool: LocalPool, load: Load, etcd: str) -> dict[str, Any]:
    """Pause the leader past its lease, resume it once another leads: it must answer and commit nothing."""
    address, epoch = await leader(etcd)
    victim = pool.candidate_at(address)
    refused = 0
    calls = 0
    async with service.channel(address) as channel:
        stub = pool_pb2_grpc.PoolMasterStub(channel)
        item = pool_pb2.PutItem(key="bench-leader/late/0", group_id="bench-leader/late", group_size=1,
                                size=OBJECT_BYTES)
        started = await stub.PutStart(pool_pb2.PutStartRequest(items=[item]), timeout=5.0)
        reserved = started.results[0].status == pool_pb2.PUT_STATUS_RESERVED
        victim.pause()
        try:  # another wins only once etcd expired the paused leader's lease: it is past it then
            await _wait(lambda: _newer(etcd, epoch), "a new leader while the old one is paused", FAILOVER_DEADLINE_S)
        finally:
            victim.resume()
        for call in (
            lambda: stub.PutEnd(pool_pb2.PutEndRequest(items=[pool_pb2.PutCommit(key=item.key, checksum=1)]),
                                timeout=5.0),
            lambda: stub.Lookup(pool_pb2.LookupRequest(group_ids=load.acknowledged[:1]), timeout=5.0),
            lambda: stub.PutStart(pool_pb2.PutStartRequest(items=[item]), timeout=5.0),
        ):
            calls += 1
            try:
                await call()
            except grpc.aio.AioRpcError as exc:
                refused += exc.code() == grpc.StatusCode.UNAVAILABLE
    late = await load.client.lookup(["bench-leader/late"])
    if late.lease_id:
        await load.client.release(late.lease_id)
    assert pool.cluster is not None
    victim.kill()  # a clean slate for what follows: it comes back as a standby
    await asyncio.to_thread(pool.cluster.restart_candidate, victim.name)
    return {"fenced": reserved and refused == calls and late.num_complete == 0,
            "fenced_calls_refused": refused, "fenced_calls": calls}


async def _newer(etcd: str, epoch: int) -> bool:
    return (await leader(etcd))[1] > epoch


async def _count_changes(etcd: str, seconds: float) -> int:
    """Leader changes seen in etcd over ``seconds`` (a revision that differs from the one before)."""
    changes = 0
    _, epoch = await leader(etcd)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        _, now = await leader(etcd)
        if now != epoch:
            changes += 1
            epoch = now
    return changes


SAVE_SAMPLES = 200


async def save_ms(load: Load, first: int) -> float:
    """The median client-observed time of a save (one group of ``MEMBERS`` objects: PutStart, the bytes by
    shared memory, PutEnd) over ``SAVE_SAMPLES`` saves one after another, nothing else running."""
    times = []
    for g in range(first, first + SAVE_SAMPLES):
        start = time.perf_counter()
        stored = await load.put_group(g)
        times.append((time.perf_counter() - start) * 1000)
        if not stored:
            raise RuntimeError("a save was not stored while measuring what a save costs")
    return statistics.median(times)


async def single_master_save_ms(workdir: Path, engine: TransferEngine, buffer: HostBuffer,
                                master_args: list[str]) -> float:
    """``save_ms`` on the one master without etcd, the same stores and buffer: the baseline of the same run."""
    with LocalPool(num_stores=2, segment_size=SEGMENT_SIZE, master_args=master_args,
                   workdir=workdir / "single") as pool:
        client = PoolClient(pool.master_address, engine)
        client.register(buffer.address, buffer.size)
        try:
            load = Load(client, buffer)
            return await save_ms(load, 2 * 10**6)
        finally:
            await client.close()


async def run_leader(workdir: Path, leader_kills: int, quiet_s: float, master_args: list[str]) -> dict[str, Any]:
    engine = TransferEngine()
    buffer = HostBuffer((SLOTS + READERS + 1) * MEMBERS * OBJECT_BYTES)
    engine.register(buffer.address, buffer.size)
    fill_sources(buffer)
    single_ms = await single_master_save_ms(workdir, engine, buffer, master_args)
    with LocalPool(num_stores=2, segment_size=SEGMENT_SIZE, master_args=master_args, workdir=workdir / "leader",
                   master_standbys=1) as pool:
        assert pool.cluster is not None and pool.cluster.etcd is not None
        etcd = pool.cluster.etcd.endpoint
        client = PoolClient(pool.master_address, engine)
        client.register(buffer.address, buffer.size)
        load = Load(client, buffer)
        try:
            if not await client.connect(30.0):
                raise RuntimeError("no master leader announced in etcd")
            await _wait(lambda: load.put_group(10**6), "a first save", FAILOVER_DEADLINE_S)
            standby_ms = await save_ms(load, 3 * 10**6)
            load.acknowledged.clear()  # measured saves aside: the load's own are checked at the end
            load.start()
            await _wait(lambda: _at_least(load, 8), "saves under load", FAILOVER_DEADLINE_S)
            epoch0 = (await leader(etcd))[1]
            failovers = [await _kill_once(pool, load, etcd) for _ in range(leader_kills)]
            out: dict[str, Any] = {
                # what a save costs the client when PutEnd waits for the stores to hold its commit
                "save_ms_p50_single_master": round(single_ms, 3), "save_ms_p50_with_standby": round(standby_ms, 3),
                "leader_kills": leader_kills,
                "failover_s_p50": round(percentile(failovers, 0.5), 3),
                "failover_s_p99": round(percentile(failovers, 0.99), 3),
                "failover_s_max": round(max(failovers, default=0.0), 3),
                "failover_s": [round(f, 3) for f in failovers],
                "epochs_during_kills": (await leader(etcd))[1] > epoch0,
            }
            out.update(await _fenced(pool, load, etcd))
            # settle: the last candidate back, then the quiet window under the same load
            target = len(load.acknowledged) + 4
            await _wait(lambda: _at_least(load, target), "saves after the faults", FAILOVER_DEADLINE_S)
            load.pause_s = 0.2
            out["quiet_s"] = quiet_s
            out["leader_changes_without_kills"] = await _count_changes(etcd, quiet_s)
            await load.stop()
            lost = wrong = 0
            for group_id in load.acknowledged:
                ok, bad = await load.read_group(group_id, 0)
                lost += not ok
                wrong += bad
            # an evicted group is not lost to a failover: the run is sized so that none is, and says so
            out["evicted_groups"] = (await client.stats()).evicted_groups
            out.update(
                groups_acknowledged=len(load.acknowledged), objects_acknowledged=len(load.acknowledged) * MEMBERS,
                objects_lost=lost * MEMBERS, groups_lost=lost, wrong_bytes=load.wrong_bytes + wrong,
                requests_failed=load.failed, puts=load.puts, puts_not_stored=load.puts_not_stored,
                reads=load.reads, read_misses=load.read_misses,
            )
            return out
        finally:
            if not load._stop.is_set():
                await load.stop()
            await client.close()


async def _at_least(load: Load, count: int) -> bool:
    return len(load.acknowledged) >= count


def leader_targets(result: dict[str, Any]) -> dict[str, bool]:
    return {
        "failover_p50_at_most_3s": result["failover_s_p50"] <= 3.0,
        "failover_p99_at_most_6s": result["failover_s_p99"] <= 6.0,
        "no_object_lost": result["objects_lost"] == 0,
        "no_wrong_bytes_leader": result["wrong_bytes"] == 0,
        "no_request_failed": result["requests_failed"] == 0,
        "fenced": bool(result["fenced"]),
        "no_leader_change_without_kills": result["leader_changes_without_kills"] == 0,
    }


def format_leader(r: dict[str, Any]) -> str:
    return "\n".join([
        (f"a save (4 × 16 KiB): p50 {r['save_ms_p50_with_standby']} ms with a standby (PutEnd waits for the stores), "
         f"{r['save_ms_p50_single_master']} ms on one master"),
        (f"leader kill -9 ×{r['leader_kills']} under load: failover p50 {r['failover_s_p50']} s, "
         f"p99 {r['failover_s_p99']} s (max {r['failover_s_max']} s)"),
        (f"acknowledged groups {r['groups_acknowledged']}: objects lost {r['objects_lost']}, wrong bytes "
         f"{r['wrong_bytes']}, requests failed {r['requests_failed']} ({r['puts_not_stored']} of {r['puts']} saves "
         f"not stored, {r['read_misses']} of {r['reads']} reads missed: recompute)"),
        (f"leader paused past its lease and resumed: fenced={r['fenced']} "
         f"({r['fenced_calls_refused']}/{r['fenced_calls']} calls refused)"),
        f"leader changes without kills over {r['quiet_s']} s of load: {r['leader_changes_without_kills']}",
    ])
