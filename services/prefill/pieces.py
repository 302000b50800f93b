"""A request's hidden states between two stages, in pieces, so the stages overlap (``ForwardPieces``).

A stage computes a request in pieces (``--forward-piece-tokens``). Each piece
goes to the next stage as soon as it ends, while this stage computes the next
one, so a long prompt's four stages run at once instead of one after another
(the flow the simulator's stages assume: kvpool/tools/sim/stages.py).

The sending side is the next stage's client (``kvpool.services.prefill.stage_client``);
``ActivationLink`` packs each piece for it: inline when small, else in the send arena, which
the link offers as shared memory (a ``SegmentShare`` in ``--shared-memory-dir``) when the
arena is one. The activation names the sender's declared host, its shared arena and its
engine's endpoint ("" without an engine).

The receiving side takes the path the core decides (``activation_path``): on the sender's
declared host it maps the sender's arena once (``SegmentMaps``) and copies the bytes into the
piece's tensor; on another host, or when the arena's socket is out of this process's reach
(``OutOfReach``), it reads them with the transfer engine into its receive arena. A move that
needs an engine one side lacks fails UNAVAILABLE naming the activation. Bytes are counted per
path (``kvpool_prefill_activation_bytes_total{path}``: inline, memory, engine).

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

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch
from prometheus_client import Counter

from kvpool.core.errors import InvalidArgument, Unavailable
from kvpool.core.pool.paths import BytePath, SharedMemoryRef
from kvpool.core.prefill.stage_forward import SEND_ARENA, Activation, Piece, StageForward, activation_path, check_piece
from kvpool.services.prefill.stage_client import NextStageClient, PieceSender
from kvpool.shared_memory import OutOfReach, SegmentMaps, SegmentShare, SharedMemoryUnavailable, SharedSegment, copy
from kvpool.transfer import TransferError, local_host_name

log = structlog.get_logger(__name__)

ARENA_WAIT_S = 30.0  # a piece waits this long for room in an arena before the request fails

if TYPE_CHECKING:
    from kvpool.services.prefill.arena import Region
    from kvpool.services.prefill.stage_runner import StageRestore, StageRunner


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
    """Sends hidden states to the next stage and receives them from the previous one (module doc)."""

    def __init__(self, runner: StageRunner, next_address: str) -> None:
        self.runner = runner
        self.stage = runner.settings.stage
        self.hidden_size = runner.config.hidden_size
        self.next = NextStageClient(next_address, self.stage + 1) if next_address else None
        self.host_name = local_host_name()
        self.maps = SegmentMaps()  # the previous stage's send arena, mapped once
        self.share: SegmentShare | None = None
        self.shared: SharedMemoryRef | None = None  # the send arena as the next stage maps it, once offered
        self.path_bytes = Counter(
            "kvpool_prefill_activation_bytes", "Hidden-state bytes this stage received from the previous one, by "
            "path (inline: inside the RPC; memory: copied from its shared send arena; engine: transfer engine)",
            ["path"], registry=runner.metrics.registry)
        for path in ("inline", *(p.value for p in BytePath)):
            self.path_bytes.labels(path)

    async def start(self) -> None:
        """Offer the send arena as shared memory, when it is one and a next stage will read it."""
        arena = self.runner.send_arena.buffer
        if self.next is None or not isinstance(arena, SharedSegment):
            return
        share = SegmentShare(Path(self.runner.settings.shared_memory_dir),
                             f"prefill-stage{self.stage}-{arena.token[:16]}")
        share.add(SEND_ARENA, arena)
        socket_path = await share.start()
        self.share = share
        self.shared = SharedMemoryRef(str(socket_path), SEND_ARENA, arena.token)
        log.info("shared_memory_offered", socket=str(socket_path), segment=SEND_ARENA, host=self.host_name)

    async def close(self) -> None:
        if self.next is not None:
            await self.next.close()
        if self.share is not None:
            await self.share.close()
        await self.maps.close()

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
            self.path_bytes.labels("inline").inc(nbytes)
            return torch.frombuffer(bytearray(activation.inline), dtype=torch.float32).view(num_new, self.hidden_size)
        if activation.size != nbytes:
            raise InvalidArgument(f"activation.size: {activation.size} bytes, expected {nbytes}")
        data = None
        if activation_path(activation, self.host_name) is BytePath.MEMORY:
            data = await self.copy(activation, nbytes)
        path = BytePath.ENGINE if data is None else BytePath.MEMORY
        if data is None:
            data = await self.read(activation, nbytes)
        self.path_bytes.labels(path.value).inc(nbytes)
        return data.view(torch.float32).view(num_new, self.hidden_size)

    async def copy(self, activation: Activation, nbytes: int) -> torch.Tensor | None:
        """The bytes, copied from the previous stage's shared send arena; None when its socket is out of this
        process's reach (the engine may still reach the arena)."""
        shared = activation.shared
        assert shared is not None  # activation_path chose memory
        try:
            mapped = await self.maps.map(shared.socket_path, shared.name, shared.token)
        except OutOfReach as exc:
            log.info("activation_arena_out_of_reach", socket=shared.socket_path, reason=str(exc))
            return None
        except SharedMemoryUnavailable as exc:  # the previous stage died or restarted
            raise Unavailable(f"activation.shared_memory: mapping stage {self.stage - 1}'s send arena at "
                              f"{shared.socket_path} failed: {exc}") from None
        offset = activation.shared_offset
        if not 0 <= offset <= mapped.size - nbytes:
            raise InvalidArgument(f"activation.address: [{offset}, {offset + nbytes}) is outside stage "
                                  f"{self.stage - 1}'s send arena of {mapped.size} bytes")
        data = torch.empty(nbytes, dtype=torch.uint8)

        def copy_out() -> None:
            with mapped.using():  # pinned: the arena stays mapped while this reads it, even if its owner dies
                copy(data.data_ptr(), mapped.address + offset, nbytes)

        try:
            await asyncio.to_thread(copy_out)
        except SharedMemoryUnavailable as exc:  # forgotten before the copy began: the previous stage went away
            raise Unavailable(f"activation.shared_memory: stage {self.stage - 1}'s send arena at "
                              f"{shared.socket_path} went away: {exc}") from None
        return data

    async def read(self, activation: Activation, nbytes: int) -> torch.Tensor:
        """The bytes, read with the transfer engine into the receive arena and copied out."""
        engine, arena = self.runner.engine, self.runner.recv_arena
        if engine is None or arena is None:
            raise Unavailable(f"activation.host: hidden states on host {activation.host or '(not declared)'} need "
                              f"the transfer engine, and stage {self.stage} on {self.host_name} runs without one "
                              f"(--no-transfer-engine)")
        if not activation.endpoint:
            raise Unavailable(f"activation.endpoint: stage {self.stage - 1} on {activation.host or '(not declared)'} "
                              f"runs without a transfer engine, and its send arena is not shared memory on "
                              f"{self.host_name}")
        region = await arena.allocate_wait(nbytes, ARENA_WAIT_S)
        try:
            await engine.read(activation.endpoint, [region.address], [activation.address], [nbytes])
            return arena.tensor(region).clone()
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
        engine = self.runner.engine
        return Activation(num_tokens=n, hidden_size=self.hidden_size, endpoint=engine.endpoint if engine else "",
                          address=region.address, size=data.numel(), host=self.host_name, shared=self.shared,
                          shared_base_address=arena.buffer.address if self.shared is not None else 0)

    def open(self, forward: StageForward, timeout_s: float, restores: Sequence[StageRestore] = ()) -> PieceSender:
        """A stream of ``forward``'s pieces to the next stage, ending within ``timeout_s``; ``restores`` (the next
        stage's and every later one's) go first, before any piece."""
        assert self.next is not None
        return self.next.open(forward, timeout_s, self.activation, self.runner.send_arena.free, restores)
