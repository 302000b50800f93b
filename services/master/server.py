"""The pool master process: gRPC server, liveness and timeout sweeps, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import structlog

from kvpool import service
from kvpool.core.pool.index import PoolIndex
from kvpool.rpc import pool_pb2_grpc
from kvpool.services.master.heap import HeapKeeper
from kvpool.services.master.metrics import MasterMetrics
from kvpool.services.master.servicer import PoolMasterServicer
from kvpool.services.master.settings import MasterSettings

log = structlog.get_logger(__name__)


async def _sweep(index: PoolIndex, metrics: MasterMetrics, interval_s: float) -> None:
    """Drop silent stores and groups left incomplete, revoke abandoned puts, expire leases, refresh gauges,
    keep the collector off the index (``heap``)."""
    heap = HeapKeeper()
    while True:
        for segment_id in index.expire_segments():
            log.warning("segment_expired", segment_id=segment_id, ttl_s=index.settings.segment_ttl_s)
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
            log.info("full_garbage_collection", seconds=round(took, 3), objects=len(index.objects))
        await asyncio.sleep(interval_s)


async def serve(settings: MasterSettings, ready_file: str | None = None) -> None:
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
    sweeper = asyncio.create_task(_sweep(index, metrics, min(1.0, settings.segment_ttl_s / 4)))
    log.info(
        "master_serving",
        address=f"{settings.host}:{handle.port}",
        admin_port=admin_port,
        incarnation=incarnation,
        high_watermark=settings.high_watermark,
        low_watermark=settings.low_watermark,
    )
    service.write_ready_file(ready_file, port=handle.port, admin_port=admin_port, incarnation=incarnation)
    try:
        await stop.wait()
        log.info("master_stopping")
        await handle.set_serving(False)
    finally:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        await handle.server.stop(grace=2.0)
        log.info("master_stopped")
