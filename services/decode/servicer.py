"""The Decode gRPC servicer: protobuf ↔ the shard, validation at the edge."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from kvpool.core.errors import InvalidArgument, KvpoolError
from kvpool.core.handoff.layout import HandoffLayout
from kvpool.handoff_messages import shared_memory_message
from kvpool.model.sampling import SamplingParams
from kvpool.request_id import current_request_id
from kvpool.rpc import decode_pb2, decode_pb2_grpc, handoff_pb2
from kvpool.status import abort, status_errors
from kvpool.services.decode.shard import DecodeShard, Figures

log = structlog.get_logger(__name__)


def parse_region_id(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"region_id: {text!r} is not a region id of this shard") from None


def sampling_params(sampling: decode_pb2.DecodeSampling) -> SamplingParams:
    """Checked sampling parameters (top_p 0 reads as 1: proto3's unset)."""
    temperature, top_p = float(sampling.temperature), float(sampling.top_p) or 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgument(f"temperature: must be >= 0, got {sampling.temperature}")
    if not 0 < top_p <= 1:
        raise InvalidArgument(f"top_p: must be in (0, 1], got {sampling.top_p}")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=int(sampling.top_k), seed=int(sampling.seed))


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, shard: DecodeShard) -> None:
        self.shard = shard

    @status_errors
    async def Reserve(self, request: decode_pb2.ReserveRequest, context: grpc.aio.ServicerContext
                      ) -> decode_pb2.ReserveResponse:
        if not math.isfinite(request.hold_s) or request.hold_s < 0:
            raise InvalidArgument(f"hold_s: must be >= 0, got {request.hold_s}")
        trailer = self.shard.trailer_bytes if request.with_logits else 0
        layout = HandoffLayout.of(request.num_tokens, [(r.start, r.end) for r in request.layer_split],
                                  request.entry_bytes, trailer)
        region = self.shard.reserve(layout, request.kv_dtype, request.max_tokens, request.hold_s or None)
        # the core's deadline is monotonic; peers get wall-clock milliseconds
        deadline_ms = int((time.time() + region.deadline - self.shard.clock()) * 1000)
        target = handoff_pb2.HandoffTarget(
            region_id=str(region.region_id), endpoint=self.shard.endpoint,
            address=self.shard.region_address(region), size=region.size, deadline_unix_ms=deadline_ms,
            layout=handoff_pb2.HandoffLayout(num_tokens=request.num_tokens, layer_split=request.layer_split,
                                             entry_bytes=request.entry_bytes, trailer_bytes=trailer),
            notify_address=self.shard.notify_address, host=self.shard.host_name,
            shared_memory=shared_memory_message(self.shard.shared),
            shared_base_address=self.shard.arena.address if self.shard.shared else 0,
            control_offset=self.shard.control_offset(region) if self.shard.shared else 0,
        )
        return decode_pb2.ReserveResponse(target=target)

    async def Generate(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        # a streaming method: errors are mapped here (status_errors wraps unary calls)
        try:
            params = sampling_params(request.sampling)
            region_id = parse_region_id(request.region_id)
            stream = self.shard.generate(region_id, list(request.prompt_token_ids), request.first_token, params,
                                         request.max_tokens, list(request.stop_token_ids),
                                         request.request_id or current_request_id())
            async for event in stream:
                if isinstance(event, Figures):
                    log.info("decode_done", tokens=event.num_tokens, finish_reason=event.finish_reason,
                             queue_s=round(event.queue_seconds, 4), decode_s=round(event.decode_seconds, 4))
                    yield decode_pb2.DecodeResponse(figures=decode_pb2.DecodeFigures(
                        num_tokens=event.num_tokens, finish_reason=event.finish_reason,
                        decode_seconds=event.decode_seconds, queue_seconds=event.queue_seconds,
                        scatter_seconds=event.scatter_seconds, first_token_unix_ms=event.first_token_unix_ms))
                else:
                    yield decode_pb2.DecodeResponse(token_id=event)
        except KvpoolError as exc:
            await abort(context, exc, "Generate")

    @status_errors
    async def Landed(self, request: decode_pb2.LandedRequest, context: grpc.aio.ServicerContext
                     ) -> decode_pb2.LandedResponse:
        seconds, complete = await self.shard.landed(parse_region_id(request.region_id), request.stage,
                                                    request.token_start, request.token_end, request.trailer)
        return decode_pb2.LandedResponse(scatter_seconds=seconds, complete=complete)

    @status_errors
    async def ReleaseRegion(self, request: decode_pb2.ReleaseRegionRequest, context: grpc.aio.ServicerContext
                            ) -> decode_pb2.ReleaseRegionResponse:
        return decode_pb2.ReleaseRegionResponse(released=self.shard.release_region(parse_region_id(request.region_id)))

    @status_errors
    async def Stats(self, request: decode_pb2.DecodeStatsRequest, context: grpc.aio.ServicerContext
                    ) -> decode_pb2.DecodeStats:
        shard, settings, sched = self.shard, self.shard.settings, self.shard.scheduler
        return decode_pb2.DecodeStats(
            model=shard.config.name, num_layers=shard.config.num_hidden_layers, entry_bytes=shard.model.entry_bytes,
            kv_dtype=settings.kv_dtype, max_context=shard.config.max_position_embeddings,
            page_size=settings.page_size, num_pages=settings.num_pages, num_pages_used=sched.num_pages_used,
            num_running=sched.num_running, num_waiting=sched.num_waiting, max_batch_size=settings.max_batch_size,
            num_regions=shard.regions.num_regions, region_arena_bytes=settings.region_arena_bytes,
            region_bytes_used=shard.regions.used_bytes, steps=shard.num_steps,
            region_trailer_bytes=shard.trailer_bytes, num_reserved=sched.num_reserved,
        )
