"""Stage 0's calls to the later stages of its pipeline (``PrefillStage``: Restore, for a staging or an older
stage; HandoffDone, SaveDone), in the prefill's own types; a failed call raises the domain error it means."""

from __future__ import annotations

import grpc

from kvpool.core.errors import FailedPrecondition, InvalidArgument
from kvpool.core.handoff.target import StageHandoffFigures
from kvpool.rpc import prefill_pb2, prefill_pb2_grpc
from kvpool.handoff_messages import stage_figures_from_message
from kvpool.core.prefill.restore_figures import StageRestoreFigures
from kvpool.services.prefill.stage_runner import SaveFigures, StageRestore
from kvpool.services.prefill.stage_client import restore_figures_from_message, restore_message
from kvpool.status import from_status


class StageClient:
    """One later stage as stage 0 calls it."""

    def __init__(self, stage: int, channel: grpc.aio.Channel, restore_on_chain: bool = False,
                 saves_when_told: bool = False, chunk_bytes: int = 0) -> None:
        self.stage = stage
        self.stub = prefill_pb2_grpc.PrefillStageStub(channel)
        # it takes its restore in ForwardPieces' first message (StageInfo said so at start)
        self.restore_on_chain = restore_on_chain
        # it writes its save where SaveDone says (StageInfo said so), its objects of a chunk this many bytes
        self.saves_when_told = saves_when_told and chunk_bytes > 0
        self.chunk_bytes = chunk_bytes

    async def restore(self, request_id: str, restore: StageRestore, timeout_s: float) -> StageRestoreFigures:
        """Read ``restore``'s chunks into their blocks on this stage; UNAVAILABLE if the stage could not say how
        it went."""
        try:
            response = await self.stub.Restore(restore_message(request_id, restore), timeout=timeout_s)
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
        return save_figures(response)

    async def write_told(self, request_id: str, writes: StageRestore, timeout_s: float
                         ) -> tuple[SaveFigures, list[tuple[str, int]]]:
        """Have this stage write its objects of the request's save where stage 0 reserved them: what it wrote,
        each with its checksum; UNAVAILABLE if the stage could not say."""
        chunks = restore_message(request_id, writes)
        try:
            response = await self.stub.SaveDone(prefill_pb2.SaveDoneRequest(
                request_id=request_id, told=True, writes=chunks.chunks, segments=chunks.segments), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_status(exc, f"stage {self.stage}", ()) from None
        return save_figures(response), list(zip(response.written_keys, response.written_checksums))


def save_figures(response: prefill_pb2.SaveDoneResponse) -> SaveFigures:
    return SaveFigures(num_stored=response.num_stored, num_exists=response.num_exists,
                       num_not_stored=response.num_not_stored, bytes=response.bytes, put_ms=response.put_ms)
