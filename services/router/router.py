"""The router's generate path: place, prefill, hand the KV off, decode, stream — and clean up whatever happens.

Placement decisions are the core's (``kvpool.core.routing``); this module
does the calls between them:

    place → Prefill (stage 0) → first token → Reserve (decode) → Handoff
          (every prefill stage writes its layers into the region) → Generate
          (decode streams the rest)

Faults: a prefill pipeline that answers UNAVAILABLE before the request has
produced anything is retried once on another healthy pipeline (prefill has
no effect a client could see, so a retry loses nothing); once a token has
reached the client, a failure ends the stream with UNAVAILABLE and is never
retried or hidden. Cancelling (the client went away) cancels the calls in
flight; the prefill hold is released and an unclaimed region given back, so
no pages stay taken on either side.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool import service
from kvpool.core.errors import InvalidArgument, KvpoolError, ResourceExhausted, Unavailable
from kvpool.core.routing import Placement, RoutingPolicy
from kvpool.core.tenancy import scoped_session_key
from kvpool.model.config import ModelConfig, split_layers
from kvpool.model.sampling import SamplingParams, output_logits, sample
from kvpool.request_id import bound_request_id, new_request_id
from kvpool.rpc import (
    decode_pb2,
    decode_pb2_grpc,
    handoff_pb2,
    handoff_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from kvpool.status import from_status
from services.router.http_api import Usage
from services.router.metrics import RouterMetrics
from services.router.openai_schema import GenerationRequest

log = structlog.get_logger(__name__)

# the health service name under which stage 0 answers for its whole pipeline
PIPELINE_HEALTH_SERVICE = "kvpool.rpc.Prefill"

# a pipeline's or shard's answer the client must see as such: its own bad input, or no room now (429)
_PASSED_ON = (InvalidArgument, ResourceExhausted)

CALL_TIMEOUT_S = 30.0


@dataclass(slots=True)
class PipelineClient:
    address: str
    channel: grpc.aio.Channel
    prefill: prefill_pb2_grpc.PrefillStub
    stages: prefill_pb2_grpc.PrefillStageStub
    handoff: handoff_pb2_grpc.HandoffStub
    health: health_pb2_grpc.HealthStub
    num_stages: int = 0


@dataclass(slots=True)
class ShardClient:
    address: str
    channel: grpc.aio.Channel
    decode: decode_pb2_grpc.DecodeStub
    health: health_pb2_grpc.HealthStub
    page_size: int = 0
    kv_dtype: str = ""
    num_layers: int = 0
    entry_bytes: int = 0


class Router:
    """Owns the clients of every pipeline and shard, the placement policy, and the health loop."""

    def __init__(self, pipelines: list[str], shards: list[str], metrics: RouterMetrics, model: ModelConfig,
                 affinity_max_queue: int = 4, max_in_flight: int = 256, request_timeout_s: float = 600.0) -> None:
        self.metrics = metrics
        self.model = model  # its sampler's output ids
        self.policy = RoutingPolicy.of(pipelines, shards, affinity_max_queue=affinity_max_queue)
        self.max_in_flight = max_in_flight
        self.request_timeout_s = request_timeout_s
        self.in_flight = 0
        self.pipelines = {a: self._pipeline_client(a) for a in pipelines}
        self.shards = {a: self._shard_client(a) for a in shards}

    @staticmethod
    def _pipeline_client(address: str) -> PipelineClient:
        channel = service.channel(address)
        return PipelineClient(address, channel, prefill_pb2_grpc.PrefillStub(channel),
                              prefill_pb2_grpc.PrefillStageStub(channel), handoff_pb2_grpc.HandoffStub(channel),
                              health_pb2_grpc.HealthStub(channel))

    @staticmethod
    def _shard_client(address: str) -> ShardClient:
        channel = service.channel(address)
        return ShardClient(address, channel, decode_pb2_grpc.DecodeStub(channel), health_pb2_grpc.HealthStub(channel))

    async def close(self) -> None:
        for client in [*self.pipelines.values(), *self.shards.values()]:
            await client.channel.close()

    # ---- health ---------------------------------------------------------

    async def check_health(self) -> dict[str, bool]:
        """One round of health checks of every target (pipeline or shard); shards also report their free pages."""
        checks = [self._check_pipeline(c) for c in self.pipelines.values()]
        checks += [self._check_shard(c) for c in self.shards.values()]
        results = await asyncio.gather(*checks)
        targets = dict(zip([*self.pipelines, *self.shards], results))
        for name, healthy in targets.items():
            changed = self.policy.set_health(name, healthy)
            self.metrics.healthy.labels(name).set(1 if healthy else 0)
            if changed:
                log.warning("target_health_changed", target=name, healthy=healthy)
        return targets

    async def _serving(self, stub: health_pb2_grpc.HealthStub, service: str = "") -> bool:
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def _check_pipeline(self, client: PipelineClient) -> bool:
        # stage 0 answers for the pipeline's service by asking every later stage
        return await self._serving(client.health, PIPELINE_HEALTH_SERVICE)

    async def _check_shard(self, client: ShardClient) -> bool:
        if not await self._serving(client.health):
            return False
        try:
            stats = await client.decode.Stats(decode_pb2.DecodeStatsRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return False
        client.page_size, client.kv_dtype = stats.page_size, stats.kv_dtype
        client.num_layers, client.entry_bytes = stats.num_layers, stats.entry_bytes
        self.policy.report_free_pages(client.address, stats.num_pages - stats.num_pages_used)
        return True

    async def health_forever(self, interval_s: float) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(interval_s)

    # ---- generate -------------------------------------------------------

    async def generate(self, request: GenerationRequest, usage: Usage) -> AsyncIterator[int]:
        """Token ids as they are made (see the module doc); ``usage`` is filled as the request goes.

        The request's id is bound throughout: every call it makes carries it and
        every log line about it names it, ending with one ``generate_ended``.
        """
        request.request_id = request.request_id or new_request_id()
        # the caller's task binds it too (HTTP middleware, gRPC handler): a generator's own binding
        # holds only in the task that first iterates it
        with bound_request_id(request.request_id):
            if self.in_flight >= self.max_in_flight:
                log.info("generate_refused", in_flight=self.in_flight)
                raise ResourceExhausted(
                    f"router: {self.in_flight} requests in flight, the limit is {self.max_in_flight}")
            self.in_flight += 1
            self.metrics.in_flight.set(self.in_flight)
            ended = "cancelled"
            try:
                async for token in self._generate(request, usage):
                    yield token
                ended = "done"
            except GeneratorExit:
                ended = "closed"  # the reader stopped: a stop string, or its client went away
                raise
            except KvpoolError as exc:
                ended = type(exc).__name__
                raise
            finally:
                self.in_flight -= 1
                self.metrics.in_flight.set(self.in_flight)
                log.info("generate_ended", request_id=request.request_id, session_key=request.session_key,
                         ended=ended, pipeline=usage.pipeline, shard=usage.shard,
                         prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                         device_tokens=usage.device_tokens, pool_tokens=usage.pool_tokens,
                         ttft_s=round(usage.ttft_seconds, 4))

    async def _generate(self, request: GenerationRequest, usage: Usage) -> AsyncIterator[int]:
        started = time.perf_counter()
        tried: set[str] = set()
        while True:
            placement = self._place(request, tried)
            usage.pipeline, usage.shard = placement.pipeline, placement.shard
            try:
                prefill = await self._prefill(placement, request)
                break
            except Unavailable as exc:
                self.policy.finish(placement, self._pages(request, placement))
                tried.add(placement.pipeline)
                if len(tried) > 1 or not any(p.healthy and n not in tried for n, p in self.policy.pipelines.items()):
                    raise
                self.metrics.retries.inc()
                log.warning("prefill_retried_elsewhere", pipeline=placement.pipeline, error=str(exc))
            except BaseException:
                self.policy.finish(placement, self._pages(request, placement))
                raise
        figures = prefill.figures
        usage.device_tokens = figures.num_device_tokens
        usage.pool_tokens = figures.num_pool_tokens
        usage.computed_tokens = figures.num_computed_tokens
        first = self._first_token(request, prefill, self.model)
        usage.ttft_seconds = time.perf_counter() - started
        self.metrics.ttft.observe(usage.ttft_seconds)
        for source, count in (("device", usage.device_tokens), ("pool", usage.pool_tokens),
                              ("computed", usage.computed_tokens)):
            self.metrics.prompt_tokens.labels(source).inc(count)
        pages = self._pages(request, placement)
        admitted = False
        try:
            yield first
            if first in request.stop_token_ids or request.max_tokens == 1:
                usage.finish_reason = "stop" if first in request.stop_token_ids else "length"
                await self._release_hold(placement, prefill.request_id)
                return
            target = await self._handoff(placement, request, prefill.request_id, usage)
            decode_started = time.perf_counter()
            async for token, done in self._decode(placement, request, target, first, usage):
                if not admitted:
                    admitted = True
                    self.policy.admitted(placement, pages)
                if done:
                    break
                yield token
            usage.decode_seconds = time.perf_counter() - decode_started
            self.metrics.decode.observe(usage.decode_seconds)
        finally:
            self.policy.finish(placement, 0 if admitted else pages)
            self.metrics.completion_tokens.inc(usage.completion_tokens)

    def _place(self, request: GenerationRequest, tried: set[str]) -> Placement:
        # a retry must not land on a pipeline that already failed this request
        session = scoped_session_key(request.tenant, request.session_key)
        placement = self.policy.place(session, self._pages_for(request, None), exclude=tried)
        self.metrics.placements.labels("pipeline", placement.pipeline, placement.pipeline_reason.value).inc()
        self.metrics.placements.labels("shard", placement.shard, placement.shard_reason.value).inc()
        return placement

    def _pages_for(self, request: GenerationRequest, shard: str | None) -> int:
        page_size = max((c.page_size for c in self.shards.values() if shard in (None, c.address)), default=0)
        if page_size <= 0:
            return 0
        return -(-(len(request.prompt_ids) + request.max_tokens) // page_size)

    def _pages(self, request: GenerationRequest, placement: Placement) -> int:
        return self._pages_for(request, placement.shard)

    @staticmethod
    def _first_token(request: GenerationRequest, prefill: prefill_pb2.PrefillResponse, model: ModelConfig) -> int:
        if request.temperature == 0.0:
            return prefill.first_token  # greedy: the last stage's argmax
        logits = torch.frombuffer(bytearray(prefill.logits), dtype=torch.float32)
        params = SamplingParams(request.temperature, request.top_p, request.top_k, request.seed or 0)
        return sample(output_logits(logits, model), params)  # the model's sampler: its output ids only

    async def _prefill(self, placement: Placement, request: GenerationRequest) -> prefill_pb2.PrefillResponse:
        client = self.pipelines[placement.pipeline]
        try:
            return await client.prefill.Prefill(
                prefill_pb2.PrefillRequest(token_ids=request.prompt_ids, session_key=request.session_key,
                                           return_logits=request.temperature > 0, tenant=request.tenant,
                                           cache_salt=request.cache_salt),
                timeout=self.request_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            raise from_status(exc, f"prefill pipeline {placement.pipeline}", _PASSED_ON) from None

    async def _handoff(self, placement: Placement, request: GenerationRequest, request_id: str,
                       usage: Usage) -> handoff_pb2.HandoffTarget:
        pipeline, shard = self.pipelines[placement.pipeline], self.shards[placement.shard]
        layout_request = decode_pb2.ReserveRequest(num_tokens=len(request.prompt_ids), kv_dtype=shard.kv_dtype,
                                                   entry_bytes=shard.entry_bytes)
        target: handoff_pb2.HandoffTarget | None = None
        try:
            for start, end in await self._layer_split(pipeline, shard):
                layout_request.layer_split.add(start=start, end=end)
            reserved = await shard.decode.Reserve(layout_request, timeout=CALL_TIMEOUT_S)
            target = reserved.target
            response = await pipeline.handoff.Handoff(
                handoff_pb2.HandoffRequest(request_id=request_id, target=target), timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            await self._release_hold(placement, request_id)
            if target is not None:
                await self._release_region(shard, target.region_id)
            raise from_status(exc, f"handoff {placement.pipeline} → {placement.shard}", _PASSED_ON) from None
        except BaseException:
            await self._release_hold(placement, request_id)
            if target is not None:
                await self._release_region(shard, target.region_id)
            raise
        usage.handoff_transfers, usage.handoff_bytes = response.transfers, response.bytes
        return target

    async def _decode(self, placement: Placement, request: GenerationRequest, target: handoff_pb2.HandoffTarget,
                      first: int, usage: Usage) -> AsyncIterator[tuple[int, bool]]:
        shard = self.shards[placement.shard]
        call = shard.decode.Generate(
            decode_pb2.DecodeRequest(
                region_id=target.region_id, prompt_token_ids=request.prompt_ids, first_token=first,
                sampling=decode_pb2.DecodeSampling(temperature=request.temperature, top_p=request.top_p,
                                                   top_k=request.top_k, seed=request.seed or 0),
                max_tokens=request.max_tokens, stop_token_ids=request.stop_token_ids,
            ),
            timeout=self.request_timeout_s,
        )
        skipped_first = False
        try:
            async for response in call:
                if response.HasField("figures"):
                    usage.finish_reason = "stop" if response.figures.finish_reason == "stop" else "length"
                    yield 0, True
                    return
                if not skipped_first:
                    skipped_first = True  # decode streams the first token too; the client has it already
                    continue
                yield response.token_id, False
        except grpc.aio.AioRpcError as exc:
            raise from_status(exc, f"decode shard {placement.shard}", _PASSED_ON) from None
        finally:
            call.cancel()  # a no-op once the stream ended; frees the pages when the client went away

    async def _layer_split(self, pipeline: PipelineClient, shard: ShardClient) -> list[tuple[int, int]]:
        """The pipeline's layer split: its stage count (asked once) over the model's layers."""
        if not pipeline.num_stages:
            info = await pipeline.stages.StageInfo(prefill_pb2.StageInfoRequest(), timeout=CALL_TIMEOUT_S)
            pipeline.num_stages = info.num_stages
        return split_layers(shard.num_layers, pipeline.num_stages)

    async def _release_hold(self, placement: Placement, request_id: str) -> None:
        try:
            await self.pipelines[placement.pipeline].prefill.Release(
                prefill_pb2.ReleaseRequest(request_id=request_id), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            # NOT_FOUND: the handoff released it already; otherwise its hold expires on its own
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                log.info("release_failed", request_id=request_id, code=exc.code().name)

    async def _release_region(self, shard: ShardClient, region_id: str) -> None:
        try:
            await shard.decode.ReleaseRegion(decode_pb2.ReleaseRegionRequest(region_id=region_id), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            log.info("region_release_failed", region_id=region_id, code=exc.code().name)  # reclaimed at its deadline
