"""Handoff layout and transfer plan: exact offsets and write counts."""

from __future__ import annotations

import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.core.handoff.layout import (
    MAX_TRANSFER_BYTES,
    HandoffLayout,
    RangeTransfer,
    Transfer,
    num_naive_writes,
    range_transfers,
    transfer_plan,
)


def test_the_seeds_example_is_12_writes_instead_of_163840() -> None:
    layout = HandoffLayout.of(8192, [(0, 20)], 576)
    assert layout.nbytes == 94_371_840
    plan = layout.transfers(0)
    assert len(plan) == 12
    assert plan[0] == Transfer(0, MAX_TRANSFER_BYTES)
    assert plan[-1] == Transfer(11 * MAX_TRANSFER_BYTES, 94_371_840 - 11 * MAX_TRANSFER_BYTES)
    assert sum(t.length for t in plan) == layout.nbytes
    assert num_naive_writes(8192, 20) == 163_840


def test_offsets_are_stage_slabs_back_to_back_layer_major() -> None:
    layout = HandoffLayout.of(num_tokens=10, layer_split=[(0, 2), (2, 5)], entry_bytes=8)
    assert [layout.stage_nbytes(k) for k in range(2)] == [160, 240]
    assert [layout.stage_offset(k) for k in range(2)] == [0, 160]
    assert layout.offset(0, 0) == 0
    assert layout.offset(0, 9) == 72
    assert layout.offset(1, 0) == 80
    assert layout.offset(2, 0) == 160
    assert layout.offset(4, 9) == 160 + (2 * 10 + 9) * 8 == 392
    assert layout.nbytes == 400
    # every (layer, token) has its own place
    places = {layout.offset(layer, t) for layer in range(5) for t in range(10)}
    assert len(places) == 50 and max(places) == 392


def test_transfer_plan_edges() -> None:
    assert transfer_plan(0) == []
    assert transfer_plan(10, 4) == [Transfer(0, 4), Transfer(4, 4), Transfer(8, 2)]
    assert transfer_plan(8, 4) == [Transfer(0, 4), Transfer(4, 4)]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((0, [(0, 2)], 8), "num_tokens"),
        ((4, [(0, 2)], 0), "entry_bytes"),
        ((4, [], 8), "layer_split"),
        ((4, [(0, 2), (3, 5)], 8), r"layer_split\[1\]"),
        ((4, [(1, 2)], 8), r"layer_split\[0\]"),
    ],
)
def test_bad_layouts_name_the_field(args: tuple, field: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidArgument, match=f"^{field}"):
        HandoffLayout.of(*args)


def test_out_of_range_lookups() -> None:
    layout = HandoffLayout.of(4, [(0, 2)], 8)
    with pytest.raises(InvalidArgument, match="^layer"):
        layout.offset(2, 0)
    with pytest.raises(InvalidArgument, match="^token"):
        layout.offset(0, 4)
    with pytest.raises(InvalidArgument, match="^stage"):
        layout.stage_nbytes(1)


def test_a_token_range_is_one_write_per_layer_at_the_layouts_offsets() -> None:
    layout = HandoffLayout.of(num_tokens=10, layer_split=[(0, 2), (2, 5)], entry_bytes=8)
    # stage 1, tokens [4, 7): three layers, each a 24-byte run; slab layer-major
    assert range_transfers(layout, 1, 4, 7) == [
        RangeTransfer(0, 160 + 4 * 8, 24), RangeTransfer(24, 160 + (10 + 4) * 8, 24),
        RangeTransfer(48, 160 + (20 + 4) * 8, 24)]
    assert range_transfers(layout, 1, 4, 7)[2].region_offset == layout.offset(4, 4)
    # a run past the cap is cut: 10 tokens of 8 bytes at 32 bytes a write
    assert range_transfers(layout, 0, 0, 10, 32) == [
        RangeTransfer(0, 0, 32), RangeTransfer(32, 32, 32), RangeTransfer(64, 64, 16),
        RangeTransfer(80, 80, 32), RangeTransfer(112, 112, 32), RangeTransfer(144, 144, 16)]


def test_a_16k_stage_of_dsv3_streams_in_2048_token_ranges_of_one_write_per_layer() -> None:
    layout = HandoffLayout.of(16384, [(0, 2), (2, 4), (4, 6), (6, 8)], 576)
    ranges = [range_transfers(layout, 3, start, start + 2048) for start in range(0, 16384, 2048)]
    assert [len(r) for r in ranges] == [2] * 8  # 1.2 MB runs: each under 8 MiB
    assert sum(t.length for r in ranges for t in r) == layout.stage_nbytes(3)


@pytest.mark.parametrize(("start", "end"), [(0, 0), (-1, 3), (5, 11), (7, 3)])
def test_a_bad_token_range_is_refused(start: int, end: int) -> None:
    layout = HandoffLayout.of(10, [(0, 2)], 8)
    with pytest.raises(InvalidArgument, match="^token range"):
        range_transfers(layout, 0, start, end)
