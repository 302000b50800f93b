"""A request's hidden states between two stages, in pieces, so the stages overlap (``ForwardPieces``).

A stage computes a request in pieces (``--forward-piece-tokens``). Each piece
goes to the next stage as soon as it ends, while this stage computes the next
one, so a long prompt's four stages run at once instead of one after another
(the flow the simulator's stages assume: kvpool/tools/sim/stages.py).

The sending side (``PieceSender``): one client-streaming call per request and
stage. ``send`` only queues; a writer task puts each piece in the message
(inline when small, else in the send arena for the next stage to read) and
writes it, so a slow reader never stalls this stage's compute. ``finish`` ends
the stream and returns the next stage's answer, the chain's; ``abort`` cancels
the call, so the next stage stops waiting for pieces that will not come.

The receiving side (``received_pieces``): every message is checked against
the first (same request, the pieces contiguous and in order, the last ending at
``num_tokens``, nothing after it) and answered INVALID_ARGUMENT naming the field
otherwise; a stream that ends before the last piece is refused the same way,
so a stage never saves or hands off a prompt it did not wholly compute.

Invariants: pieces are computed and forwarded in token order; the send
arena's regions of a request stay until its call ended (the next stage may
still be reading them); a failure anywhere ends the call both ways.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
import torch

from kvpool import service
from kvpool.core.errors import DeviceCacheLost, InvalidArgument, Unavailable
from kvpool.rpc import prefill_pb2, prefill_pb2_grpc
from kvpool.status import error_kind
from kvpool.transfer import TransferError

ARENA_WAIT_S = 30.0  # a piece waits this long for room in an arena before the request fails

if TYPE_CHECKING:
    from kvpool.services.prefill.arena import Region
    from kvpool.services.prefill.stage_runner import StageRunner


def check_forward(request: prefill_pb2.ForwardRequest, num_blocks: int, chunk_size: int) -> None:
    """What every forward must hold, whole or in pieces: some tokens to compute, a block per chunk."""
    if request.num_tokens - request.compute_start <= 0:
        raise InvalidArgument(f"compute_start: {request.compute_start} is not below num_tokens {request.num_tokens}")
    needed = -(-request.num_tokens // chunk_size)
    block_table = request.block_table
    if len(block_table) != needed or any(not 0 <= b < num_blocks for b in block_table):
        raise InvalidArgument(f"block_table: needs {needed} block ids in 0..{num_blocks - 1}")


def check_piece(first: prefill_pb2.ForwardRequest, piece: prefill_pb2.ForwardRequest, start: int) -> None:
    """``piece`` must continue ``first``'s request at token ``start``."""
    if piece.request_id != first.request_id:
        raise InvalidArgument(f"request_id: a piece of {piece.request_id!r} in the stream of {first.request_id!r}")
    if piece.num_tokens != first.num_tokens or piece.compute_start != first.compute_start:
        raise InvalidArgument(f"num_tokens: a piece says {piece.compute_start}..{piece.num_tokens}, the request "
                              f"{first.compute_start}..{first.num_tokens}")
    if piece.piece_start != start:
        raise InvalidArgument(f"piece_start: {piece.piece_start}, the pieces so far end at {start}")
    if not start < piece.piece_end <= first.num_tokens:
        raise InvalidArgument(f"piece_end: {piece.piece_end} is not in {start + 1}..{first.num_tokens}")


async def received_pieces(
    first: prefill_pb2.ForwardRequest, rest: AsyncIterator[prefill_pb2.ForwardRequest], link: ActivationLink,
) -> AsyncIterator[tuple[prefill_pb2.ForwardRequest, torch.Tensor]]:
    """Each piece of the stream that began with ``first`` and its hidden states, checked (module doc)."""
    piece, end = first, first.compute_start
    while True:
        check_piece(first, piece, end)
        hidden = await link.receive(piece.activation, piece.piece_end - piece.piece_start)
        link.runner.metrics.pieces_received.inc()
        yield piece, hidden
        end = piece.piece_end
        nxt = await anext(rest, None)
        if end == first.num_tokens:
            if nxt is not None:
                raise InvalidArgument(f"piece_start: {nxt.piece_start}, a piece after the last "
                                      f"(which ended at num_tokens {end})")
            return
        if nxt is None:
            raise InvalidArgument(f"piece_end: the stream ended at token {end} of {first.num_tokens}")
        piece = nxt


def stage_error(exc: grpc.aio.AioRpcError, stage: int) -> Exception:
    """The next stage's failure as this stage's (a restarted stage's lost cache keeps its meaning)."""
    if error_kind(exc) is DeviceCacheLost:
        return DeviceCacheLost(exc.details() or "")
    return Unavailable(f"stage {stage}: {exc.code().name}: {exc.details()}")


class PieceSender:
    """One request's pieces to the next stage over one ``ForwardPieces`` call (module doc)."""

    def __init__(self, link: ActivationLink, request: prefill_pb2.ForwardRequest, timeout_s: float) -> None:
        assert link.next is not None
        self.link = link
        self.request = request
        self.next_stage = link.runner.settings.stage + 1
        self.call: Any = link.next.ForwardPieces(timeout=timeout_s)
        self._queue: asyncio.Queue[tuple[torch.Tensor, int, int] | None] = asyncio.Queue()
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
            hidden, start, end = item
            message = prefill_pb2.ForwardRequest()
            message.CopyFrom(self.request)
            message.activation.CopyFrom(await self.link.activation(hidden, self._regions))
            message.piece_start, message.piece_end = start, end
            await self.call.write(message)
        await self.call.done_writing()

    async def finish(self) -> prefill_pb2.ForwardResponse:
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
            return await self.call
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
            self.link.runner.send_arena.free(region)
        self._regions.clear()


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

    async def activation(self, hidden: torch.Tensor, regions: list[Region]) -> prefill_pb2.Activation:
        """``hidden`` as the next stage gets it: inline when small, else copied into a send-arena region
        (appended to ``regions``; the caller frees it once the next stage has read it)."""
        n = hidden.shape[0]
        data = hidden.contiguous().view(torch.uint8).view(-1)
        activation = prefill_pb2.Activation(num_tokens=n, hidden_size=self.hidden_size)
        if data.numel() <= self.runner.settings.inline_activation_bytes:
            activation.inline = data.numpy().tobytes()
            return activation
        arena = self.runner.send_arena
        region = await arena.allocate_wait(data.numel(), ARENA_WAIT_S)
        regions.append(region)
        arena.tensor(region).copy_(data)
        activation.endpoint = self.runner.engine.endpoint
        activation.address = region.address
        activation.size = data.numel()
        return activation

    def open(self, request: prefill_pb2.ForwardRequest, timeout_s: float) -> PieceSender:
        """A stream of ``request``'s pieces to the next stage, ending within ``timeout_s``."""
        return PieceSender(self, request, timeout_s)
