"""A stage's client of the next stage (``ForwardPieces``), and the forward's messages as the core's types.

The sending side of ``kvpool.services.prefill.pieces``: one client-streaming call per request
and stage. ``PieceSender.send`` only queues; a writer task packs each piece (inline when small,
else in the send arena for the next stage to copy or read) and writes it, so a slow reader never stalls
this stage's compute. ``finish`` ends the stream and returns the next stage's answer, the chain's;
``abort`` cancels the call, so the next stage stops waiting for pieces that will not come.

Both directions of the ``ForwardRequest``/``ForwardResponse`` conversion are here: this client
sends what the stage servicer receives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import torch

from kvpool import service
from kvpool.core.errors import DeviceCacheLost, FailedPrecondition, InvalidArgument, RestoreFellShort, Unavailable
from kvpool.core.prefill.stage_forward import Activation, Piece, StageForward, StageForwardResult
from kvpool.handoff_messages import (
    shared_memory_from_message,
    shared_memory_message,
    stage_figures_from_message,
    stage_figures_message,
    target_from_message,
    target_message,
)
from kvpool.core.prefill.restore_figures import StageRestoreFigures
from kvpool.pool.client import access_from_message, access_message
from kvpool.pool.objects import ObjectLocation
from kvpool.rpc import prefill_pb2, prefill_pb2_grpc
from kvpool.services.prefill.stage_runner import ChunkToRestore, StageRestore
from kvpool.status import corrupt_chunks, error_field, error_kind, from_status

if TYPE_CHECKING:
    from kvpool.services.prefill.arena import Region

# packs hidden states for the next stage; a region it takes is appended to the list (freed after the call)
Pack = Callable[[torch.Tensor, "list[Region]"], Awaitable[Activation]]


def forward_message(forward: StageForward) -> prefill_pb2.ForwardRequest:
    message = prefill_pb2.ForwardRequest(
        request_id=forward.request_id, block_table=forward.block_table, compute_start=forward.compute_start,
        num_tokens=forward.num_tokens, save_first_chunk=forward.save_first_chunk,
        save_chunk_hashes=forward.save_chunk_hashes, return_logits=forward.return_logits, tenant=forward.tenant,
        save_when_told=forward.save_when_told,
    )
    if forward.target is not None:
        message.target.CopyFrom(target_message(forward.target))
    return message


def forward_from_message(message: prefill_pb2.ForwardRequest) -> StageForward:
    """The request a ``Forward`` or the first message of a ``ForwardPieces`` carries; its target
    checked on its own (``target_from_message``)."""
    return StageForward(
        request_id=message.request_id, num_tokens=message.num_tokens, compute_start=message.compute_start,
        block_table=tuple(message.block_table), save_first_chunk=message.save_first_chunk,
        save_chunk_hashes=tuple(message.save_chunk_hashes), return_logits=message.return_logits,
        tenant=message.tenant, target=target_from_message(message.target) if message.HasField("target") else None,
        save_when_told=message.save_when_told,
    )


def activation_message(activation: Activation) -> prefill_pb2.Activation:
    return prefill_pb2.Activation(num_tokens=activation.num_tokens, hidden_size=activation.hidden_size,
                                  inline=activation.inline, endpoint=activation.endpoint,
                                  address=activation.address, size=activation.size, host=activation.host,
                                  shared_memory=shared_memory_message(activation.shared),
                                  shared_base_address=activation.shared_base_address)


def piece_from_message(message: prefill_pb2.ForwardRequest) -> Piece:
    """The piece a message carries; its shared memory, if any, checked (INVALID_ARGUMENT naming the field)."""
    a = message.activation
    shared = shared_memory_from_message(a.shared_memory) if a.HasField("shared_memory") else None
    if shared is not None:
        shared.check("activation.shared_memory")
    return Piece(request_id=message.request_id, num_tokens=message.num_tokens, compute_start=message.compute_start,
                 start=message.piece_start, end=message.piece_end,
                 activation=Activation(num_tokens=a.num_tokens, hidden_size=a.hidden_size, inline=a.inline,
                                       endpoint=a.endpoint, address=a.address, size=a.size, host=a.host,
                                       shared=shared, shared_base_address=a.shared_base_address))


def result_message(result: StageForwardResult) -> prefill_pb2.ForwardResponse:
    return prefill_pb2.ForwardResponse(first_token=result.first_token, logits=result.logits,
                                       stage_compute_ms=result.stage_compute_ms,
                                       handoff_stages=[stage_figures_message(s) for s in result.handoff_stages],
                                       restore_stages=[restore_figures_message(s) for s in result.restore_stages])


def result_from_message(message: prefill_pb2.ForwardResponse) -> StageForwardResult:
    return StageForwardResult(first_token=message.first_token, logits=message.logits,
                              stage_compute_ms=list(message.stage_compute_ms),
                              handoff_stages=[stage_figures_from_message(s) for s in message.handoff_stages],
                              restore_stages=[restore_figures_from_message(s) for s in message.restore_stages])


def restore_figures_message(figures: StageRestoreFigures) -> prefill_pb2.StageRestoreFigures:
    return prefill_pb2.StageRestoreFigures(
        stage=figures.stage, num_chunks_requested=figures.num_chunks_requested,
        num_chunks_restored=figures.num_chunks_restored, bytes=figures.bytes, read_ms=figures.read_ms,
        corrupt_chunk_indexes=figures.corrupt_chunk_indexes)


def restore_figures_from_message(figures: prefill_pb2.StageRestoreFigures) -> StageRestoreFigures:
    return StageRestoreFigures(
        stage=figures.stage, num_chunks_requested=figures.num_chunks_requested,
        num_chunks_restored=figures.num_chunks_restored, bytes=figures.bytes, read_ms=figures.read_ms,
        corrupt_chunk_indexes=tuple(figures.corrupt_chunk_indexes))


def restore_message(request_id: str, restore: StageRestore) -> prefill_pb2.RestoreRequest:
    return prefill_pb2.RestoreRequest(request_id=request_id, chunks=[
        prefill_pb2.RestoreChunk(chunk_index=c.chunk_index, block_id=c.block_id, endpoint=c.location.endpoint,
                                 address=c.location.address, size=c.location.size, checksum=c.location.checksum,
                                 key=c.location.key, segment_id=c.location.segment_id)
        for c in restore.chunks
    ], segments=[access_message(a) for a in restore.accesses])


def restore_from_message(message: prefill_pb2.RestoreRequest, num_blocks: int, field: str = "",
                         chunks_name: str = "chunks") -> StageRestore:
    """One stage's restore as sent (``field``: where it lies in the message, for errors; ``chunks_name``: what
    the message calls its chunks), its block ids and shared memory checked (INVALID_ARGUMENT naming the
    field)."""
    chunks = []
    for i, c in enumerate(message.chunks):
        if not 0 <= c.block_id < num_blocks:
            raise InvalidArgument(f"{field}{chunks_name}[{i}].block_id: {c.block_id} is outside 0..{num_blocks - 1}")
        chunks.append(ChunkToRestore(c.chunk_index, c.block_id,
                                     ObjectLocation(c.key, c.endpoint, c.address, c.size, c.checksum, c.segment_id)))
    accesses = [access_from_message(s) for s in message.segments]
    for i, access in enumerate(accesses):
        if access.shared is not None:
            access.shared.check(f"{field}segments[{i}].shared_memory")
    return StageRestore(tuple(chunks), tuple(accesses))


def stage_error(exc: grpc.aio.AioRpcError, stage: int) -> Exception:
    """The next stage's failure as this stage's: a restarted stage's lost cache keeps its meaning, and so
    does a failure of its handoff writes (naming the ``target``, so the router blames decode, as
    ``HandoffDone`` passed it on); anything else is that stage unavailable."""
    kind = error_kind(exc)
    if kind is DeviceCacheLost:
        return DeviceCacheLost(exc.details() or "")
    if kind is RestoreFellShort:
        return RestoreFellShort(exc.details() or "", corrupt_chunk_indexes=corrupt_chunks(exc))
    field = error_field(exc)
    if field.startswith("target"):
        return from_status(exc, f"stage {stage}", (InvalidArgument, FailedPrecondition))
    return Unavailable(f"stage {stage}: {exc.code().name}: {exc.details()}")


class PieceSender:
    """One request's pieces to the next stage over one ``ForwardPieces`` call (module doc)."""

    def __init__(self, stub: prefill_pb2_grpc.PrefillStageStub, next_stage: int, forward: StageForward,
                 timeout_s: float, pack: Pack, free: Callable[[Region], None],
                 restores: Sequence[StageRestore] = ()) -> None:
        self.next_stage = next_stage
        self._request = forward_message(forward)  # each piece repeats it
        self._pack = pack
        self._free_region = free
        self.call: Any = stub.ForwardPieces(timeout=timeout_s, metadata=service.stream_metadata())
        self._queue: asyncio.Queue[tuple[torch.Tensor, int, int] | prefill_pb2.ForwardRequest | None] = \
            asyncio.Queue()
        if restores:  # first, before any piece: the next stage starts its restore at once and passes the rest on
            plan = prefill_pb2.ForwardRequest(plan_only=True,
                                              restores=[restore_message(forward.request_id, r) for r in restores])
            plan.MergeFrom(self._request)
            self._queue.put_nowait(plan)
        self._regions: list[Region] = []
        self._writer = asyncio.ensure_future(self._write_all())

    def send(self, hidden: torch.Tensor, start: int, end: int) -> None:
        """Queue the hidden states of tokens [start, end) (the next piece in order)."""
        self._queue.put_nowait((hidden, start, end))

    @property
    def failed(self) -> bool:
        """The call can take no more pieces (the next stage failed): ``finish`` says why."""
        return self._writer.done() and (self._writer.cancelled() or self._writer.exception() is not None)

    async def _write_all(self) -> None:
        while (item := await self._queue.get()) is not None:
            if isinstance(item, prefill_pb2.ForwardRequest):
                await self.call.write(item)
                continue
            hidden, start, end = item
            message = prefill_pb2.ForwardRequest()
            message.CopyFrom(self._request)
            message.activation.CopyFrom(activation_message(await self._pack(hidden, self._regions)))
            message.piece_start, message.piece_end = start, end
            await self.call.write(message)
        await self.call.done_writing()

    async def finish(self) -> StageForwardResult:
        """End the stream; the next stage's answer once every later stage computed the last piece."""
        self._queue.put_nowait(None)
        try:
            try:
                await self._writer
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # a write fails when the call did: its status says why
            except BaseException:
                self.call.cancel()  # no piece could be sent (the send arena stayed full): the call ends here
                raise
            return result_from_message(await self.call)
        except grpc.aio.AioRpcError as exc:
            raise stage_error(exc, self.next_stage) from exc
        finally:
            self._free()

    def abort(self) -> None:
        """This stage failed: the next one stops waiting for the rest."""
        if self._writer.done() and not self._writer.cancelled():
            self._writer.exception()  # seen: a write that failed with the call is not an error of its own
        self._writer.cancel()
        self.call.cancel()
        self._free()

    def _free(self) -> None:
        for region in self._regions:
            self._free_region(region)
        self._regions.clear()


class NextStageClient:
    """The channel to the next stage; ``open`` starts one request's ``ForwardPieces``."""

    def __init__(self, address: str, next_stage: int) -> None:
        self.next_stage = next_stage
        self._channel = service.channel(address)
        self._stub = prefill_pb2_grpc.PrefillStageStub(self._channel)

    def open(self, forward: StageForward, timeout_s: float, pack: Pack, free: Callable[[Region], None],
             restores: Sequence[StageRestore] = ()) -> PieceSender:
        return PieceSender(self._stub, self.next_stage, forward, timeout_s, pack, free, restores)

    async def close(self) -> None:
        await self._channel.close()
