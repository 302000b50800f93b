"""PrefillStage servicer: restore, forward to the next stage, stage info.

Hidden states travel inline when small; otherwise the sender leaves them in
its registered send arena and the receiver reads them with the transfer
engine (one read) into its receive arena.
"""

from __future__ import annotations

import asyncio
import time
from contextvars import ContextVar
from typing import Any

import grpc
import structlog
import torch

from kvpool import service
from kvpool.core.errors import DeviceCacheLost, InvalidArgument, Unavailable
from kvpool.model.sampling import greedy_token
from kvpool.pool.client import ObjectLocation
from kvpool.rpc import handoff_pb2, prefill_pb2, prefill_pb2_grpc
from kvpool.status import error_kind, status_errors
from kvpool.transfer import TransferError
from services.prefill.handoff import StageHandoff
from services.prefill.stage_runner import ChunkToRestore, RestoreFigures, SaveFigures, StageRunner

log = structlog.get_logger(__name__)

ARENA_WAIT_S = 30.0
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


class ActivationLink:
    """Sends hidden states to the next stage and receives them from the previous one."""

    def __init__(self, runner: StageRunner, next_address: str) -> None:
        self.runner = runner
        self.hidden_size = runner.config.hidden_size
        self._channel = service.channel(next_address) if next_address else None
        self.next = prefill_pb2_grpc.PrefillStageStub(self._channel) if self._channel else None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def receive(self, activation: prefill_pb2.Activation, num_new: int) -> torch.Tensor:
        if activation.num_tokens != num_new or activation.hidden_size != self.hidden_size:
            raise InvalidArgument(
                f"activation: {activation.num_tokens}×{activation.hidden_size} hidden states, "
                f"expected {num_new}×{self.hidden_size}"
            )
        nbytes = num_new * self.hidden_size * 4
        if activation.inline:
            if len(activation.inline) != nbytes:
                raise InvalidArgument(f"activation.inline: {len(activation.inline)} bytes, expected {nbytes}")
            return torch.frombuffer(bytearray(activation.inline), dtype=torch.float32).view(num_new, self.hidden_size)
        if activation.size != nbytes:
            raise InvalidArgument(f"activation.size: {activation.size} bytes, expected {nbytes}")
        arena = self.runner.recv_arena
        region = await arena.allocate_wait(nbytes, ARENA_WAIT_S)
        try:
            await self.runner.engine.read(activation.endpoint, [region.address], [activation.address], [nbytes])
            return arena.tensor(region).view(torch.float32).view(num_new, self.hidden_size).clone()
        except TransferError as exc:
            raise Unavailable(f"activation: reading hidden states from {activation.endpoint} failed: {exc}") from exc
        finally:
            arena.free(region)

    async def send(self, hidden: torch.Tensor, request: prefill_pb2.ForwardRequest) -> prefill_pb2.ForwardResponse:
        """Forward to the next stage and return its (chained) answer."""
        assert self.next is not None
        n = hidden.shape[0]
        data = hidden.contiguous().view(torch.uint8).view(-1)
        activation = prefill_pb2.Activation(num_tokens=n, hidden_size=self.hidden_size)
        region = None
        arena = self.runner.send_arena
        if data.numel() <= self.runner.settings.inline_activation_bytes:
            activation.inline = data.numpy().tobytes()
        else:
            region = await arena.allocate_wait(data.numel(), ARENA_WAIT_S)
            arena.tensor(region).copy_(data)
            activation.endpoint = self.runner.engine.endpoint
            activation.address = region.address
            activation.size = data.numel()
        onward = prefill_pb2.ForwardRequest()
        onward.CopyFrom(request)
        onward.activation.CopyFrom(activation)
        try:
            return await self.next.Forward(onward, timeout=forward_timeout_s())
        except grpc.aio.AioRpcError as exc:
            if error_kind(exc) is DeviceCacheLost:
                raise DeviceCacheLost(exc.details() or "") from exc
            raise Unavailable(
                f"stage {self.runner.settings.stage + 1}: {exc.code().name}: {exc.details()}"
            ) from exc
        finally:
            if region is not None:
                arena.free(region)


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
        block_table = list(request.block_table)
        num_new = request.num_tokens - request.compute_start
        if num_new <= 0:
            raise InvalidArgument(f"compute_start: {request.compute_start} is not below num_tokens {request.num_tokens}")
        needed = -(-request.num_tokens // self.settings.chunk_size)
        if len(block_table) != needed or any(not 0 <= b < self.settings.num_blocks for b in block_table):
            raise InvalidArgument(f"block_table: needs {needed} block ids in 0..{self.settings.num_blocks - 1}")
        pending = self.restores.get(request.request_id)
        if pending is not None:
            await asyncio.wait([pending])  # its pages must hold the restored KV before we compute over them
        keep_deadline(context)
        task = asyncio.ensure_future(self._forward(request, num_new, block_table))
        self.forwards[request.request_id] = task
        task.add_done_callback(lambda _: self.forwards.pop(request.request_id, None))
        return await asyncio.shield(task)

    async def _forward(
        self, request: prefill_pb2.ForwardRequest, num_new: int, block_table: list[int]
    ) -> prefill_pb2.ForwardResponse:
        inputs = await self.link.receive(request.activation, num_new)
        return await run_stage(self.runner, self.link, request, inputs, block_table, self.handoff)

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
    runner: StageRunner, link: ActivationLink, request: prefill_pb2.ForwardRequest, inputs: torch.Tensor,
    block_table: list[int], handoff: StageHandoff,
) -> prefill_pb2.ForwardResponse:
    """Compute this stage, streaming its KV to decode as it becomes final, start saving, forward onward.

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
    t0 = time.perf_counter()
    out = await runner.forward(inputs, block_table, request.compute_start, writes.write if stream else None)
    compute_ms = (time.perf_counter() - t0) * 1e3
    if writes is not None:
        writes.forward_ended()
    # the put reads the pages in the background; stage 0 keeps those blocks until save_done
    runner.start_save(request.request_id, block_table, request.save_first_chunk, list(request.save_chunk_hashes),
                      request.tenant)
    if runner.model.is_last:
        last = out[-1]
        # the model's sampler picks among its output ids only; the logits go back as the model made them
        response = prefill_pb2.ForwardResponse(first_token=greedy_token(last, runner.config))
        logits = last.to(torch.float32).contiguous().numpy().tobytes()
        if request.return_logits:
            response.logits = logits
        if writes is not None:
            trailer = logits if request.target.layout.trailer_bytes else b""
            writes.write(0, 0 if stream else request.num_tokens, trailer)
    else:
        response = await link.send(out, request)
        if writes is not None and not stream:
            writes.write(0, request.num_tokens)  # every later stage has computed
    response.stage_compute_ms.insert(0, compute_ms)
    return response
