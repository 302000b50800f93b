"""The rules a stream of forward pieces must keep (``kvpool.core.prefill.stage_forward``), piece by piece."""

from __future__ import annotations

import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.core.prefill.stage_forward import Activation, Piece, StageForward, check_piece


def piece(start: int, end: int, request_id: str = "r", num_tokens: int = 600, compute_start: int = 100) -> Piece:
    return Piece(request_id=request_id, num_tokens=num_tokens, compute_start=compute_start, start=start, end=end,
                 activation=Activation(end - start, 8))


def request_of(first: Piece) -> StageForward:
    """The request the stream's first piece came with."""
    return StageForward(request_id=first.request_id, num_tokens=first.num_tokens,
                        compute_start=first.compute_start, block_table=(0, 1, 2))


def check_forward(first: Piece, num_blocks: int, chunk_size: int) -> None:
    request_of(first).check(num_blocks, chunk_size)


def refused(first: Piece, message: Piece, start: int) -> str:
    with pytest.raises(InvalidArgument) as info:
        check_piece(request_of(first), message, start)
    return f"{info.value.field}: {info.value}"


def test_contiguous_pieces_in_order_up_to_num_tokens_pass() -> None:
    first = piece(100, 256)
    for message, start in ((first, 100), (piece(256, 512), 256), (piece(512, 600), 512), (piece(100, 600), 100)):
        check_piece(request_of(first), message, start)


def test_each_broken_rule_names_its_field() -> None:
    first = piece(100, 256)
    assert refused(first, piece(256, 512, request_id="other"), 256).startswith("request_id: ")
    assert refused(first, piece(256, 512, num_tokens=700), 256).startswith("num_tokens: ")
    assert refused(first, piece(256, 512, compute_start=0), 256).startswith("num_tokens: ")
    assert refused(first, piece(300, 512), 256).startswith("piece_start: ")  # a gap
    assert refused(first, piece(200, 512), 256).startswith("piece_start: ")  # an overlap
    assert refused(first, piece(256, 256), 256).startswith("piece_end: ")  # empty
    assert refused(first, piece(256, 601), 256).startswith("piece_end: ")  # past num_tokens
    assert refused(piece(0, 256), piece(0, 256), 100).startswith("piece_start: ")  # not at compute_start


def test_a_forward_needs_tokens_to_compute_and_a_block_per_chunk() -> None:
    check_forward(piece(100, 600), num_blocks=8, chunk_size=256)
    with pytest.raises(InvalidArgument, match="^compute_start: "):
        check_forward(piece(100, 600, compute_start=600), num_blocks=8, chunk_size=256)
    with pytest.raises(InvalidArgument, match="^block_table: needs 3 block ids in 0..1$"):
        check_forward(piece(100, 600), num_blocks=2, chunk_size=256)
    with pytest.raises(InvalidArgument, match="^block_table: needs 2 block ids"):
        check_forward(piece(100, 600), num_blocks=8, chunk_size=512)
