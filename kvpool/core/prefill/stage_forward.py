"""One request's forward through the stages, as every stage is told it, and the rules it must keep.

A forward goes whole (``Forward``) or in pieces (``ForwardPieces``: each piece's hidden states
as soon as the stage before computed them). ``StageForward`` is the request, ``Piece`` one
piece of its hidden states, ``Activation`` where those states are (inline, or in the sender's
send arena), ``StageForwardResult`` what the chain answers.

An activation in the send arena moves as a pool object does (``kvpool.core.pool.paths``): a receiver on
the sender's declared host, with the arena offered as shared memory, maps the arena and copies
(``activation_path``: memory); any other reads it with the transfer engine at ``endpoint``.

Pure: no protobuf, no I/O. The stage servicer and the next-stage client convert the messages
(``kvpool.services.prefill.stage_servicer``, ``kvpool.services.prefill.stage_client``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.core.errors import InvalidArgument
from kvpool.core.handoff.target import HandoffTarget, StageHandoffFigures
from kvpool.core.prefill.restore_figures import StageRestoreFigures
from kvpool.core.pool.paths import BytePath, SegmentAccess, SharedMemoryRef, byte_path

SEND_ARENA = "send-arena"  # the segment an activation's bytes lie in, as the path decision names it


@dataclass(frozen=True, slots=True)
class StageForward:
    """A request's forward: tokens [compute_start, num_tokens) are computed, the rest are cached."""

    request_id: str
    num_tokens: int
    compute_start: int
    block_table: tuple[int, ...]
    # the full chunks this request completes, saved to the pool after compute:
    # chunk indexes [save_first_chunk, save_first_chunk + len(save_chunk_hashes))
    save_first_chunk: int = 0
    save_chunk_hashes: tuple[str, ...] = ()
    return_logits: bool = False
    tenant: str = ""  # the stage's puts carry it to the pool master
    target: HandoffTarget | None = None  # decode's region: each stage writes its layers into it
    # put nothing: stage 0 reserves every stage's objects of the save in one call, and tells each stage
    # where to write its own (SaveDone)
    save_when_told: bool = False

    def check(self, num_blocks: int, chunk_size: int) -> None:
        """What every forward must hold, whole or in pieces: some tokens to compute, a block per chunk."""
        if self.num_tokens - self.compute_start <= 0:
            raise InvalidArgument(f"compute_start: {self.compute_start} is not below num_tokens {self.num_tokens}")
        needed = -(-self.num_tokens // chunk_size)
        if len(self.block_table) != needed or any(not 0 <= b < num_blocks for b in self.block_table):
            raise InvalidArgument(f"block_table: needs {needed} block ids in 0..{num_blocks - 1}")


@dataclass(frozen=True, slots=True)
class Activation:
    """Hidden states of ``num_tokens`` tokens: ``inline``, or ``size`` bytes at ``address`` in the
    sender's send arena, which the transfer engine at ``endpoint`` reaches ("": the sender has none) and,
    on the sender's declared ``host``, its shared memory ``shared`` (whose first byte is at
    ``shared_base_address`` in the sender's address space)."""

    num_tokens: int
    hidden_size: int
    inline: bytes = b""
    endpoint: str = ""
    address: int = 0
    size: int = 0
    host: str = ""  # the sender's declared host; "": unknown (the engine only)
    shared: SharedMemoryRef | None = None  # the send arena as shared memory; None: not offered
    shared_base_address: int = 0

    @property
    def access(self) -> SegmentAccess:
        """The sender's arena as the pool's path decision sees a segment."""
        return SegmentAccess(SEND_ARENA, self.host, self.shared_base_address, self.shared)

    @property
    def shared_offset(self) -> int:
        """Where the bytes start in the shared arena."""
        return self.access.offset(self.address)


def activation_path(activation: Activation, receiver_host: str) -> BytePath:
    """How a receiver on ``receiver_host`` gets an activation that is not inline (module doc)."""
    return byte_path(activation.access, receiver_host)


@dataclass(frozen=True, slots=True)
class Piece:
    """Tokens [start, end) of a request's hidden states; each piece repeats which request it belongs to
    (``request_id``, ``num_tokens``, ``compute_start``). A whole ``Forward`` has ``start == end == 0``."""

    request_id: str
    num_tokens: int
    compute_start: int
    start: int
    end: int
    activation: Activation


@dataclass(slots=True)
class StageForwardResult:
    """The chain's answer: the last stage's first token (and logits, when asked), each stage's compute
    time and (with a target) handoff figures in stage order."""

    first_token: int = 0
    logits: bytes = b""
    stage_compute_ms: list[float] = field(default_factory=list)
    # with a target: each stage's handoff writes, in stage order, once they ended
    handoff_stages: list[StageHandoffFigures] = field(default_factory=list)
    # with a restore on the chain: each later stage's restore, in stage order
    restore_stages: list[StageRestoreFigures] = field(default_factory=list)


def check_piece(first: StageForward, piece: Piece, start: int) -> None:
    """``piece`` must continue ``first``'s request at token ``start``."""
    if piece.request_id != first.request_id:
        raise InvalidArgument(f"request_id: a piece of {piece.request_id!r} in the stream of {first.request_id!r}")
    if piece.num_tokens != first.num_tokens or piece.compute_start != first.compute_start:
        raise InvalidArgument(f"num_tokens: a piece says {piece.compute_start}..{piece.num_tokens}, the request "
                              f"{first.compute_start}..{first.num_tokens}")
    if piece.start != start:
        raise InvalidArgument(f"piece_start: {piece.start}, the pieces so far end at {start}")
    if not start < piece.end <= first.num_tokens:
        raise InvalidArgument(f"piece_end: {piece.end} is not in {start + 1}..{first.num_tokens}")
