"""A prefill stage process. Stage 0 also serves the Prefill front and runs the scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import structlog

from kvpool.host_memory import refuse_unless_fits
from kvpool import service
from kvpool.pool.client import PoolClient
from kvpool.rpc import prefill_pb2, prefill_pb2_grpc
from kvpool.transfer import TransferEngine
from kvpool.services.prefill.stage0.health_servicer import PipelineHealthServicer
from kvpool.services.prefill.handoff import HandoffMetrics, StageHandoff
from kvpool.services.prefill.metrics import PoolPathCollector, PrefillMetrics
from kvpool.services.prefill.stage0.prefill_servicer import PrefillServicer
from kvpool.services.prefill.stage0.scheduler import PrefillScheduler
from kvpool.services.prefill.stage0.stage_clients import StageClient
from kvpool.services.prefill.settings import PrefillSettings
from kvpool.services.prefill.stage_runner import StageRunner
from kvpool.services.prefill.pieces import ActivationLink
from kvpool.services.prefill.stage_servicer import PrefillStageServicer

log = structlog.get_logger(__name__)

STAGES_READY_TIMEOUT_S = 120.0


class StageMismatch(RuntimeError):
    """Later stages disagree with stage 0 about the model, split, cache or namespace."""


async def wait_for_stages(settings: PrefillSettings, namespace: str, stop: asyncio.Event
                          ) -> tuple[list[grpc.aio.Channel], list[prefill_pb2.StageInfoResponse]]:
    """Connect to every later stage and check they form one pipeline with us; the channels and what each
    stage said of itself."""
    channels = [service.channel(a) for a in settings.stage_addresses]
    infos = []
    split = settings.layer_split
    deadline = time.monotonic() + STAGES_READY_TIMEOUT_S
    for stage, (address, channel) in enumerate(zip(settings.stage_addresses, channels), start=1):
        stub = prefill_pb2_grpc.PrefillStageStub(channel)
        while True:
            try:
                info = await stub.StageInfo(prefill_pb2.StageInfoRequest(), timeout=5)
                break
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > deadline or stop.is_set():
                    raise StageMismatch(f"stage {stage} at {address} is not reachable: {exc.code().name}") from None
                await asyncio.sleep(0.2)
        expected = (stage, settings.num_stages, *split[stage], settings.num_blocks, settings.chunk_size, namespace)
        got = (info.stage, info.num_stages, info.layer_start, info.layer_end, info.num_blocks, info.block_size,
               info.namespace)
        if got != expected:
            raise StageMismatch(f"stage at {address} reports (stage, stages, layers, blocks, block size, namespace) "
                                f"{got}, expected {expected}")
        infos.append(info)
    return channels, infos


async def serve(settings: PrefillSettings, ready_file: str | None = None) -> None:
    refuse_unless_fits(f"prefill stage {settings.stage}", settings.memory())
    # without an engine the stage opens no port but its gRPC and admin ones, and moves bytes by memory only
    engine = TransferEngine(settings.transfer_host, settings.protocol, settings.device) \
        if settings.transfer_engine else None
    pool = PoolClient(settings.master, engine, engine_only=settings.pool_path == "engine") if settings.master else None
    metrics = PrefillMetrics()
    if pool is not None:
        pool.start()  # with standbys: the leader is found now, not by the first request (which would miss)
        metrics.registry.register(PoolPathCollector(pool))
    runner = StageRunner(settings, engine, pool, metrics)
    link = ActivationLink(runner, settings.next_address)
    await link.start()
    handoff_metrics = HandoffMetrics(metrics.registry)
    handoff = StageHandoff(runner, handoff_metrics)
    stage_servicer = PrefillStageServicer(runner, link, handoff)
    front = PrefillServicer()

    def add_servicers(server: grpc.aio.Server) -> None:
        prefill_pb2_grpc.add_PrefillStageServicer_to_server(stage_servicer, server)
        if settings.stage == 0:
            prefill_pb2_grpc.add_PrefillServicer_to_server(front, server)

    health_servicer = PipelineHealthServicer()
    handle = await service.create_server(settings.host, settings.port, add_servicers, service_names=[
        "kvpool.rpc.PrefillStage",
        *(["kvpool.rpc.Prefill"] if settings.stage == 0 else [])],
        health_servicer=health_servicer)
    stop = service.Stop()
    service.install_stop_signals(stop)
    admin_port = service.start_metrics(settings.host, settings.admin_port, metrics.registry)
    channels: list[grpc.aio.Channel] = []
    try:
        if settings.stage == 0:
            await handle.set_serving(False)
            channels, infos = await wait_for_stages(settings, runner.namespace, stop)
            health_servicer.watch_stages(channels)
            front.scheduler = PrefillScheduler(
                runner, link, [StageClient(stage, c, i.restore_on_chain, i.saves_when_told, i.chunk_bytes)
                               for stage, (c, i) in enumerate(zip(channels, infos), start=1)],
                pool, metrics, handoff, handoff_metrics,
            )
            await handle.set_serving(True)
        start, end = settings.layers
        endpoint = engine.endpoint if engine is not None else ""
        log.info("prefill_stage_serving", stage=settings.stage, num_stages=settings.num_stages, layers=[start, end],
                 address=f"{settings.host}:{handle.port}", admin_port=admin_port, endpoint=endpoint or "none",
                 device_cache_tokens=settings.num_blocks * settings.chunk_size, pool=settings.master or "off",
                 namespace=runner.namespace, torch_threads=settings.torch_threads)
        service.write_ready_file(ready_file, port=handle.port, admin_port=admin_port, endpoint=endpoint,
                                 namespace=runner.namespace)
        await stop.wait()
        log.info("prefill_stage_stopping", stage=settings.stage)
        # not ready first, then finish what is in flight (a rolling restart loses nothing)
        await handle.drain(settings.drain_s, stop.quiet_s)
    finally:
        await handle.server.stop(grace=2.0)
        if front.scheduler is not None:
            await front.scheduler.prefetcher.close()  # stagings waiting for their time: dropped
        with contextlib.suppress(Exception):
            await asyncio.wait_for(runner.drain_saves(), 5.0)
        for channel in channels:
            await channel.close()
        await link.close()
        await handoff.close()
        if pool is not None:
            await pool.close()
        runner.close()
        log.info("prefill_stage_stopped", stage=settings.stage)
