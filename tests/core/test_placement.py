"""Placement: own host, then a group's earlier members, then most free; striping — exact segment ids."""

from __future__ import annotations

from kvpool.core.pool.allocator import SegmentAllocator
from kvpool.core.pool.placement import batch_orders, group_first, placement_order
from kvpool.core.pool.index import IndexSettings, PoolIndex
from kvpool.core.pool.records import PutRequestItem, Segment

KB = 1024


def segment(segment_id: str, host: str, size: int = 100 * KB, used: int = 0) -> Segment:
    allocator = SegmentAllocator(size, alignment=1)
    if used:
        allocator.allocate(used)
    return Segment(segment_id, "127.0.0.1:1", host, 0, 0x1000, size, allocator, 0.0)


def ids(order: list[Segment]) -> list[str]:
    return [s.segment_id for s in order]


def test_group_first_after_the_writers_own_host() -> None:
    segments = [segment("a0", "hostA"), segment("a1", "hostA", used=KB), segment("b0", "hostB", used=2 * KB)]
    order = placement_order(segments, "hostA")
    assert ids(order) == ["a0", "a1", "b0"]
    assert ids(group_first(order, {"a1"}, "hostA")) == ["a1", "a0", "b0"]
    # the group's segment on another host does not beat the writer's own host
    assert ids(group_first(order, {"b0"}, "hostA")) == ["a0", "a1", "b0"]
    # a writer with no segment of its own: the group's segment first, the rest in order
    assert ids(group_first(placement_order(segments, "hostX"), {"b0"}, "hostX")) == ["b0", "a0", "a1"]
    assert group_first(order, set(), "hostA") is order


def test_striping_rotates_first_members_and_later_members_follow_them() -> None:
    index = PoolIndex(IndexSettings(alignment=1, stripe_min_bytes=4 * KB))
    for i in range(2):
        index.mount_segment(f"s{i}", f"127.0.0.1:{9000 + i}", "hostA", 0x10000000 * (i + 1), 100 * KB)
    # stage 0's batch: four new groups, striped over both segments
    stage0 = index.put_start("hostA", [PutRequestItem(f"g{c}/0", f"g{c}", 2, KB) for c in range(4)])
    assert [o.segment.segment_id for o in stage0] == ["s0", "s1", "s0", "s1"]
    # stage 1's batch: each member joins its group, still spread over both segments
    stage1 = index.put_start("hostA", [PutRequestItem(f"g{c}/1", f"g{c}", 2, KB) for c in range(4)])
    assert [o.segment.segment_id for o in stage1] == ["s0", "s1", "s0", "s1"]


def test_a_full_group_segment_spills_to_the_next() -> None:
    index = PoolIndex(IndexSettings(alignment=1, high_watermark=1.0, low_watermark=1.0))
    index.mount_segment("s0", "127.0.0.1:9000", "hostA", 0x10000000, 4 * KB)
    index.mount_segment("s1", "127.0.0.1:9001", "hostA", 0x20000000, 8 * KB)
    assert index.put_start("hostA", [PutRequestItem("g/0", "g", 3, 2 * KB)])[0].segment.segment_id == "s1"
    assert index.put_start("hostA", [PutRequestItem("f/0", "f", 1, 5 * KB)])[0].segment.segment_id == "s1"
    # s1 has 1 KB left: g/1 (2 KB) goes to s0 after all
    assert index.put_start("hostA", [PutRequestItem("g/1", "g", 3, 2 * KB)])[0].segment.segment_id == "s0"
    # both hold members of g now: the one with more room (s0, 2 KB) first; then only s1 has room
    assert index.put_start("hostA", [PutRequestItem("g/2", "g", 3, KB)])[0].segment.segment_id == "s0"
    assert index.put_start("hostA", [PutRequestItem("h/0", "h", 2, KB)])[0].segment.segment_id == "s0"
    assert index.put_start("hostA", [PutRequestItem("h/1", "h", 2, KB)])[0].segment.segment_id == "s1"


def test_losing_one_of_two_stores_loses_half_the_groups() -> None:
    # four stages save 64 chunks in batches of 8, each stage on its own; then store s1 dies
    index = PoolIndex(IndexSettings(alignment=1, stripe_min_bytes=8 * KB))
    for i in range(2):
        index.mount_segment(f"s{i}", f"127.0.0.1:{9000 + i}", "hostA", 0x10000000 * (i + 1), 1024 * KB)
    for first in range(0, 64, 8):
        for stage in range(4):
            items = [PutRequestItem(f"c{c}/{stage}", f"c{c}", 4, KB) for c in range(first, first + 8)]
            index.put_end([(i.key, 1) for i in items if index.put_start("hostA", [i])[0].segment])
    assert sum(g.complete for g in index.groups.values()) == 64
    index.unmount_segment("s1")
    assert sum(g.complete for g in index.groups.values()) == 32
    assert batch_orders([], "hostA", 0, 1) == [[]]
