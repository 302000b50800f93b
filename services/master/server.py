"""The pool master process: gRPC server, liveness and timeout sweeps, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass

import structlog

from kvpool import service
from kvpool.rpc import pool_pb2_grpc
from services.master.index import IndexSettings, PoolIndex
from services.master.metrics import MasterMetrics
from services.master.servicer import PoolMasterServicer

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class MasterSettings:
    host: str = "127.0.0.1"
    port: int = 7601
    admin_port: int = 9601
    high_watermark: float = 0.90
    low_watermark: float = 0.85
    put_timeout_s: float = 30.0
    lease_s: float = 5.0
    segment_ttl_s: float = 10.0
    heartbeat_interval_s: float = 2.0
    alignment: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not a TCP port")
        if not 0 <= self.admin_port <= 65535:
            raise ValueError(f"admin_port: {self.admin_port} is not a TCP port")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_interval_s * 2 > self.segment_ttl_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be positive and at most half "
                f"of segment_ttl_s ({self.segment_ttl_s}) so one lost heartbeat does not drop a store"
            )
        self.index_settings()  # validates watermarks and timeouts

    def index_settings(self) -> IndexSettings:
        return IndexSettings(
            high_watermark=self.high_watermark,
            low_watermark=self.low_watermark,
            put_timeout_s=self.put_timeout_s,
            lease_s=self.lease_s,
            segment_ttl_s=self.segment_ttl_s,
            alignment=self.alignment,
        )


async def _sweep(index: PoolIndex, metrics: MasterMetrics, interval_s: float) -> None:
    """Drop silent stores, revoke abandoned puts, expire leases, refresh gauges."""
    while True:
        for segment_id in index.expire_segments():
            log.warning("segment_expired", segment_id=segment_id, ttl_s=index.settings.segment_ttl_s)
        revoked = index.revoke_expired_puts()
        if revoked:
            log.warning("puts_revoked_after_timeout", count=len(revoked), first_key=revoked[0])
        index.expire_leases()
        metrics.refresh(index)
        await asyncio.sleep(interval_s)


async def serve(settings: MasterSettings, ready_file: str | None = None) -> None:
    index = PoolIndex(settings.index_settings())
    metrics = MasterMetrics()
    incarnation = uuid.uuid4().hex[:12]
    servicer = PoolMasterServicer(index, incarnation, settings.heartbeat_interval_s, metrics)
    handle = await service.create_server(
        settings.host, settings.port, lambda s: pool_pb2_grpc.add_PoolMasterServicer_to_server(servicer, s)
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
