"""The index's used bytes and capacity are running totals: they equal the sums over its segments after every call."""

from __future__ import annotations

import random

import pytest

from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.records import ObjectRecord, PutRequestItem, PutStatus
from tests.core.fixtures import KB, make_index, mount


def sums(index: PoolIndex) -> tuple[int, int]:
    segments = index.segments.values()
    return sum(s.allocator.used_bytes for s in segments), sum(s.size for s in segments)


def assert_counts(index: PoolIndex) -> None:
    """The running counts Stats reads equal what the groups hold: complete groups, each segment's objects; and
    each group's ``ready`` is what it stands for (complete, not corrupt, not dropped)."""
    groups = index.groups.values()
    assert index.group_table.num_complete == sum(g.complete for g in groups)
    for g in groups:
        assert g.ready == (g.complete and not g.corrupt and not g.dropped), g.group_id
    for segment_id, segment in index.segments.items():
        assert segment.num_objects == sum(g.segment_ids.count(segment_id) for g in groups), segment_id


def test_exact_totals_through_puts_revokes_unmounts_and_reports() -> None:
    index, clock = make_index(segments=0, alignment=64)
    mount(index, "seg0", size=10 * KB)
    mount(index, "seg1", size=20 * KB)
    assert (index.used_bytes, index.capacity) == (0, 30 * KB)
    outcomes = index.put_start("host0", [PutRequestItem(f"g/{i}", "g", 3, 100) for i in range(3)])
    assert [o.status for o in outcomes] == [PutStatus.RESERVED] * 3
    assert index.used_bytes == 3 * 128  # 100 bytes round up to the 64-byte alignment
    index.put_end([("g/0", 1), ("g/1", 2)])
    index.put_revoke(["g/2"])  # fails the group: all three go
    assert index.used_bytes == 0
    index.put_start("host1", [PutRequestItem("h/0", "h", 1, KB)])
    index.put_end([("h/0", 3)])
    assert index.used_bytes == KB
    assert index.unmount_segment("seg1") == 1
    assert (index.used_bytes, index.capacity) == (0, 10 * KB)
    result = mount(index, "seg1", [ObjectRecord("r/0", "r", 1, 0, 100, 5), ObjectRecord("r/1", "r2", 1, 128, KB, 6)],
                   size=20 * KB)
    assert result.adopted == 2
    assert_counts(index)
    assert (index.used_bytes, index.capacity) == (128 + KB, 30 * KB)
    clock.now += index.settings.segment_ttl_s + 1
    assert sorted(index.expire_segments()) == ["seg0", "seg1"]
    assert (index.used_bytes, index.capacity) == (0, 0)


def test_stats_counts_follow_reports_that_complete_a_group_across_segments() -> None:
    index, _ = make_index(segments=0, alignment=64)
    mount(index, "seg0", [ObjectRecord("g/0", "g", 2, 0, 100, 1)], size=10 * KB)
    assert (index.group_table.num_complete, index.segments["seg0"].num_objects) == (0, 1)
    mount(index, "seg1", [ObjectRecord("g/1", "g", 2, 0, 100, 2)], size=10 * KB)
    assert (index.group_table.num_complete, index.segments["seg1"].num_objects) == (1, 1)
    assert_counts(index)
    assert index.unmount_segment("seg0") == 2  # the group goes whole, its member in seg1 too
    assert (index.group_table.num_complete, index.segments["seg1"].num_objects) == (0, 0)
    assert_counts(index)


@pytest.mark.parametrize("eviction", ["group", "object"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_totals_equal_the_sums_after_every_call(eviction: str, seed: int) -> None:
    rng = random.Random(seed)
    index, clock = make_index(segments=3, segment_bytes=8 * KB, alignment=64, eviction=eviction,
                              failed_group_hold_s=1.0)
    in_flight: list[str] = []
    for step in range(400):
        action = rng.random()
        if action < 0.55:
            group_id = f"g{rng.randrange(60)}"
            size = rng.choice([100, 700, 1500, 3000])
            items = [PutRequestItem(f"{group_id}/{m}", group_id, 3, size) for m in range(3)]
            host = f"host{rng.randrange(3)}"
            for item, outcome in zip(items, index.put_start(host, items)):
                if outcome.status is PutStatus.RESERVED:
                    in_flight.append(item.key)
        elif action < 0.8 and in_flight:
            keys = [k for k in in_flight if rng.random() < 0.7]
            index.put_end([(k, 1) for k in dict.fromkeys(keys) if k in index.objects and not index.objects[k].committed])
            in_flight = [k for k in in_flight if k not in keys]
        elif action < 0.85 and in_flight:
            index.put_revoke([in_flight.pop(rng.randrange(len(in_flight)))])
        elif action < 0.9:
            index.lookup([f"g{rng.randrange(60)}"], lease_s=0.5)
        elif action < 0.95:
            segment_id = f"seg{rng.randrange(3)}"
            if segment_id in index.segments:
                index.unmount_segment(segment_id)
            else:
                mount(index, segment_id, size=8 * KB)
        else:
            clock.now += 1.0
            index.revoke_expired_puts()
            index.drop_incomplete_groups()
        assert (index.used_bytes, index.capacity) == sums(index), f"step {step}"
        assert_counts(index)
    assert index.counters.evicted_groups > 0
