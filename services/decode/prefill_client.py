"""A decode shard's client of the prefill pipelines it serves requests from (``Serve``): one channel per stage 0,
and ``Prefill`` into a region of this shard, its failure as the core's error it means for the caller.

A failure names who failed, so the router moves the request the right way (``kvpool.core.admission.retry``):
the pipeline (UNAVAILABLE, field ``pipeline``), or this shard (the prefill could not write to its region:
UNAVAILABLE, field ``target``). The prompt's own faults (INVALID_ARGUMENT) and no room at the pipeline
(RESOURCE_EXHAUSTED) pass on as they came.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import structlog

from kvpool import service
from kvpool.core.admission.retry import PIPELINE_FIELD, TARGET_FIELD
from kvpool.core.errors import InvalidArgument, KvpoolError, PermissionDenied, ResourceExhausted, Unavailable
from kvpool.core.handoff.target import HandoffTarget
from kvpool.handoff_messages import target_message
from kvpool.rpc import prefill_pb2, prefill_pb2_grpc
from kvpool.status import error_field, from_status

log = structlog.get_logger(__name__)

MAX_ADDRESS_BYTES = 255


class PrefillClients:
    """Channels to the pipelines' stage 0s, opened on first use; ``allowed`` (when not empty) the only
    addresses a request may name."""

    def __init__(self, allowed: Sequence[str] = ()) -> None:
        self.allowed = frozenset(a for a in allowed if a)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def check(self, address: str) -> str:
        """``address`` as a request names it, or INVALID_ARGUMENT / PERMISSION_DENIED naming the field."""
        host, _, port = address.rpartition(":")
        if len(address.encode()) > MAX_ADDRESS_BYTES or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"prefill_address: {address[:64]!r} is not host:port")
        if self.allowed and address not in self.allowed:
            raise PermissionDenied(f"prefill_address: {address!r} is not a pipeline this shard serves from "
                                   "(--pipelines)", field="prefill_address")
        return address

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    async def prefill(self, address: str, token_ids: Sequence[int], session_key: str, tenant: str, cache_salt: str,
                      target: HandoffTarget, timeout_s: float) -> prefill_pb2.PrefillResponse:
        """Prefill the prompt into ``target`` at the pipeline whose stage 0 is at ``address``."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = service.channel(address)
        request = prefill_pb2.PrefillRequest(token_ids=token_ids, session_key=session_key, tenant=tenant,
                                             cache_salt=cache_salt, target=target_message(target))
        try:
            return await prefill_pb2_grpc.PrefillStub(channel).Prefill(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise prefill_error(exc, address) from None


def prefill_error(exc: grpc.aio.AioRpcError, address: str) -> KvpoolError:
    """A failed Prefill as ``Serve`` answers it (module doc)."""
    error = from_status(exc, f"pipeline at {address}", (InvalidArgument, ResourceExhausted))
    field = error_field(exc)
    if field.startswith(TARGET_FIELD):  # whatever the code: the region it was to write is this shard's
        log.warning("prefill_failed_writing_here", pipeline=address, code=exc.code().name, details=exc.details())
        return Unavailable(f"target: the prefill could not write into this shard's region: {exc.details()}",
                           field=TARGET_FIELD)
    if isinstance(error, (InvalidArgument, ResourceExhausted)):
        return error
    log.warning("prefill_failed", pipeline=address, code=exc.code().name, details=exc.details())
    return Unavailable(f"pipeline: {exc.code().name}: {exc.details()}", field=PIPELINE_FIELD)
