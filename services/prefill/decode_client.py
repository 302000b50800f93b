"""Prefill's client of decode: the ``Landed`` call that tells decode a part of its region landed.

The handoff's messages convert in ``kvpool.handoff_messages``.
"""

from __future__ import annotations

import grpc

from kvpool import service
from kvpool.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvpool.core.handoff.target import HandoffTarget
from kvpool.rpc import decode_pb2, decode_pb2_grpc
from kvpool.status import from_status


LANDED_TIMEOUT_S = 30.0


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
        try:  # idempotent: gRPC tries it again when it did not reach an answer (kvpool.core.admission.retry)
            response = await stub.Landed(request, timeout=LANDED_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            error = from_status(exc, f"stage {self.stage}: decode at {target.notify_address}",
                                (InvalidArgument, FailedPrecondition))
            if isinstance(error, Unavailable):  # decode is down or unreachable: blame the target
                raise Unavailable(error.message, field="target") from None
            raise error from None
        return response.scatter_seconds
