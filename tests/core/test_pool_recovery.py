"""Block reports and segment journals: what a restarted master gets back, exact values."""

from __future__ import annotations

import pytest

from kvpool.core.pool.allocator import Extent
from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.records import (
    ObjectRecord,
    PutRequestItem,
    PutStatus,
    SegmentChange,
)
from kvpool.core.pool.recovery import allocator_with_ranges
from tests.core.fixtures import KB, make_index, mount


def put(index: PoolIndex, host: str, key: str, group_id: str, group_size: int, size: int = KB) -> str:
    outcome = index.put_start(host, [PutRequestItem(key, group_id, group_size, size)])[0]
    assert outcome.status is PutStatus.RESERVED
    return outcome.segment.segment_id


def store_view(index: PoolIndex, segment_id: str) -> dict[str, ObjectRecord]:
    """What the segment's store holds after applying every change the master sends it."""
    held: dict[str, ObjectRecord] = {}
    changes, more = index.heartbeat(segment_id, 0)
    assert not more
    for change in changes:
        if change.added is not None:
            held[change.added.key] = change.added
        else:
            held.pop(change.removed_key, None)
    return held


def rec(key: str, group: str, group_size: int, offset: int, size: int = KB, checksum: int = 7) -> ObjectRecord:
    return ObjectRecord(key, group, group_size, offset, size, checksum)


def test_commits_and_removals_reach_the_store_in_order_and_acks_trim() -> None:
    index = make_index(segments=2, alignment=64)[0]
    put(index, "host0", "a/0", "a", 1)
    put(index, "host0", "b/0", "b", 1)
    assert index.heartbeat("seg0", 0) == ([], False)  # in flight: the store knows nothing yet
    index.put_end([("a/0", 11), ("b/0", 12)])
    changes, more = index.heartbeat("seg0", 0)
    assert changes == [
        SegmentChange(1, added=rec("a/0", "a", 1, 0, checksum=11)),
        SegmentChange(2, added=rec("b/0", "b", 1, KB, checksum=12)),
    ] and not more
    assert index.remove(["a"]) == (1, [])
    # the store applied 1 and 2: only the removal is left
    assert index.heartbeat("seg0", 2) == ([SegmentChange(3, removed_key="a/0")], False)
    assert (index.segments["seg0"].journal.sequence, index.segments["seg0"].journal.acked) == (3, 2)
    assert index.heartbeat("seg0", 3) == ([], False)
    # an ack past the last sequence is clamped
    index.heartbeat("seg0", 99)
    assert index.segments["seg0"].journal.acked == 3


def test_changes_are_sent_in_bounded_pieces() -> None:
    index = make_index(segments=2, alignment=64, max_changes_per_heartbeat=2)[0]
    for i in range(3):
        put(index, "host0", f"k{i}/0", f"k{i}", 1)
        index.put_end([(f"k{i}/0", i)])
    changes, more = index.heartbeat("seg0", 0)
    assert [c.sequence for c in changes] == [1, 2] and more
    changes, more = index.heartbeat("seg0", 2)
    assert [c.sequence for c in changes] == [3] and not more


def test_a_restarted_master_adopts_reports_and_a_group_waits_for_all_its_stores() -> None:
    old = make_index(segments=2, alignment=64)[0]
    put(old, "host0", "g/0", "g", 2)
    put(old, "host1", "g/1", "g", 2)  # the writer's own host first: the group spans both stores
    put(old, "host0", "h/0", "h", 1, size=2 * KB)
    put(old, "host0", "x/0", "x", 1)  # in flight at the crash
    old.put_end([("g/0", 1), ("g/1", 2), ("h/0", 3)])
    reports = {s: list(store_view(old, s).values()) for s in ("seg0", "seg1")}
    assert sorted(r.key for r in reports["seg0"]) == ["g/0", "h/0"]  # never x/0

    new = make_index(segments=0, alignment=64)[0]
    result = mount(new, "seg0", reports["seg0"])
    assert (result.fresh, result.adopted, result.rejected_keys, result.sequence) == (True, 2, [], 0)
    assert [g.group_id for g in new.lookup(["h"]).groups] == ["h"]
    assert new.lookup(["g"]).groups == []  # g/1 is in a store that has not reported yet
    assert new.exists(["g/0", "g/1", "h/0", "x/0"]) == [True, False, True, False]
    # reported ranges are used; a new put takes the first free range after them
    assert new.segments["seg0"].allocator.free_extents() == [Extent(3 * KB, 97 * KB)]
    assert new.put_start("host0", [PutRequestItem("y/0", "y", 1, KB)])[0].offset == 3 * KB
    mount(new, "seg1", reports["seg1"])
    found = new.lookup(["g", "h"]).groups
    assert [(m.key, m.segment_id, m.offset, m.checksum) for g in found for m in g.members.values()] == [
        ("g/0", "seg0", 0, 1), ("g/1", "seg1", 0, 2), ("h/0", "seg0", KB, 3)]
    assert new.used_bytes == 5 * KB and new.counters.adopted_objects == 3
    # the reporting store already holds these: its journal starts empty
    assert new.heartbeat("seg0", 0) == ([], False)


