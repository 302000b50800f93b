"""Prefill's edge toward decode: the handoff's messages as the core's types, and the ``Landed``
call that tells decode a part of its region landed.

``target_from_message`` is where a ``HandoffTarget`` message (from the router, or from the stage
before) is checked on its own and becomes a :class:`~kvpool.core.handoff.target.HandoffTarget`.
"""

from __future__ import annotations

import grpc
import structlog

from kvpool import service
from kvpool.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvpool.core.handoff.layout import HandoffLayout
from kvpool.core.handoff.target import HandoffFigures, HandoffTarget, StageHandoffFigures
from kvpool.rpc import decode_pb2, decode_pb2_grpc, handoff_pb2
from kvpool.status import from_status

log = structlog.get_logger(__name__)

LANDED_TIMEOUT_S = 30.0
# a Landed that found no connection is sent once more, waiting this long for one: the first call on a new
# channel can fail to connect on a loaded host (seen at load 30 on 2 cores), and landing is idempotent
LANDED_RECONNECT_S = 5.0


def target_layout(target: handoff_pb2.HandoffTarget) -> HandoffLayout:
    """The target's layout, checked on its own (tiling, positive sizes)."""
    if not target.HasField("layout"):
        raise InvalidArgument("target.layout: missing")
    layout = target.layout
    try:
        return HandoffLayout.of(layout.num_tokens, [(r.start, r.end) for r in layout.layer_split], layout.entry_bytes,
                                layout.trailer_bytes)
    except InvalidArgument as exc:
        raise InvalidArgument(f"target.layout.{exc}") from None


def target_from_message(target: handoff_pb2.HandoffTarget) -> HandoffTarget:
    return HandoffTarget(region_id=target.region_id, endpoint=target.endpoint, address=target.address,
                         size=target.size, deadline_unix_ms=target.deadline_unix_ms, layout=target_layout(target),
                         notify_address=target.notify_address)


def target_message(target: HandoffTarget) -> handoff_pb2.HandoffTarget:
    layout = target.layout
    return handoff_pb2.HandoffTarget(
        region_id=target.region_id, endpoint=target.endpoint, address=target.address, size=target.size,
        deadline_unix_ms=target.deadline_unix_ms, notify_address=target.notify_address,
        layout=handoff_pb2.HandoffLayout(
            num_tokens=layout.num_tokens, entry_bytes=layout.entry_bytes, trailer_bytes=layout.trailer_bytes,
            layer_split=[handoff_pb2.LayerRange(start=s, end=e) for s, e in layout.layer_split]),
    )


def stage_figures_from_message(figures: handoff_pb2.StageHandoffFigures) -> StageHandoffFigures:
    return StageHandoffFigures(
        stage=figures.stage, transfers=figures.transfers, bytes=figures.bytes, gather_seconds=figures.gather_seconds,
        write_seconds=figures.write_seconds, scatter_seconds=figures.scatter_seconds, ranges=figures.ranges,
        forward_end_unix_ms=figures.forward_end_unix_ms, last_write_end_unix_ms=figures.last_write_end_unix_ms)


def stage_figures_message(figures: StageHandoffFigures) -> handoff_pb2.StageHandoffFigures:
    return handoff_pb2.StageHandoffFigures(
        stage=figures.stage, transfers=figures.transfers, bytes=figures.bytes, gather_seconds=figures.gather_seconds,
        write_seconds=figures.write_seconds, scatter_seconds=figures.scatter_seconds, ranges=figures.ranges,
        forward_end_unix_ms=figures.forward_end_unix_ms, last_write_end_unix_ms=figures.last_write_end_unix_ms)


def handoff_message(figures: HandoffFigures) -> handoff_pb2.HandoffResponse:
    return handoff_pb2.HandoffResponse(
        region_id=figures.region_id, stages=[stage_figures_message(s) for s in figures.stages],
        transfers=figures.transfers, bytes=figures.bytes, seconds=figures.seconds)


class LandedClient:
    """``Decode.Landed`` for one stage, one channel per decode shard it wrote to."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    async def landed(self, target: HandoffTarget, token_start: int, token_end: int, trailer: bool) -> float:
        """Tell decode a part landed (it scatters it now); its scatter time. No address: decode
        scatters everything at Generate (an older shard)."""
        if not target.notify_address:
            return 0.0
        channel = self._channels.get(target.notify_address)
        if channel is None:
            channel = self._channels[target.notify_address] = service.channel(target.notify_address)
        request = decode_pb2.LandedRequest(region_id=target.region_id, stage=self.stage,
                                           token_start=token_start if token_start < token_end else 0,
                                           token_end=token_end if token_start < token_end else 0, trailer=trailer)
        stub = decode_pb2_grpc.DecodeStub(channel)
        try:
            try:
                response = await stub.Landed(request, timeout=LANDED_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                log.info("landed_resent", region_id=target.region_id, stage=self.stage, details=exc.details())
                response = await stub.Landed(request, timeout=LANDED_RECONNECT_S, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            error = from_status(exc, f"stage {self.stage}: decode at {target.notify_address}",
                                (InvalidArgument, FailedPrecondition))
            if isinstance(error, Unavailable):  # decode is down or unreachable: blame the target
                raise Unavailable(error.message, field="target") from None
            raise error from None
        return response.scatter_seconds
