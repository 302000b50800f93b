"""PrefillStage servicer: restore, forward to the next stage, stage info.

Hidden states go from stage to stage in pieces (``services.prefill.pieces``):
inline when small; otherwise the sender leaves them in its registered send
arena and the receiver reads them with the transfer engine (one read) into its
receive arena.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine
from contextvars import ContextVar
from typing import Any

import structlog
import torch

from kvpool.core.errors import InvalidArgument
from kvpool.model.sampling import greedy_token
from kvpool.pool.objects import ObjectLocation
from kvpool.rpc import handoff_pb2, prefill_pb2, prefill_pb2_grpc
from kvpool.status import status_errors
from services.prefill.handoff import StageHandoff
from services.prefill.pieces import ActivationLink, check_forward, received_pieces
from services.prefill.stage_runner import ChunkToRestore, RestoreFigures, SaveFigures, StageRunner

log = structlog.get_logger(__name__)

FORWARD_TIMEOUT_S = 600.0  # only for a caller that set no deadline

# the deadline of the call being served (monotonic): a stage waits on the next one exactly as long as its own
# caller waits on it, so a long prompt on a busy host fails at the client's deadline, not at a fixed one
_deadline: ContextVar[float | None] = ContextVar("forward_deadline", default=None)


def keep_deadline(context: Any) -> None:
    """Carry the served call's deadline (if any) to the forwards this task makes."""
    remaining = context.time_remaining() if context is not None else None
    _deadline.set(None if remaining is None else time.monotonic() + remaining)


def forward_timeout_s() -> float:
    deadline = _deadline.get()
    return FORWARD_TIMEOUT_S if deadline is None else max(0.001, deadline - time.monotonic())


def figures_message(stage: int, figures: RestoreFigures) -> prefill_pb2.StageRestoreFigures:
    return prefill_pb2.StageRestoreFigures(
        stage=stage,
        num_chunks_requested=figures.num_chunks_requested,
        num_chunks_restored=figures.num_chunks_restored,
        bytes=figures.bytes,
        read_ms=figures.read_ms,
        corrupt_chunk_indexes=figures.corrupt_chunk_indexes,
    )


def save_done_message(stage: int, figures: SaveFigures) -> prefill_pb2.SaveDoneResponse:
    return prefill_pb2.SaveDoneResponse(
        stage=stage, num_stored=figures.num_stored, num_exists=figures.num_exists,
        num_not_stored=figures.num_not_stored, bytes=figures.bytes, put_ms=figures.put_ms,
    )


def restore_chunks(request: prefill_pb2.RestoreRequest, num_blocks: int) -> list[ChunkToRestore]:
    chunks = []
    for i, c in enumerate(request.chunks):
        if not 0 <= c.block_id < num_blocks:
            raise InvalidArgument(f"chunks[{i}].block_id: {c.block_id} is outside 0..{num_blocks - 1}")
        chunks.append(ChunkToRestore(c.chunk_index, c.block_id,
                                     ObjectLocation(c.key, c.endpoint, c.address, c.size, c.checksum)))
    return chunks


class PrefillStageServicer(prefill_pb2_grpc.PrefillStageServicer):
    def __init__(self, runner: StageRunner, link: ActivationLink, handoff: StageHandoff) -> None:
        self.runner = runner
        self.link = link
        self.handoff = handoff
        self.settings = runner.settings
        self.restores: dict[str, asyncio.Future[RestoreFigures]] = {}
        # Forwards in progress: a SaveDone that overtakes one waits for it to start its save
        self.forwards: dict[str, asyncio.Future[prefill_pb2.ForwardResponse]] = {}

    @status_errors
    async def StageInfo(self, request: Any, context: Any) -> prefill_pb2.StageInfoResponse:
        s = self.settings
        start, end = s.layers
        return prefill_pb2.StageInfoResponse(
            stage=s.stage, num_stages=s.num_stages, layer_start=start, layer_end=end, num_blocks=s.num_blocks,
            block_size=s.chunk_size, namespace=self.runner.namespace, transfer_endpoint=self.runner.engine.endpoint,
            work_scale=self.runner.work_scale.factor,
        )

    @status_errors
    async def Restore(self, request: prefill_pb2.RestoreRequest, context: Any) -> prefill_pb2.RestoreResponse:
        chunks = restore_chunks(request, self.settings.num_blocks)
        # shielded and remembered: if stage 0 stops waiting (deadline), objects may
        # still be landing in the pages, and this request's Forward must not compute before it ends
        task = asyncio.ensure_future(self.runner.restore(chunks))
        self.restores[request.request_id] = task
        task.add_done_callback(lambda _: self.restores.pop(request.request_id, None))
        figures = await asyncio.shield(task)
        return prefill_pb2.RestoreResponse(figures=figures_message(self.settings.stage, figures))

    @status_errors
    async def Forward(self, request: prefill_pb2.ForwardRequest, context: Any) -> prefill_pb2.ForwardResponse:
        check_forward(request, self.settings.num_blocks, self.settings.chunk_size)
        if request.piece_start or request.piece_end:
            raise InvalidArgument(f"piece_end: Forward takes tokens [compute_start, num_tokens) whole "
                                  f"(got piece {request.piece_start}..{request.piece_end}); pieces go by ForwardPieces")
        return await self._serve(request, context, self._forward(request))

    @status_errors
    async def ForwardPieces(self, request_iterator: AsyncIterator[prefill_pb2.ForwardRequest],
                            context: Any) -> prefill_pb2.ForwardResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            raise InvalidArgument("request: ForwardPieces got no piece")
        check_forward(first, self.settings.num_blocks, self.settings.chunk_size)
        pieces = received_pieces(first, aiter(request_iterator), self.link)
        return await self._serve(first, context, run_stage(self.runner, self.link, first, pieces,
                                                           list(first.block_table), self.handoff))

    async def _serve(self, request: prefill_pb2.ForwardRequest, context: Any,
                     work: Coroutine[Any, Any, prefill_pb2.ForwardResponse]) -> prefill_pb2.ForwardResponse:
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

    async def _forward(self, request: prefill_pb2.ForwardRequest) -> prefill_pb2.ForwardResponse:
        inputs = await self.link.receive(request.activation, request.num_tokens - request.compute_start)
        return await run_stage(self.runner, self.link, request, inputs, list(request.block_table), self.handoff)

    @status_errors
    async def HandoffDone(self, request: prefill_pb2.HandoffDoneRequest, context: Any
                          ) -> handoff_pb2.StageHandoffFigures:
        forward = self.forwards.get(request.request_id)
        if forward is not None:
            await asyncio.wait([forward])  # its writes start inside it
        return await self.handoff.done(request.request_id)

    @status_errors
    async def SaveDone(self, request: prefill_pb2.SaveDoneRequest, context: Any) -> prefill_pb2.SaveDoneResponse:
        forward = self.forwards.get(request.request_id)
        if forward is not None:
            await asyncio.wait([forward])  # its save starts inside it
        figures = await self.runner.save_done(request.request_id)
        return save_done_message(self.settings.stage, figures)