def test_records_the_master_cannot_take_are_rejected_never_double_allocated() -> None:
    new = make_index(segments=1, alignment=64)[0]
    put(new, "host0", "taken/0", "taken", 1)  # a put after the restart, before seg1 reported
    put(new, "host0", "full/0", "full", 1)
    new.put_end([("taken/0", 1), ("full/0", 1)])
    records = [
        rec("ok/0", "ok", 2, 0),
        rec("overlap/0", "overlap", 1, 512),  # inside ok/0's range
        rec("odd/0", "odd", 1, 2 * KB + 8),  # not aligned: no master gave it out
        rec("out/0", "out", 1, 99 * KB + 512),  # past the end of the segment
        rec("taken/0", "taken", 1, 4 * KB),  # first writer wins
        rec("size/0", "ok", 3, 5 * KB),  # disagrees with ok's group size
        rec("full/1", "full", 1, 6 * KB),  # full already has its one member
        rec("ok/1", "ok", 2, 7 * KB),
    ]
    result = mount(new, "seg1", records)
    assert result.adopted == 2
    assert result.rejected_keys == ["overlap/0", "odd/0", "taken/0", "size/0", "full/1", "out/0"]
    assert [g.group_id for g in new.lookup(["ok"]).groups] == ["ok"]
    assert new.segments["seg1"].allocator.free_extents() == [Extent(KB, 6 * KB), Extent(8 * KB, 92 * KB)]
    assert new.counters.rejected_records == 6


def test_a_group_that_failed_after_the_restart_is_not_brought_back() -> None:
    new = make_index(segments=1, alignment=64)[0]
    put(new, "host0", "f/0", "f", 2)
    assert new.put_revoke(["f/0"]) == 1  # its writer failed: the group is refused for a while
    result = mount(new, "seg1", [rec("f/1", "f", 2, 0)])
    assert (result.adopted, result.rejected_keys) == (0, ["f/1"])
    assert "f" not in new.groups and new.used_bytes == 0


def test_same_segment_mounted_again_keeps_the_index_and_resyncs_the_store() -> None:
    index = make_index(segments=1, alignment=64)[0]
    for name in ("a", "b", "c"):
        put(index, "host0", f"{name}/0", name, 1)
        index.put_end([(f"{name}/0", 5)])
    index.heartbeat("seg0", 3)
    # the store lost b/0's record, and holds one the master does not know
    report = [rec("a/0", "a", 1, 0, checksum=5), rec("c/0", "c", 1, 2 * KB, checksum=5), rec("z/0", "z", 1, 9 * KB)]
    result = mount(index, "seg0", report)
    assert (result.fresh, result.adopted, result.rejected_keys, result.sequence) == (False, 2, ["z/0"], 3)
    assert index.heartbeat("seg0", 3) == ([SegmentChange(4, added=rec("b/0", "b", 1, KB, checksum=5))], False)
    assert index.exists(["a/0", "b/0", "c/0", "z/0"]) == [True, True, True, False]


def test_a_segment_back_with_another_identity_keeps_only_its_new_report() -> None:
    index = make_index(segments=1, alignment=64)[0]
    put(index, "host0", "a/0", "a", 1)
    index.put_end([("a/0", 5)])
    result = index.mount_segment("seg0", "127.0.0.1:9000", "host0", 0x70000000, 100 * KB, records=[])
    assert (result.fresh, result.adopted) == (True, 0)
    assert index.exists(["a/0"]) == [False] and index.used_bytes == 0


def test_allocator_with_ranges_holds_exactly_those_ranges() -> None:
    allocator = allocator_with_ranges(10 * KB, 64, [(0, 100), (KB, KB), (4 * KB, 3000)])
    assert allocator.used_bytes == 128 + KB + 3008
    assert allocator.free_extents() == [Extent(128, 896), Extent(2 * KB, 2 * KB), Extent(4 * KB + 3008, 3136)]
    allocator.free(KB)  # a reported range frees like any other
    assert allocator.free_extents()[0] == Extent(128, 3968)
    with pytest.raises(ValueError, match="not free in order"):
        allocator_with_ranges(10 * KB, 64, [(KB, 64), (0, 64)])


def test_a_group_whose_other_store_never_reports_is_dropped_in_time() -> None:
    new = make_index(segments=0, alignment=64, incomplete_group_s=30.0)[0]
    mount(new, "seg0", [rec("g/0", "g", 2, 0), rec("h/0", "h", 1, KB)])
    assert list(new.groups) == ["g", "h"] and new.used_bytes == 2 * KB
    new.clock.now += 30.0
    assert new.drop_incomplete_groups() == ["g"]
    assert list(new.groups) == ["h"] and new.used_bytes == KB
    # the store forgets g/0 with the next heartbeat answer
    assert new.heartbeat("seg0", 0) == ([SegmentChange(1, removed_key="g/0")], False)
