"""PrefillStage servicer: restore, forward to the next stage, stage info.

Hidden states go from stage to stage in pieces (``kvpool.services.prefill.pieces``):
inline when small; otherwise the sender leaves them in its send arena and the
receiver copies them from its shared mapping of it (same declared host) or
reads them with the transfer engine (one read) into its receive arena.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence, AsyncIterator, Coroutine
from typing import Any

import structlog

from kvpool.core.errors import InvalidArgument
from kvpool.core.prefill.stage_forward import Piece, StageForward, StageForwardResult
from kvpool.handoff_messages import stage_figures_message
from kvpool.rpc import handoff_pb2, prefill_pb2, prefill_pb2_grpc
from kvpool.status import status_errors
from kvpool.services.prefill.handoff import StageHandoff
from kvpool.services.prefill.forward import keep_deadline, run_stage
from kvpool.services.prefill.pieces import ActivationLink, received_pieces
from kvpool.services.prefill.stage_client import (
    forward_from_message,
    piece_from_message,
    restore_figures_message,
    restore_from_message,
    result_message,
)
from kvpool.core.prefill.restore_figures import RestoreFigures, StageRestoreFigures
from kvpool.services.prefill.stage_runner import SaveFigures, StageRestore, StageRunner

log = structlog.get_logger(__name__)

def save_done_message(stage: int, figures: SaveFigures, written: Sequence[tuple[str, int]] = ()
                      ) -> prefill_pb2.SaveDoneResponse:
    return prefill_pb2.SaveDoneResponse(
        stage=stage, num_stored=figures.num_stored, num_exists=figures.num_exists,
        num_not_stored=figures.num_not_stored, bytes=figures.bytes, put_ms=figures.put_ms,
        written_keys=[key for key, _ in written], written_checksums=[checksum for _, checksum in written],
    )


async def pieces_of(messages: AsyncIterator[prefill_pb2.ForwardRequest]) -> AsyncIterator[Piece]:
    async for message in messages:
        yield piece_from_message(message)


class PrefillStageServicer(prefill_pb2_grpc.PrefillStageServicer):
    def __init__(self, runner: StageRunner, link: ActivationLink, handoff: StageHandoff) -> None:
        self.runner = runner
        self.link = link
        self.handoff = handoff
        self.settings = runner.settings
        self.restores: dict[str, asyncio.Future[RestoreFigures]] = {}
        # Forwards in progress: a SaveDone that overtakes one waits for it to start its save
        self.forwards: dict[str, asyncio.Future[StageForwardResult]] = {}

    @status_errors
    async def StageInfo(self, request: Any, context: Any) -> prefill_pb2.StageInfoResponse:
        s = self.settings
        start, end = s.layers
        return prefill_pb2.StageInfoResponse(
            stage=s.stage, num_stages=s.num_stages, layer_start=start, layer_end=end, num_blocks=s.num_blocks,
            block_size=s.chunk_size, namespace=self.runner.namespace,
            transfer_endpoint=self.runner.engine.endpoint if self.runner.engine is not None else "",
            work_scale=self.runner.work_scale.factor, restore_on_chain=True,
            chunk_bytes=self.runner.chunk_nbytes, saves_when_told=True,
        )

    @status_errors
    async def Restore(self, request: prefill_pb2.RestoreRequest, context: Any) -> prefill_pb2.RestoreResponse:
        # shielded and remembered: if stage 0 stops waiting (deadline), objects may
        # still be landing in the pages, and this request's Forward must not compute before it ends
        task = self._restore(request.request_id, restore_from_message(request, self.settings.num_blocks))
        self.restores[request.request_id] = task
        task.add_done_callback(lambda _: self.restores.pop(request.request_id, None))
        figures = await asyncio.shield(task)
        return prefill_pb2.RestoreResponse(
            figures=restore_figures_message(StageRestoreFigures.of(self.settings.stage, figures)))

    def _restore(self, request_id: str, restore: StageRestore) -> asyncio.Future[RestoreFigures]:
        """Start reading ``restore``'s objects into their blocks (after learning how to reach their segments)."""
        if self.runner.pool is not None:  # how to reach the segments stage 0's lookup named
            self.runner.pool.learn(list(restore.accesses))
        return asyncio.ensure_future(self.runner.restore(restore.chunks))

    @status_errors
    async def Forward(self, request: prefill_pb2.ForwardRequest, context: Any) -> prefill_pb2.ForwardResponse:
        forward = forward_from_message(request)
        forward.check(self.settings.num_blocks, self.settings.chunk_size)
        if request.piece_start or request.piece_end:
            raise InvalidArgument(f"piece_end: Forward takes tokens [compute_start, num_tokens) whole "
                                  f"(got piece {request.piece_start}..{request.piece_end}); pieces go by ForwardPieces")
        piece = piece_from_message(request)
        return result_message(await self._serve(forward, context, self._forward(forward, piece)))

    @status_errors
    async def ForwardPieces(self, request_iterator: AsyncIterator[prefill_pb2.ForwardRequest],
                            context: Any) -> prefill_pb2.ForwardResponse:
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is None:
            raise InvalidArgument("request: ForwardPieces got no piece")
        forward = forward_from_message(first)
        forward.check(self.settings.num_blocks, self.settings.chunk_size)
        restoring, restores_after = None, ()
        if first.plan_only:  # the request's restore rides first: ours now, the later stages' passed straight on
            if not first.restores:
                raise InvalidArgument("restores: a plan_only message carries this stage's restore at least")
            if len(first.restores) > self.settings.num_stages - self.settings.stage:
                raise InvalidArgument(f"restores: {len(first.restores)} stages' restores, only "
                                      f"{self.settings.num_stages - self.settings.stage} stages from this one on")
            mine, *later = (restore_from_message(r, self.settings.num_blocks, f"restores[{i}].")
                            for i, r in enumerate(first.restores))
            restores_after = tuple(later)
            restoring = self._restore(forward.request_id, mine)
            first = await anext(messages, None)
            if first is None:
                await asyncio.wait([restoring])  # nothing to forward, but the pages are being written: let it end
                raise InvalidArgument("request: ForwardPieces got its plan and no piece")
        pieces = received_pieces(forward, piece_from_message(first), pieces_of(messages), self.link)
        return result_message(await self._serve(forward, context, run_stage(
            self.runner, self.link, forward, pieces, self.handoff, restoring, restores_after)))

    async def _serve(self, request: StageForward, context: Any,
                     work: Coroutine[Any, Any, StageForwardResult]) -> StageForwardResult:
        """Run a forward after the request's restore landed, as a task a SaveDone or HandoffDone can wait
        for; shielded, so a caller that stops waiting does not cut it off mid-write."""
        pending = self.restores.get(request.request_id)
        if pending is not None:
            await asyncio.wait([pending])  # its pages must hold the restored KV before we compute over them
        keep_deadline(context)
        task = asyncio.ensure_future(work)
        self.forwards[request.request_id] = task
        task.add_done_callback(lambda _: self.forwards.pop(request.request_id, None))
        return await asyncio.shield(task)

    async def _forward(self, request: StageForward, whole: Piece) -> StageForwardResult:
        inputs = await self.link.receive(whole.activation, request.num_tokens - request.compute_start)
        return await run_stage(self.runner, self.link, request, inputs, self.handoff)

    @status_errors
    async def HandoffDone(self, request: prefill_pb2.HandoffDoneRequest, context: Any
                          ) -> handoff_pb2.StageHandoffFigures:
        forward = self.forwards.get(request.request_id)
        if forward is not None:
            await asyncio.wait([forward])  # its writes start inside it
        return stage_figures_message(await self.handoff.done(request.request_id))

    @status_errors
    async def SaveDone(self, request: prefill_pb2.SaveDoneRequest, context: Any) -> prefill_pb2.SaveDoneResponse:
        forward = self.forwards.get(request.request_id)
        if forward is not None:
            await asyncio.wait([forward])  # its save starts inside it (told: its pages are final by then)
        if request.told:  # stage 0 reserved this stage's objects: write them where it says
            restore = restore_from_message(prefill_pb2.RestoreRequest(
                request_id=request.request_id, chunks=request.writes, segments=request.segments),
                self.settings.num_blocks, chunks_name="writes")
            figures, written = await self.runner.write_told(restore)
            return save_done_message(self.settings.stage, figures, written)
        figures = await self.runner.save_done(request.request_id)
        return save_done_message(self.settings.stage, figures)
