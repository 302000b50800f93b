"""The store daemon: one NUMA-pinned DRAM segment contributed to the pool.

Start-up order matters: pin the process to its node and set the memory
policy, then map the segment and fault its pages in (so they land on that
node), then register it with the transfer engine, then offer it as shared
memory to pool clients on this host (``--shared-memory``: a sealed memfd,
handed over a Unix socket in a 0700 folder to peers of this user only,
``kvpool.shared_memory``), then mount it on the master, naming where it is
mapped. The daemon keeps heart-beating; when the master answers that it does
not know the segment (it restarted), the daemon mounts it again.

Each heartbeat response carries the changes to the objects committed in this
segment; the daemon keeps their records (``SegmentRecords``) and reports the
ones whose bytes still verify when it mounts, so a restarted master gets the
segment's objects back without a byte copied (block reports).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvpool.host_memory import refuse_unless_fits
from kvpool import service
from kvpool.transfer import HostBuffer, TransferEngine, local_host_name
from kvpool.core.pool.paths import SharedMemoryRef
from kvpool.core.pool.records import ObjectRecord
from kvpool.shared_memory import SegmentShare, SharedSegment
from kvpool.services.store import numa
from kvpool.ha.election import Registration
from kvpool.ha.etcd_client import EtcdClient
from kvpool.ha.master_link import MasterLink
from kvpool.services.store.master_client import Beat, MasterClient, SegmentMount
from kvpool.services.store.records import SegmentRecords
from kvpool.services.store.settings import StoreSettings

log = structlog.get_logger(__name__)

RETRY_MIN_S = 0.1
# with etcd: a store's registration lease; a store that dies is dead for placement this long after
REGISTRATION_TTL_S = 2
REGISTRATION_KEEPALIVE_S = 0.4
# a restarted master should get its block reports at once: reconnect every
# 0.25 s at most rather than gRPC's default backoff (up to 2 s here); one
# store's connection attempts cost a dead master nothing
MASTER_CHANNEL_OPTIONS = [
    *[(k, v) for k, v in service.GRPC_OPTIONS if k != "grpc.max_reconnect_backoff_ms"],
    ("grpc.max_reconnect_backoff_ms", 250),
]


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class StoreMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.segment_bytes = Gauge("kvpool_store_segment_bytes", "Bytes of this store's segment", registry=r)
        self.mounted = Gauge("kvpool_store_mounted", "1 while the master has our segment mounted", registry=r)
        self.mounts = Counter("kvpool_store_mounts", "Successful mounts (first and re-mounts)", registry=r)
        self.heartbeat_failures = Counter("kvpool_store_heartbeat_failures", "Heartbeats that failed", registry=r)
        self.records = Gauge("kvpool_store_records", "Records of committed objects held for block reports",
                             registry=r)
        self.reported = Counter("kvpool_store_reported_records", "Records sent in block reports", registry=r)
        self.adopted = Counter("kvpool_store_adopted_records", "Reported records the master made objects again",
                               registry=r)
        self.rejected = Counter("kvpool_store_rejected_records", "Reported records the master rejected", registry=r)
        self.unverified = Counter("kvpool_store_unverified_records",
                                  "Records not reported because their bytes no longer match", registry=r)


@dataclass(slots=True)
class Store:
    """A mounted (or mounting) segment and its link to the master."""

    settings: StoreSettings
    engine: TransferEngine | None  # None: reached only by shared memory (no engine port)
    segment: HostBuffer | SharedSegment
    master: MasterClient | None  # None until a leader is found (with etcd)
    metrics: StoreMetrics
    host_name: str = field(default_factory=local_host_name)
    incarnation: str = ""
    heartbeat_interval_s: float = 0.0
    records: SegmentRecords = field(default_factory=SegmentRecords)
    shared: SharedMemoryRef | None = None  # where clients on this host map the segment
    link: MasterLink | None = None  # with etcd: follows the leader (``master`` is a client of its channel)
    _channel_of_master: Any = None

    @property
    def endpoint(self) -> str:
        return self.engine.endpoint if self.engine is not None else ""

    @property
    def with_standbys(self) -> bool:
        return self.link is not None and self.link.watch is not None

    async def _follow_leader(self) -> None:
        """With etcd: reach the leader announced now (waiting for one), before a mount."""
        assert self.link is not None
        if not await self.link.connect(self.settings.heartbeat_interval_s):
            raise _unavailable(f"no master leader announced in etcd at {self.link.etcd}")
        if self.link.stale():
            await self.link.follow()
        if self.link.channel is not self._channel_of_master:
            assert self.link.channel is not None
            self.master = MasterClient(self.link.channel)
            self._channel_of_master = self.link.channel

    async def mount(self) -> None:
        if self.with_standbys:
            await self._follow_leader()
        assert self.master is not None
        report, unverified = await asyncio.to_thread(self._verified_records)
        if unverified:
            self.metrics.unverified.inc(len(unverified))
            log.warning("records_unverified", count=len(unverified), first_key=unverified[0])
        response = await self.master.mount(
            SegmentMount(self.settings.segment_id, self.endpoint, self.host_name, self.segment.address,
                         self.segment.size, self.settings.numa_node, self.shared),
            report,
        )
        if self.link is not None and not self.link.admit(response.epoch):
            raise _unavailable(f"a deposed master (epoch {response.epoch}) answered the mount")
        rejected = response.rejected_keys
        self.records.reset([r for r in report if r.key not in rejected], response.sequence)
        self.metrics.records.set(len(self.records))
        self.metrics.reported.inc(len(report))
        self.metrics.adopted.inc(response.num_adopted)
        self.metrics.rejected.inc(len(rejected))
        if report:
            log.info("block_report", reported=len(report), adopted=response.num_adopted, rejected=len(rejected))
        if self.incarnation and response.master_incarnation != self.incarnation:
            log.warning("master_restarted_remounted", incarnation=response.master_incarnation)
        self.incarnation = response.master_incarnation
        # the master knows its TTL: beat at the pace it asks for, never slower than ours
        advised = response.heartbeat_interval_s
        own = self.settings.heartbeat_interval_s
        self.heartbeat_interval_s = min(advised, own) if advised > 0 else own
        self.metrics.mounted.set(1)
        self.metrics.mounts.inc()
        log.info("segment_mounted", segment_id=self.settings.segment_id, master=self.settings.master,
                 incarnation=self.incarnation, epoch=response.epoch or None)

    def _verified_records(self) -> tuple[list[ObjectRecord], list[str]]:
        with self.segment.view() as view:
            return self.records.verified(view)

    async def mount_until_done(self, stop: asyncio.Event, first: bool = False) -> bool:
        """Retry mounting with backoff until it works or we are told to stop.

        Whatever the master answers, the store keeps trying: a master that is
        starting, overloaded or briefly confused must not cost the pool this
        segment. Only the first mount gives up on INVALID_ARGUMENT, which
        means this store's own settings are wrong (the message says which).
        """
        delay = 0.1
        while not stop.is_set():
            try:
                await self.mount()
                return True
            except grpc.aio.AioRpcError as exc:
                if first and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and len(self.records):
                    # the report is what the master cannot take: mount with nothing rather than never
                    log.warning("block_report_refused", records=len(self.records), details=exc.details())
                    self.records.reset([], 0)
                log.warning("mount_failed", master=self.settings.master, code=exc.code().name,
                            details=exc.details(), retry_in_s=delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, self.settings.heartbeat_interval_s)
        return False

    async def heartbeat_forever(self, stop: asyncio.Event) -> None:
        """Beat until stopped; re-mount when the master does not know the segment.

        Each answer's changes are applied to the records and acknowledged by
        the next beat, which comes at once when more wait. Never ends on an
        error: any status is logged and counted, and the next beat (or
        re-mount) tries again, soon at first, so a restarted master gets its
        block report within a fraction of the interval.
        """
        wait_s = self.heartbeat_interval_s
        failures = 0
        while not stop.is_set():
            if wait_s > 0:
                await self._pause(stop, wait_s)
            if stop.is_set():
                return
            if self.with_standbys and self.link is not None and self.link.stale():
                log.info("master_leader_changed", segment_id=self.settings.segment_id)
                self.metrics.mounted.set(0)
                await self.mount_until_done(stop)
                wait_s = 0.0
                continue
            try:
                response = await self._beat()
                if response is None:  # the leader changed while the beat waited
                    wait_s = 0.0
                    continue
                self.metrics.mounted.set(1)
                self.records.apply(response.changes)
                self.metrics.records.set(len(self.records))
                # with standbys the master holds each beat until a commit waits: beat again at once
                wait_s = 0.0 if response.more or self.with_standbys else self.heartbeat_interval_s
                failures = 0
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    # the master restarted (or dropped us after a long pause)
                    self.metrics.heartbeat_failures.inc()
                    self.metrics.mounted.set(0)
                    log.warning("segment_unknown_to_master", segment_id=self.settings.segment_id)
                    await self.mount_until_done(stop)
                    wait_s = self.heartbeat_interval_s
                else:  # the master may be restarting
                    wait_s = self._beat_failed(exc.code().name, exc.details(), failures)
                    failures += 1
            except ValueError as exc:  # an answer this store cannot read (changes_from_packed): nothing applied
                wait_s = self._beat_failed("MALFORMED_ANSWER", str(exc), failures)
                failures += 1

    def _beat_failed(self, code: str, details: str | None, failures: int) -> float:
        """Count and log a failed heartbeat; the wait before the next (sooner first, never slower than the
        interval)."""
        self.metrics.heartbeat_failures.inc()
        log.warning("heartbeat_failed", code=code, details=details)
        return min(RETRY_MIN_S * 2**failures, self.heartbeat_interval_s)

    async def _pause(self, stop: asyncio.Event, wait_s: float) -> None:
        """Wait ``wait_s``, less if we are told to stop or (with standbys) a new leader is announced."""
        waits = [asyncio.ensure_future(stop.wait())]
        if self.with_standbys and self.link is not None and self.link.changed is not None:
            if self.link.stale():  # the leader already changed: follow it now
                waits[0].cancel()
                return
            self.link.changed.clear()  # (a vacancy left it set: only a change from now on wakes us)
            waits.append(asyncio.ensure_future(self.link.changed.wait()))
        try:
            await asyncio.wait(waits, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()

    async def _beat(self) -> Beat | None:
        """One heartbeat; with standbys a long-poll, abandoned (None) when the leader changes meanwhile."""
        assert self.master is not None
        if not self.with_standbys:
            return await self.master.heartbeat(self.settings.segment_id, self.records.acked_sequence)
        assert self.link is not None and self.link.changed is not None
        beat = asyncio.ensure_future(self.master.heartbeat(
            self.settings.segment_id, self.records.acked_sequence, self.heartbeat_interval_s))
        changed = asyncio.ensure_future(self.link.changed.wait())
        try:
            await asyncio.wait([beat, changed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
        if not beat.done() and self.link.stale():
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await beat
            return None
        response = await beat
        if not self.link.admit(response.epoch):
            raise _unavailable(f"a deposed master (epoch {response.epoch}) answered the heartbeat")
        return response

    async def unmount(self) -> None:
        if self.master is None:
            return
        try:
            await self.master.unmount(self.settings.segment_id)
            log.info("segment_unmounted", segment_id=self.settings.segment_id)
        except grpc.aio.AioRpcError as exc:
            log.warning("unmount_failed", code=exc.code().name, details=exc.details())
        self.metrics.mounted.set(0)


async def serve(settings: StoreSettings, ready_file: str | None = None) -> None:
    binding = numa.bind_to_node(settings.numa_node)
    if binding.single_node:
        log.info("numa_single_node", node=binding.node, cpus=binding.cpus,
                 detail="one NUMA node: CPU pinning applied, memory placement is trivially local")
    else:
        log.info("numa_bound", node=binding.node, cpus=binding.cpus,
                 memory_policy_applied=binding.memory_policy_applied, detail=binding.detail)
    refuse_unless_fits("store", settings.memory())
    size = int(settings.segment_size)
    segment = SharedSegment(size, settings.segment_id) if settings.shared_memory else HostBuffer(size)
    numa.mbind_range(segment.address, segment.size, settings.numa_node)
    segment.touch()
    engine = None
    if settings.transfer_engine:
        engine = TransferEngine(settings.transfer_host, settings.protocol, settings.device)
        engine.register(segment.address, segment.size)
    share = None
    shared = None
    if isinstance(segment, SharedSegment):
        share = SegmentShare(Path(settings.shared_memory_dir), f"store-{segment.token[:16]}")
        share.add(settings.segment_id, segment)
        socket_path = await share.start()
        shared = SharedMemoryRef(str(socket_path), settings.segment_id, segment.token)
        log.info("shared_memory_offered", socket=str(socket_path), segment_id=settings.segment_id)
    metrics = StoreMetrics()
    metrics.segment_bytes.set(segment.size)
    handle = await service.create_server(settings.host, settings.port, lambda s: None, service_names=[])
    await handle.set_serving(False)
    admin_port = service.start_metrics(settings.host, settings.admin_port, metrics.registry)
    stop = asyncio.Event()
    service.install_stop_signals(stop)
    link = MasterLink(settings.master, lambda address: service.channel(address, MASTER_CHANNEL_OPTIONS))
    store = Store(settings, engine, segment, MasterClient(link.channel) if link.channel is not None else None,
                  metrics, shared=shared, link=link, _channel_of_master=link.channel)
    registration: asyncio.Task[None] | None = None
    if link.etcd is not None:  # dead for placement as soon as this lease lapses
        value = json.dumps({"endpoint": store.endpoint, "host": store.host_name}).encode()
        registration = asyncio.create_task(Registration(
            EtcdClient(link.etcd), settings.segment_id, value, REGISTRATION_TTL_S, REGISTRATION_KEEPALIVE_S,
        ).run(stop))
    heartbeat: asyncio.Task[None] | None = None
    try:
        if await store.mount_until_done(stop, first=True):
            await handle.set_serving(True)
            service.write_ready_file(
                ready_file, port=handle.port, admin_port=admin_port, segment_id=settings.segment_id,
                endpoint=store.endpoint, segment_size=segment.size, segment_address=segment.address,
                **({"shared_memory": {"socket_path": shared.socket_path, "name": shared.name, "token": shared.token}}
                   if shared is not None else {}),
            )
            log.info("store_serving", address=f"{settings.host}:{handle.port}", admin_port=admin_port,
                     endpoint=store.endpoint, segment_size=segment.size, numa_node=settings.numa_node)
            heartbeat = asyncio.create_task(store.heartbeat_forever(stop))
            await stop.wait()
        log.info("store_stopping")
        await handle.set_serving(False)
    finally:
        if heartbeat is not None:
            heartbeat.cancel()
            try:
                await heartbeat
            except asyncio.CancelledError:
                pass
            except Exception:  # a bug in the loop must not skip the clean shutdown below
                log.exception("heartbeat_task_failed")
        await store.unmount()
        if registration is not None:  # revokes its lease as it stops
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(registration, 2.0)
        if share is not None:
            await share.close()  # peers see the socket close and unmap the segment
        await link.close()
        await handle.server.stop(grace=1.0)
        if engine is not None:
            engine.unregister(segment.address)
        log.info("store_stopped")
