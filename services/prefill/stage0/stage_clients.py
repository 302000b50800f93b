"""Stage 0's calls to the later stages of its pipeline (``PrefillStage``: Restore, HandoffDone,
SaveDone), in the prefill's own types; a failed call raises the domain error it means."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvpool.core.errors import FailedPrecondition, InvalidArgument
from kvpool.core.handoff.target import StageHandoffFigures
from kvpool.rpc import prefill_pb2, prefill_pb2_grpc
from kvpool.handoff_messages import stage_figures_from_message
from kvpool.core.pool.paths import SegmentAccess
from kvpool.pool.client import access_message
from kvpool.services.prefill.restore_figures import StageRestoreFigures
from kvpool.services.prefill.stage_runner import ChunkToRestore, SaveFigures
from kvpool.services.prefill.stage_servicer import restore_figures_from_message
from kvpool.status import from_status


class StageClient:
    """One later stage as stage 0 calls it."""

    def __init__(self, stage: int, channel: grpc.aio.Channel) -> None:
        self.stage = stage
        self.stub = prefill_pb2_grpc.PrefillStageStub(channel)

    async def restore(self, request_id: str, chunks: list[ChunkToRestore], accesses: Sequence[SegmentAccess],
                      timeout_s: float) -> StageRestoreFigures:
        """Read ``chunks`` into their blocks on this stage (``accesses``: how to reach the segments they lie
        in); UNAVAILABLE if the stage could not say how it went."""
        request = prefill_pb2.RestoreRequest(request_id=request_id, chunks=[
            prefill_pb2.RestoreChunk(chunk_index=c.chunk_index, block_id=c.block_id, endpoint=c.location.endpoint,
                                     address=c.location.address, size=c.location.size,
                                     checksum=c.location.checksum, key=c.location.key,
                                     segment_id=c.location.segment_id)
            for c in chunks
        ], segments=[access_message(a) for a in accesses])
        try:
            response = await self.stub.Restore(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_status(exc, f"stage {self.stage}", ()) from None
        return restore_figures_from_message(response.figures)

    async def handoff_done(self, request_id: str, timeout_s: float) -> StageHandoffFigures:
        """This stage's handoff writes of the request ended: their figures, or why not."""
        try:
            response = await self.stub.HandoffDone(prefill_pb2.HandoffDoneRequest(request_id=request_id),
                                                   timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_status(exc, f"stage {self.stage}", (InvalidArgument, FailedPrecondition)) from None
        return stage_figures_from_message(response)

    async def save_done(self, request_id: str, timeout_s: float) -> SaveFigures:
        """This stage's saves of the request ended; UNAVAILABLE if the stage could not say."""
        try:
            response = await self.stub.SaveDone(prefill_pb2.SaveDoneRequest(request_id=request_id),
                                                timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_status(exc, f"stage {self.stage}", ()) from None
        return SaveFigures(num_stored=response.num_stored, num_exists=response.num_exists,
                           num_not_stored=response.num_not_stored, bytes=response.bytes, put_ms=response.put_ms)
