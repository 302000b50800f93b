"""A request's hidden states between two stages, in pieces, so the stages overlap (``ForwardPieces``).

A stage computes a request in pieces (``--forward-piece-tokens``). Each piece
goes to the next stage as soon as it ends, while this stage computes the next
one, so a long prompt's four stages run at once instead of one after another
(the flow the simulator's stages assume: kvpool/tools/sim/stages.py).

The sending side is the next stage's client (``kvpool.services.prefill.stage_client``);
``ActivationLink`` packs each piece for it (inline when small, else in the send
arena for the next stage to read).

The receiving side (``received_pieces``): every piece is checked against the
request (same request, the pieces contiguous and in order, the last ending at
``num_tokens``, nothing after it: ``kvpool.core.prefill.stage_forward.check_piece``)
and answered INVALID_ARGUMENT naming the field otherwise; a stream that ends
before the last piece is refused the same way, so a stage never saves or hands
off a prompt it did not wholly compute.

Invariants: pieces are computed and forwarded in token order; the send
arena's regions of a request stay until its call ended (the next stage may
still be reading them); a failure anywhere ends the call both ways.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import torch

from kvpool.core.errors import InvalidArgument, Unavailable
from kvpool.core.prefill.stage_forward import Activation, Piece, StageForward, check_piece
from kvpool.services.prefill.stage_client import NextStageClient, PieceSender
from kvpool.transfer import TransferError

ARENA_WAIT_S = 30.0  # a piece waits this long for room in an arena before the request fails

if TYPE_CHECKING:
    from kvpool.services.prefill.arena import Region
    from kvpool.services.prefill.stage_runner import StageRunner


async def received_pieces(
    forward: StageForward, first: Piece, rest: AsyncIterator[Piece], link: ActivationLink,
) -> AsyncIterator[tuple[Piece, torch.Tensor]]:
    """Each piece of ``forward``'s stream (``first``, then ``rest``) and its hidden states, checked
    (module doc)."""
    piece, end = first, forward.compute_start
    while True:
        check_piece(forward, piece, end)
        hidden = await link.receive(piece.activation, piece.end - piece.start)
        link.runner.metrics.pieces_received.inc()
        yield piece, hidden
        end = piece.end
        nxt = await anext(rest, None)
        if end == forward.num_tokens:
            if nxt is not None:
                raise InvalidArgument(f"piece_start: {nxt.start}, a piece after the last "
                                      f"(which ended at num_tokens {end})")
            return
        if nxt is None:
            raise InvalidArgument(f"piece_end: the stream ended at token {end} of {forward.num_tokens}")
        piece = nxt


class ActivationLink:
    """Sends hidden states to the next stage and receives them from the previous one."""

    def __init__(self, runner: StageRunner, next_address: str) -> None:
        self.runner = runner
        self.hidden_size = runner.config.hidden_size
        self.next = NextStageClient(next_address, runner.settings.stage + 1) if next_address else None

    async def close(self) -> None:
        if self.next is not None:
            await self.next.close()

    async def receive(self, activation: Activation, num_new: int) -> torch.Tensor:
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

    async def activation(self, hidden: torch.Tensor, regions: list[Region]) -> Activation:
        """``hidden`` as the next stage gets it: inline when small, else copied into a send-arena region
        (appended to ``regions``; the caller frees it once the next stage has read it)."""
        n = hidden.shape[0]
        data = hidden.contiguous().view(torch.uint8).view(-1)
        if data.numel() <= self.runner.settings.inline_activation_bytes:
            return Activation(num_tokens=n, hidden_size=self.hidden_size, inline=data.numpy().tobytes())
        arena = self.runner.send_arena
        region = await arena.allocate_wait(data.numel(), ARENA_WAIT_S)
        regions.append(region)
        arena.tensor(region).copy_(data)
        return Activation(num_tokens=n, hidden_size=self.hidden_size, endpoint=self.runner.engine.endpoint,
                          address=region.address, size=data.numel())

    def open(self, forward: StageForward, timeout_s: float) -> PieceSender:
        """A stream of ``forward``'s pieces to the next stage, ending within ``timeout_s``."""
        assert self.next is not None
        return self.next.open(forward, timeout_s, self.activation, self.runner.send_arena.free)
