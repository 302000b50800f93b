"""A decode shard's room ledger (``ShardRoom``): exact holds, refusals naming the give-back count, rings."""

from __future__ import annotations

import pytest

from kvpool.core.admission.room import ShardShape
from kvpool.core.decode.regions import REGION_ALIGNMENT
from kvpool.core.decode.scheduler import DecodeScheduler
from kvpool.core.decode.shard_room import ShardRoom
from kvpool.core.errors import InvalidArgument


def pages_only(num_pages: int = 10) -> ShardRoom:
    return ShardRoom(DecodeScheduler(num_pages, 1, 8, 1000, lambda: 0.0))


def test_a_request_holds_its_whole_lifes_pages_until_its_end() -> None:
    room = pages_only()
    assert room.reserve("a", 4, 3) is None  # 4 + 3 - 1 = 6 pages
    assert room.scheduler.num_pages_used == 6 and room.num_held == 1
    assert room.end("a") is False  # nobody was refused: nothing rings
    assert room.scheduler.num_pages_used == 0 and room.num_held == 0 and room.epoch == 1
    assert room.end("a") is False and room.epoch == 1  # a second end gives nothing back


def test_a_refusal_names_the_give_backs_so_far_and_the_next_give_back_rings_once() -> None:
    room = pages_only()
    assert room.reserve("a", 4, 3) is None  # 6 of 10 pages
    assert room.reserve("b", 4, 2) == 0  # needs 5: refused, naming epoch 0; nothing taken
    assert room.scheduler.num_pages_used == 6 and room.num_held == 1
    assert room.reserve("c", 2, 3) is None  # 4 pages: fits (10 of 10)
    assert room.end("c") is True  # the first give-back after the refusal rings
    assert room.epoch == 1
    assert room.end("a") is False  # rung already: no refusal waits
    assert room.epoch == 2
    assert room.reserve("b", 4, 2) is None


def test_with_an_arena_a_request_holds_a_region_too_and_both_go_back() -> None:
    shape = ShardShape(num_pages=10 * REGION_ALIGNMENT, page_size=1, arena_bytes=2 * REGION_ALIGNMENT,
                       region_bytes_per_token=1, region_trailer_bytes=0, max_context=10 * REGION_ALIGNMENT)
    room = ShardRoom(DecodeScheduler(shape.num_pages, 1, 8, shape.max_context, lambda: 0.0), shape)
    assert room.reserve("a", REGION_ALIGNMENT, 1) is None
    assert room.reserve("b", REGION_ALIGNMENT, 1) is None
    assert room.reserve("c", 10, 1) == 0  # the arena is full though pages are free: refused, no pages taken
    assert room.scheduler.num_pages_used == 2 * REGION_ALIGNMENT and room.regions is not None
    assert room.regions.num_regions == 2
    assert room.end("a") is True
    assert room.regions.num_regions == 1 and room.scheduler.num_pages_used == REGION_ALIGNMENT


def test_a_request_that_could_never_fit_is_an_error_not_a_refusal() -> None:
    with pytest.raises(InvalidArgument):
        pages_only().reserve("a", 8, 5)  # 12 pages of 10


def test_the_decode_shards_way_its_own_region_table_layout_and_bell_both_or_neither() -> None:
    """As services/decode/shard.py runs it: its own region table (a clock, deadlines), a real layout, a region
    without pages (``max_tokens`` 0) and one with them (``region-N``), a give-back with a writer's grace, and the
    give-back count reported to the shard's bell."""
    from kvpool.core.decode.regions import RegionTable
    from kvpool.core.decode.room_epoch import Held, RoomEpoch
    from kvpool.core.errors import ResourceExhausted
    from kvpool.core.handoff.layout import HandoffLayout

    class Bell(RoomEpoch):
        def __init__(self) -> None:
            super().__init__()
            self.rings = 0

        def observe(self, held: Held) -> bool:
            rang = super().observe(held)
            self.rings += rang
            return rang

    now = [0.0]
    regions = RegionTable(2 * REGION_ALIGNMENT, 60.0, lambda: now[0])
    bell = Bell()
    room = ShardRoom(DecodeScheduler(10, 1, 8, 1000, lambda: 0.0), regions=regions, room=bell)
    layout = HandoffLayout.of(4, [(0, 1)], REGION_ALIGNMENT // 4)  # one aligned region
    bare = room.hold(4, 0, layout=layout)
    assert bare is not None and bare.seq_id == "" and room.scheduler.num_pages_used == 0
    full = room.hold(4, 3, layout=layout, hold_s=5.0)
    assert full is not None and full.seq_id == f"region-{full.region_id}" and room.scheduler.num_pages_used == 6
    assert full.deadline == 5.0
    with pytest.raises(ResourceExhausted):  # the arena is full: nothing held
        room.hold(1, 1, layout=HandoffLayout.of(1, [(0, 1)], 1))
    assert room.scheduler.num_pages_used == 6 and regions.num_regions == 2
    assert room.room.refused() == 0  # the shard's NoRoomNow names the give-backs so far
    assert room.release(full, grace_s=1.0) is True and bell.rings == 1  # its pages back at once: it rings
    assert room.scheduler.num_pages_used == 0 and regions.num_regions == 1 and regions.num_draining == 1
    assert room.release(full) is False and bell.epoch == 1  # again: nothing more comes back
    assert room.release(bare) is False and bell.epoch == 2  # its bytes come back; no refusal waits for them
    assert regions.num_regions == 0 and bell.rings == 1
