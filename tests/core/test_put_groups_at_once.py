"""A put of whole new groups placed a group at a time (``PoolIndex.put_groups``) decides exactly what ``put_start``
of the items it stands for decides: the same places, the same index after (groups and their records, the LRU
order, puts in flight and incomplete groups in order, every segment's holes, allocations and journal, counters),
whatever came before; and where it is not such a put it changes nothing and says so (None), for the items to go."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from kvpool.core.pool.index import IndexSettings, PoolIndex
from kvpool.core.pool.put_groups import group_items
from kvpool.core.pool.puts import PlacedGroups
from kvpool.core.pool.records import PutRequestItem, PutStatus
from tests.core.fixtures import KB, Clock


def state(index: PoolIndex) -> tuple:
    segments = {
        segment_id: (segment.allocator.free_extents(), sorted(segment.allocator._allocations.items()),
                     segment.num_objects, list(segment.groups), segment.journal.sequence,
                     segment.journal.pending_entries(1 << 30))
        for segment_id, segment in index.segment_table.segments.items()
    }
    groups = [(group, group.ready, group.slot) for group in index.groups.values()]
    table = index.group_table
    return (groups, list(index.puts.in_flight.items()), list(index.puts.incomplete.items()), index.counters,
            table.version, table.num_objects, table.num_complete, dict(table.tenant_bytes), index.used_bytes,
            dict(index.owners), segments)


def items_of(group_ids: list[str], sizes: list[int], by_member: bool, tenant: str) -> list[PutRequestItem]:
    keys, ids, item_sizes = group_items(group_ids, sizes, by_member)
    return [PutRequestItem(k, g, len(sizes), s, tenant) for k, g, s in zip(keys, ids, item_sizes)]


def as_items(placed: PlacedGroups, members: int, by_member: bool) -> list[tuple]:
    """What ``put_start``'s outcomes say, in the items' order, of a put placed at once."""
    by_group = [(PutStatus.RESERVED, segment.segment_id, offset)
                for segment, offsets in zip(placed.segments, placed.offsets) for offset in offsets]
    if not by_member:
        return by_group
    return [by_group[g * members + m] for m in range(members) for g in range(len(placed.segments))]


def outcomes(found: list) -> list[tuple]:
    return [(o.status, o.segment.segment_id if o.segment is not None else None, o.offset if o.segment else 0)
            for o in found]


def pool() -> tuple[PoolIndex, Clock]:
    """Two segments on the writer's host (a batch's groups take them in turn) and one on another (spill), small
    enough that puts pass the high watermark and evict, a few groups a batch."""
    clock = Clock()
    index = PoolIndex(IndexSettings(alignment=64, stripe_min_bytes=2 * KB, high_watermark=0.9, low_watermark=0.8,
                                    max_evictions_per_put=3), clock=clock)
    for i, host in enumerate(["host0", "host0", "host1"]):
        index.mount_segment(f"seg{i}", f"127.0.0.1:{9000 + i}", host, 0x10000000 * (i + 1), 8 * KB)
    return index, clock


def two() -> tuple[tuple[PoolIndex, Clock], tuple[PoolIndex, Clock]]:
    return pool(), pool()


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False))
def test_a_put_of_whole_groups_at_once_decides_what_its_items_decide(rng: random.Random) -> None:
    (fast, fast_clock), (items_only, items_clock) = two()
    known: list[str] = []
    whole: list[str] = []
    refused: list[str] = []
    leases: list[int] = []
    # filled first (or not), in order, to somewhere short of the high watermark: the holes left are each segment's
    # tail, large, so that puts past the watermark meet segments with room (a put at once must not evict)
    fill = rng.choice([0.0, rng.uniform(0.5, 0.88)]) * fast.capacity
    for n in range(int(fill) // KB):  # a group of 1 KB each
        ids = [f"f{n}"]
        for index in (fast, items_only):
            index.put_start("host0", items_of(ids, [256] * 4, True, "default"))
            index.put_end([(f"{ids[0]}/{m}", 1) for m in range(4)])
        known.extend(ids)
    for step in range(40):
        op = rng.random()
        if op < 0.55:  # a put of whole groups: mostly new, sometimes one the index holds or one refused
            members = rng.choice([1, 2, 3, 4, 4])
            sizes = [rng.choice([64, 100, 200, 300]) for _ in range(members)]
            ids = [f"g{step}-{i}" for i in range(rng.randint(1, 6))]
            if known and rng.random() < 0.2:
                ids[rng.randrange(len(ids))] = rng.choice(known)
            if refused and rng.random() < 0.3:  # a group a revoke failed (refused a while)
                ids[rng.randrange(len(ids))] = rng.choice(refused)
            if whole and rng.random() < 0.2:  # a group whose keys another group holds (kept whole)
                ids[rng.randrange(len(ids))] = rng.choice(whole)
            ids = list(dict.fromkeys(ids))
            by_member, tenant = rng.random() < 0.5, rng.choice(["default", "default", "t1"])
            lease = rng.choice(leases) if leases and rng.random() < 0.3 else 0
            placed = fast.put_groups("host0", ids, sizes, by_member, tenant, lease)
            items = items_of(ids, sizes, by_member, tenant)
            try:
                want = outcomes(items_only.put_start("host0", items, lease))
            except Exception as error:  # refused alike, and nothing changed by the attempt at once
                assert placed is None
                try:
                    fast.put_start("host0", items, lease)
                except type(error) as again:
                    assert str(again) == str(error)
                else:
                    raise AssertionError(f"the items were refused ({error}) and the same put was not")
                continue
            if placed is None:
                got = outcomes(fast.put_start("host0", items, lease))
            else:
                got = as_items(placed, len(sizes), by_member)
            assert got == want
            known.extend(ids)
        elif op < 0.6:  # a group keeping its keys whole, keys "<an id>/<m>" no group of that id holds yet
            owner, taken = f"w{step}", f"x{step}"
            items = [PutRequestItem(f"{taken}/{m}", owner, 2, 128) for m in range(2)]
            assert outcomes(fast.put_start("host0", items)) == outcomes(items_only.put_start("host0", items))
            whole.append(taken)
        elif op < 0.75:  # commit some of what is in flight
            keys = list(items_only.puts.in_flight)
            mine = rng.sample(keys, rng.randint(0, len(keys))) if keys else []
            pairs = [(key, 7) for key in mine]
            assert fast.put_end(pairs) == items_only.put_end(pairs)
        elif op < 0.85:  # a lookup that leases, for a save to carry
            ids = rng.sample(known, min(len(known), rng.randint(1, 4))) if known else ["none"]
            a, b = fast.lookup(ids, 5.0), items_only.lookup(ids, 5.0)
            assert a.lease_id == b.lease_id and a.num_found == b.num_found
            if a.lease_id:
                leases.append(a.lease_id)
        elif op < 0.92:  # a writer gives up some puts
            keys = rng.sample(list(items_only.puts.in_flight), min(2, len(items_only.puts.in_flight)))
            assert fast.put_revoke(keys) == items_only.put_revoke(keys)
            refused.extend(key.rpartition("/")[0] for key in keys)
        else:  # time passes: holds and leases run out, incomplete groups go
            fast_clock.now += rng.choice([0.5, 5.0, 40.0])
            items_clock.now = fast_clock.now
            assert fast.drop_incomplete_groups() == items_only.drop_incomplete_groups()
        assert state(fast) == state(items_only), f"step {step}"


def test_a_save_s_put_of_new_groups_is_placed_at_once_and_the_rest_go_by_item() -> None:
    (index, _), _ = two()
    placed = index.put_groups("host0", ["a", "b", "c"], [100, 200], by_member=True)
    assert placed is not None and [len(offsets) for offsets in placed.offsets] == [2, 2, 2]
    before = state(index)
    # none of these is a put of new groups that fits for certain: each changes nothing and says so
    assert index.put_groups("host0", ["d", "a"], [100, 200], by_member=True) is None  # a group it holds
    assert index.put_groups("host0", ["e"], [100], by_member=True) is None  # one member
    assert index.put_groups("host0", ["f"], [100, 9 * KB], by_member=True) is None  # larger than a segment
    assert index.put_groups("host0", [f"h{i}" for i in range(30)], [200, 200], by_member=False) is None  # no room
    index.put_revoke(["a/0"])  # a failed group is refused a while
    after_revoke = state(index)
    assert after_revoke != before and index.put_groups("host0", ["a"], [100, 200], by_member=True) is None
    assert state(index) == after_revoke


def test_a_put_of_items_is_served_as_the_master_serves_a_client_s_put() -> None:
    """``put_start_grouped`` (the simulator's put): items that are a put of whole groups go as the client sends them
    (``PutGroups``, ``put_groups``), answered item by item in their order; any other items as they are."""
    (grouped, _), (direct, _) = two()
    items = items_of(["a", "b", "c"], [100, 200], True, "default")
    placed = direct.put_groups("host0", ["a", "b", "c"], [100, 200], True)
    assert placed is not None
    got = outcomes(grouped.put_start_grouped("host0", items))
    assert got == as_items(placed, 2, True) == outcomes(placed.outcomes(2, True)) and state(grouped) == state(direct)
    assert outcomes(placed.outcomes(2, False)) == as_items(placed, 2, False)
    two_tenants = [PutRequestItem("d/0", "d", 2, 100), PutRequestItem("d/1", "d", 2, 100, "t1")]
    assert outcomes(grouped.put_start_grouped("host0", two_tenants)) == outcomes(direct.put_start("host0",
                                                                                                two_tenants))
    assert state(grouped) == state(direct)
