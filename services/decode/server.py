"""A decode shard process: the Decode service, its step loop and region sweeper, and the socket that offers its
receive arena to prefill stages on this host (``--shared-memory``)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import structlog

from kvpool.host_memory import refuse_unless_fits
from kvpool import service
from kvpool.core.pool.paths import SharedMemoryRef
from kvpool.rpc import decode_pb2_grpc
from kvpool.shared_memory import SegmentShare, SharedSegment
from kvpool.transfer import TransferEngine
from kvpool.services.decode.metrics import DecodeMetrics
from kvpool.services.decode.prefill_client import PrefillClients
from kvpool.services.decode.servicer import DecodeServicer
from kvpool.services.decode.settings import DecodeSettings
from kvpool.services.decode.shard import ARENA_NAME, DecodeShard

log = structlog.get_logger(__name__)


async def serve(settings: DecodeSettings, ready_file: str | None = None) -> None:
    refuse_unless_fits("decode", settings.memory())
    engine = TransferEngine(settings.transfer_host, settings.protocol, settings.device) if settings.transfer_engine \
        else None
    metrics = DecodeMetrics(settings.num_pages)
    shard = DecodeShard(settings, engine, metrics)
    prefill = PrefillClients(settings.pipeline_addresses)
    servicer = DecodeServicer(shard, prefill)
    share = None
    if isinstance(shard.arena, SharedSegment):
        share = SegmentShare(Path(settings.shared_memory_dir), f"decode-{shard.arena.token[:16]}")
        share.add(ARENA_NAME, shard.arena, shard.doorbell if shard.doorbell >= 0 else None)
        socket_path = await share.start()
        shard.shared = SharedMemoryRef(str(socket_path), ARENA_NAME, shard.arena.token)
        log.info("shared_memory_offered", socket=str(socket_path), segment=ARENA_NAME, host=shard.host_name)

    def add_servicers(server: grpc.aio.Server) -> None:
        decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)

    handle = await service.create_server(settings.host, settings.port, add_servicers,
                                         service_names=["kvpool.rpc.Decode"],
                                         watches=["/kvpool.rpc.Decode/WatchRoom"])
    # where prefill stages tell us a part of a region landed (a wildcard listen address is not one)
    host = settings.transfer_host if settings.host in ("", "0.0.0.0", "::", "[::]") else settings.host
    shard.notify_address = f"{host}:{handle.port}"
    stop = service.Stop()
    service.install_stop_signals(stop)
    admin_port = service.start_metrics(settings.host, settings.admin_port, metrics.registry)
    tasks = [asyncio.create_task(shard.run()), asyncio.create_task(shard.expire_regions_forever())]
    loop = asyncio.get_running_loop()
    if shard.doorbell >= 0:  # stages on this host ring it after publishing landed ranges
        loop.add_reader(shard.doorbell, shard.on_doorbell)

    def died(task: asyncio.Task[None]) -> None:
        # a shard whose step loop or sweeper died would hang every stream: exit instead
        if not task.cancelled() and task.exception() is not None:
            log.error("decode_loop_died", error=repr(task.exception()))
            stop.set()

    for task in tasks:
        task.add_done_callback(died)
    try:
        config = shard.config
        log.info("decode_shard_serving", address=f"{settings.host}:{handle.port}", admin_port=admin_port,
                 endpoint=shard.endpoint, model=config.name, kv_dtype=settings.kv_dtype,
                 num_pages=settings.num_pages, page_size=settings.page_size, max_batch_size=settings.max_batch_size,
                 region_arena_bytes=settings.region_arena_bytes)
        service.write_ready_file(ready_file, port=handle.port, admin_port=admin_port, endpoint=shard.endpoint)
        await stop.wait()
        log.info("decode_shard_stopping")
        # not ready first, then finish what is in flight (a rolling restart loses nothing)
        await handle.drain(settings.drain_s, stop.quiet_s)
    finally:
        await handle.server.stop(grace=2.0)
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if share is not None:
            await share.close()
        if shard.doorbell >= 0:
            loop.remove_reader(shard.doorbell)
        await prefill.close()
        shard.close()
        log.info("decode_shard_stopped")