async def run_stage(
    runner: StageRunner, link: ActivationLink, request: prefill_pb2.ForwardRequest,
    inputs: torch.Tensor | AsyncIterator[tuple[prefill_pb2.ForwardRequest, torch.Tensor]],
    block_table: list[int], handoff: StageHandoff,
) -> prefill_pb2.ForwardResponse:
    """Compute this stage, streaming its KV to decode as it becomes final, start saving, forward onward.

    ``inputs``: the hidden states (or token ids) of tokens [compute_start, num_tokens) at once, or the
    pieces of a ``ForwardPieces`` stream as they come. Each piece this stage computes goes on to the
    next stage as it ends (``PieceSender``), so the stages overlap; with ``forward_after_stage`` (bench)
    the request goes on whole once this stage computed all of it.

    With a target, the cached prefix is final at once and each forward piece
    when it ends; the last stage also writes the final logits. Bench mode
    ``handoff_after_prefill`` writes the whole part only once every later
    stage has computed. The writes run in the background: ``HandoffDone``
    waits for them.
    """
    writes = handoff.begin(request.request_id, block_table, request.target) if request.HasField("target") else None
    stream = writes is not None and not request.handoff_after_prefill
    if stream and request.compute_start:
        writes.write(0, request.compute_start)  # restored or device-cached: final already
    is_last = runner.model.is_last
    sender = None if is_last or request.forward_after_stage else link.open(request, forward_timeout_s())
    pieces = one_piece(request, inputs) if isinstance(inputs, torch.Tensor) else inputs
    kept: list[torch.Tensor] = []  # what goes on after the last piece: its last row, or (bench) every output
    compute_ms = 0.0
    try:
        async for piece, piece_inputs in pieces:
            if sender is not None and sender.failed:
                break  # a later stage failed: finish() says how
            start = piece.piece_start if piece.piece_end else request.compute_start
            t0 = time.perf_counter()
            out = await runner.forward(piece_inputs, block_table, start, writes.write if stream else None,
                                       sender.send if sender is not None else None)
            compute_ms += (time.perf_counter() - t0) * 1e3
            kept = kept + [out] if request.forward_after_stage and not is_last else [out[-1:]]
        else:
            if writes is not None:
                writes.forward_ended()
            # the put reads the pages in the background; stage 0 keeps those blocks until save_done
            runner.start_save(request.request_id, block_table, request.save_first_chunk,
                              list(request.save_chunk_hashes), request.tenant)
        if is_last:
            last = kept[-1][-1]
            # the model's sampler picks among its output ids only; the logits go back as the model made them
            response = prefill_pb2.ForwardResponse(first_token=greedy_token(last, runner.config))
            logits = last.to(torch.float32).contiguous().numpy().tobytes()
            if request.return_logits:
                response.logits = logits
            if writes is not None:
                trailer = logits if request.target.layout.trailer_bytes else b""
                writes.write(0, 0 if stream else request.num_tokens, trailer)
        else:
            if sender is None:  # bench: the whole request at once
                sender = link.open(request, forward_timeout_s())
                sender.send(torch.cat(kept) if len(kept) > 1 else kept[0], request.compute_start, request.num_tokens)
            response = await sender.finish()
            sender = None
            if writes is not None and not stream:
                writes.write(0, request.num_tokens)  # every later stage has computed
    finally:
        if sender is not None:
            sender.abort()
    response.stage_compute_ms.insert(0, compute_ms)
    return response


async def one_piece(request: prefill_pb2.ForwardRequest, inputs: torch.Tensor
                    ) -> AsyncIterator[tuple[prefill_pb2.ForwardRequest, torch.Tensor]]:
    yield request, inputs
