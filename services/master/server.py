"""The pool master process: gRPC server, liveness and timeout sweeps, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import structlog

from kvpool import index_order, service
from kvpool.core.pool.index import PoolIndex
from kvpool.rpc import pool_pb2_grpc
from kvpool.core.ha.leadership import Role
from kvpool.ha.election import Candidate
from kvpool.ha.etcd_client import EtcdClient
from kvpool.services.master.durability import CommitWaiters
from kvpool.services.master.election import HaState, watch_registrations
from kvpool.heap import HeapKeeper
from kvpool.services.master.metrics import MasterMetrics
from kvpool.services.master.servicer import PoolMasterServicer
from kvpool.services.master.settings import MasterSettings

log = structlog.get_logger(__name__)


async def _sweep(servicer: PoolMasterServicer, metrics: MasterMetrics, interval_s: float) -> None:
    """Drop silent stores and groups left incomplete, revoke abandoned puts, expire leases, refresh gauges,
    keep the collector off the index (``heap``). The servicer's index: a new leader's term starts a new one."""
    heap = HeapKeeper()
    while True:
        index = servicer.index
        for segment_id in index.expire_segments():
            log.warning("segment_expired", segment_id=segment_id, ttl_s=index.settings.segment_ttl_s)
            if servicer.ha is not None:
                servicer.ha.waiters.dropped(segment_id)
        abandoned = index.drop_incomplete_groups()
        if abandoned:
            log.info("incomplete_groups_dropped", count=len(abandoned), first_group_id=abandoned[0],
                     after_s=index.settings.incomplete_group_s)
        revoked = index.revoke_expired_puts()
        if revoked:
            log.warning("puts_revoked_after_timeout", count=len(revoked), first_key=revoked[0])
        dropped = index.expire_leases()
        if dropped:
            log.warning("corrupt_groups_dropped", count=dropped, when="their last lease expired")
        metrics.refresh(index)
        took = heap.tick(time.monotonic())
        if took is not None:
            log.info("full_garbage_collection", seconds=round(took, 3), objects=index.num_objects)
        await asyncio.sleep(interval_s)


async def serve(settings: MasterSettings, ready_file: str | None = None) -> None:
    native_order, why_not = index_order.ensure()
    if why_not:  # the index runs the same order in Python, slower
        log.warning("index_order_in_python", reason=why_not)
    index = PoolIndex(settings)
    metrics = MasterMetrics()
    incarnation = uuid.uuid4().hex[:12]
    servicer = PoolMasterServicer(index, incarnation, settings.heartbeat_interval_s, metrics)
    handle = await service.create_server(
        settings.host, settings.port, lambda s: pool_pb2_grpc.add_PoolMasterServicer_to_server(servicer, s),
        service_names=["kvpool.rpc.PoolMaster"],
    )
    admin_port = service.start_metrics(settings.host, settings.admin_port, metrics.registry)
    stop = asyncio.Event()
    service.install_stop_signals(stop)
    sweeper = asyncio.create_task(_sweep(servicer, metrics, min(1.0, settings.segment_ttl_s / 4)))
    ha_tasks = _start_candidacy(settings, servicer, handle.port, metrics, stop) if settings.etcd else []
    log.info(
        "master_serving",
        address=f"{settings.host}:{handle.port}",
        admin_port=admin_port,
        incarnation=incarnation,
        etcd=settings.etcd or None,
        high_watermark=settings.high_watermark,
        low_watermark=settings.low_watermark,
        native_order=native_order,
    )
    service.write_ready_file(ready_file, port=handle.port, admin_port=admin_port, incarnation=incarnation)
    try:
        await stop.wait()
        log.info("master_stopping")
        await handle.set_serving(False)
    finally:
        stop.set()  # a candidate resigns: a standby wins at once
        if ha_tasks:
            await asyncio.wait(ha_tasks, timeout=3.0)
        sweeper.cancel()
        for task in (sweeper, *ha_tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await handle.server.stop(grace=2.0)
        log.info("master_stopped")


def _start_candidacy(settings: MasterSettings, servicer: PoolMasterServicer, port: int, metrics: MasterMetrics,
                     stop: asyncio.Event) -> list[asyncio.Task[None]]:
    """Campaign in etcd; each term won starts from an empty index (the stores re-mount with block reports)."""
    address = settings.advertise or f"{settings.host}:{port}"
    candidate = Candidate(EtcdClient(settings.etcd), address, settings.lease_times(), _noop, name=address)
    ha = HaState(candidate, CommitWaiters(settings.commit_timeout_s), settings.adoption_grace_s)
    candidate.on_change = ha.changed

    def new_term() -> None:
        servicer.index = PoolIndex(settings)
        metrics.new_index()
        metrics.leader_terms.inc()
        metrics.epoch.set(ha.epoch)

    ha.on_term.append(new_term)
    servicer.ha = ha
    metrics.leading.set_function(lambda: 1 if candidate.serving() else 0)

    def dropped(segment_id: str) -> None:
        if not candidate.serving() or segment_id not in servicer.index.segments:
            return
        objects = servicer.index.unmount_segment(segment_id)
        ha.waiters.dropped(segment_id)
        log.warning("segment_registration_lapsed", segment_id=segment_id, objects_dropped=objects,
                    detail="its store's etcd lease lapsed: dead for placement")

    return [asyncio.create_task(candidate.run(stop)),
            asyncio.create_task(watch_registrations(EtcdClient(settings.etcd), dropped, stop))]


async def _noop(role: Role, epoch: int) -> None:
    return None
