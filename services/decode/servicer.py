"""The Decode gRPC servicer: protobuf ↔ the shard, validation at the edge; ``Serve`` runs a whole request
(reserve, prefill through ``prefill_client``, decode)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from kvpool.core.errors import InvalidArgument, KvpoolError
from kvpool.core.handoff.layout import HandoffLayout
from kvpool.core.decode.regions import ReceiveRegion
from kvpool.core.handoff.target import HandoffTarget
from kvpool.handoff_messages import target_message
from kvpool.model.sampling import SamplingParams
from kvpool.request_id import current_request_id
from kvpool.rpc import decode_pb2, decode_pb2_grpc
from kvpool.status import abort, status_errors
from kvpool.services.decode.prefill_client import PrefillClients
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


def figures_message(figures: Figures) -> decode_pb2.DecodeFigures:
    return decode_pb2.DecodeFigures(
        num_tokens=figures.num_tokens, finish_reason=figures.finish_reason, decode_seconds=figures.decode_seconds,
        queue_seconds=figures.queue_seconds, scatter_seconds=figures.scatter_seconds,
        first_token_unix_ms=figures.first_token_unix_ms)


async def decoded(events: AsyncIterator[int | Figures]
                  ) -> AsyncIterator[tuple[decode_pb2.DecodeFigures | None, int | None]]:
    """A sequence's tokens, then its figures (logged), as the messages' fields: one of the two set."""
    async for event in events:
        if isinstance(event, Figures):
            log.info("decode_done", tokens=event.num_tokens, finish_reason=event.finish_reason,
                     queue_s=round(event.queue_seconds, 4), decode_s=round(event.decode_seconds, 4))
            yield figures_message(event), None
        else:
            yield None, event


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, shard: DecodeShard, prefill: PrefillClients | None = None) -> None:
        self.shard = shard
        self.prefill = prefill or PrefillClients()

    @status_errors
    async def Reserve(self, request: decode_pb2.ReserveRequest, context: grpc.aio.ServicerContext
                      ) -> decode_pb2.ReserveResponse:
        if not math.isfinite(request.hold_s) or request.hold_s < 0:
            raise InvalidArgument(f"hold_s: must be >= 0, got {request.hold_s}")
        trailer = self.shard.trailer_bytes if request.with_logits else 0
        layout = HandoffLayout.of(request.num_tokens, [(r.start, r.end) for r in request.layer_split],
                                  request.entry_bytes, trailer)
        region = self.shard.reserve(layout, request.kv_dtype, request.max_tokens, request.hold_s or None)
        return decode_pb2.ReserveResponse(target=target_message(self.target_of(region)))

    def target_of(self, region: ReceiveRegion) -> HandoffTarget:
        """Where prefill writes ``region``: this shard's engine, its address, layout and deadline, and on this
        host its shared arena and the region's control record."""
        shard = self.shard
        # the core's deadline is monotonic; peers get wall-clock milliseconds
        deadline_ms = int((time.time() + region.deadline - shard.clock()) * 1000)
        return HandoffTarget(
            region_id=str(region.region_id), endpoint=shard.endpoint, address=shard.region_address(region),
            size=region.size, deadline_unix_ms=deadline_ms, layout=region.layout,
            notify_address=shard.notify_address, host=shard.host_name, shared=shard.shared,
            shared_base_address=shard.arena.address if shard.shared else 0,
            control_offset=shard.control_offset(region) if shard.shared else 0)

    async def Serve(self, request: decode_pb2.ServeRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[decode_pb2.ServeResponse]:
        # a streaming method: errors are mapped here (status_errors wraps unary calls)
        try:
            async for response in self._serve(request):
                yield response
        except KvpoolError as exc:
            await abort(context, exc, "Serve")

    async def _serve(self, request: decode_pb2.ServeRequest) -> AsyncIterator[decode_pb2.ServeResponse]:
        """Reserve, prefill into the region, decode; the region and pages are free however it ends."""
        shard = self.shard
        params = sampling_params(request.sampling)
        address = self.prefill.check(request.prefill_address)
        timeout_s = request.prefill_timeout_s
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise InvalidArgument(f"prefill_timeout_s: must be >= 0, got {request.prefill_timeout_s}")
        prompt = list(request.prompt_token_ids)
        shard.check_prompt(prompt, request.max_tokens)
        layout = HandoffLayout.of(len(prompt), [(r.start, r.end) for r in request.layer_split],
                                  shard.model.entry_bytes, shard.trailer_bytes)
        if request.room_at_once:  # the router queues it if there is no room, and asks again when told
            region = shard.reserve_now(layout, shard.settings.kv_dtype, request.max_tokens, timeout_s or None)
        else:  # an older router, which expects the shard to wait for room it is giving back
            region = await shard.reserve_waiting(layout, shard.settings.kv_dtype, request.max_tokens,
                                                 timeout_s or None, shard.settings.room_wait_s)
        request_id = request.request_id or current_request_id()
        decoding = False
        # the first token may leave before the prefill's answer: once the whole region landed (the answer still
        # has to come back along the stages then), with logits to sample it from
        early = request.first_token_early and bool(region.layout.trailer_bytes)
        prefill = asyncio.ensure_future(self.prefill.prefill(
            address, prompt, request.session_key, request.tenant, request.cache_salt, self.target_of(region),
            timeout_s or shard.settings.region_deadline_s))
        answered = False  # the prefill's answer went out (or never will: it failed after the region landed)
        try:
            if request.room_at_once:
                yield decode_pb2.ServeResponse(reserved=decode_pb2.Reserved(room_epoch=shard.room.epoch))
            if early:
                await asyncio.wait([prefill, shard.landed_whole(region.region_id)],
                                   return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() or not early:
                yield decode_pb2.ServeResponse(prefilled=await prefill)
                answered = True
            else:
                shard.metrics.early_starts.inc()
            decoding = True  # Generate claims the region now, and frees it with the pages however it ends
            async for figures, token_id in decoded(shard.generate(
                    region.region_id, prompt, 0, params, request.max_tokens, list(request.stop_token_ids), request_id)):
                if not answered and (prefill.done() or figures is not None):  # the answer before the figures
                    answered = True
                    answer = await self._answer_after_tokens(prefill, request_id)
                    if answer is not None:
                        yield answer
                yield decode_pb2.ServeResponse(figures=figures, token_id=token_id)
        finally:
            if not prefill.done():
                prefill.cancel()
            elif not prefill.cancelled():
                prefill.exception()  # looked at: a failure after the tokens went is logged where it is read
            shard.forget_whole(region.region_id)
            if not decoding:  # failed or cancelled before decoding: region and pages back now
                shard.release_region(region.region_id)

    async def _answer_after_tokens(self, prefill: asyncio.Future[Any], request_id: str
                                   ) -> decode_pb2.ServeResponse | None:
        """The prefill's answer, for a request whose tokens began before it; None when the prefill failed after
        its whole region landed (the tokens stand: they came from a complete region; its figures are lost)."""
        await asyncio.wait([prefill])  # within the prefill's own deadline
        if prefill.cancelled() or prefill.exception() is not None:
            error = "cancelled" if prefill.cancelled() else str(prefill.exception())
            log.warning("prefill_failed_after_landing", request_id=request_id, error=error)
            self.shard.metrics.prefill_failed_after_landing.inc()
            return None
        return decode_pb2.ServeResponse(prefilled=prefill.result())

    async def Generate(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        # a streaming method: errors are mapped here (status_errors wraps unary calls)
        try:
            params = sampling_params(request.sampling)
            region_id = parse_region_id(request.region_id)
            stream = self.shard.generate(region_id, list(request.prompt_token_ids), request.first_token, params,
                                         request.max_tokens, list(request.stop_token_ids),
                                         request.request_id or current_request_id())
            async for figures, token_id in decoded(stream):
                yield decode_pb2.DecodeResponse(figures=figures, token_id=token_id)
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

    async def WatchRoom(self, request: decode_pb2.WatchRoomRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[decode_pb2.RoomEvent]:
        async for epoch in self.shard.room.watch():
            yield decode_pb2.RoomEvent(epoch=epoch)

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
