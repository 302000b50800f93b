"""A put of whole new groups placed a group at a time (``PoolIndex.put_groups``). Below the high watermark it
decides exactly what ``put_start`` of the items it stands for decides: the same places, the same index after
(groups and their records, the LRU order, puts in flight and incomplete groups in order, every segment's holes,
allocations and journal, counters), whatever came before. Past the watermark it first evicts exactly what the
items would, one at a time (the same victims in the same order), then places each group at once: the items'
decisions but for where in its segment each member lies. Where it is not such a put it changes nothing and says
so (None), for the items to go."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st
from kvpool.core.errors import KvpoolError
from kvpool.core.pool.index import IndexSettings, PoolIndex
from kvpool.core.pool.put_groups import group_items
from kvpool.core.pool.puts import PlacedGroups
from kvpool.core.pool.records import Group, PutRequestItem, PutStatus
from tests.core.fixtures import KB, Clock


ALIGNMENT, HIGH, STEP = 64, 0.9, 3


def state(index: PoolIndex) -> tuple:
    segments = {
        segment_id: (segment.allocator.free_extents(), segment.allocator.allocations(),
                     segment.num_objects, list(segment.groups), segment.journal.sequence,
                     segment.journal.pending_columns(1 << 30))
        for segment_id, segment in index.segment_table.segments.items()
    }
    groups = [(group, group.ready, group.slot) for group in index.groups.values()]
    table = index.group_table
    return (groups, list(index.puts.in_flight.items()), list(index.puts.incomplete.items()), index.counters,
            table.version, table.num_objects, table.num_complete, dict(table.tenant_bytes), index.used_bytes,
            dict(index.owners), segments)


def decisions(index: PoolIndex) -> tuple:
    """``state`` but for where in its segment each member lies (its offset; every segment's holes and allocations;
    whether a group's members are one allocation) and which slot of the group table's orders a group has (a batch
    that evicts first takes its victims' slots): what a put past the watermark decides as its items do."""
    groups = [(g.group_id, g.size, g.tenant, g.keys, g.whole, g.segment_ids, g.sizes, tuple(g.checksums), g.pending,
               g.nbytes, g.num_committed, g.num_in_flight, g.num_leases, g.failed, g.corrupt, g.ready)
              for g in index.groups.values()]
    segments = {
        segment_id: (segment.allocator.used_bytes, segment.num_objects, list(segment.groups),
                     segment.journal.sequence, segment.journal.pending_columns(1 << 30))
        for segment_id, segment in index.segment_table.segments.items()
    }
    table = index.group_table
    return (groups, list(index.puts.in_flight.items()), list(index.puts.incomplete.items()), index.counters,
            table.version, table.num_objects, table.num_complete, dict(table.tenant_bytes), index.used_bytes,
            dict(index.owners), segments)


class Recorded:
    """An index whose every call is kept, so that its twin as of now can be built (``twin``)."""

    def __init__(self, roomy: bool) -> None:
        self.roomy = roomy
        self.index, self.clock = pool(roomy)
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):  # noqa: ANN204  (an index's method, kept when called)
        method = getattr(self.index, name)

        def call(*args: object) -> object:
            self.calls.append((name, args))
            try:
                return method(*args)
            except KvpoolError:  # refused, nothing changed: its twin is refused it alike
                self.calls[-1] = ("!" + name, args)
                raise
        return call

    def tick(self, now: float) -> None:
        self.calls.append(("", (now,)))
        self.clock.now = now

    def twin(self) -> PoolIndex:
        index, clock = pool(self.roomy)
        for name, args in self.calls:
            if not name:
                clock.now = args[0]
            elif name[0] == "!":
                with pytest.raises(KvpoolError):
                    getattr(index, name[1:])(*args)
            else:
                getattr(index, name)(*args)
        assert state(index) == state(self.index)
        return index


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


def rounded(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


def check_evicted_for_the_batch(index: PoolIndex, before: list[tuple[Group, bool]], used: int,
                                placed: PlacedGroups, ids: list[str], total: int, tenant: str) -> None:
    """A put of new groups that passed the high watermark: no busy group evicted; each group back to back in one
    segment; and where one tenant holds the pool, its least recently used idle groups, at most the step more than
    take the whole batch under the watermark. (Fewer where the tenant is within its share: a share counts the
    objects' own sizes, the watermark their aligned room; its items then lie past the watermark, as the items'
    would, until the tenant passes its share.)"""
    evicted = [group for group, _ in before if index.groups.get(group.group_id) is not group]
    busy = {id(group) for group, was_busy in before if was_busy}
    assert not [group.group_id for group in evicted if id(group) in busy]
    for group_id, segment, offsets in zip(ids, placed.segments, placed.offsets):
        group = index.groups[group_id]
        assert group.run and set(group.segment_ids) == {segment.segment_id} and list(group.offsets) == offsets
        assert offsets == [offsets[0] + sum(map(rounded, group.sizes[:m])) for m in range(len(offsets))]
    if {group.tenant for group, _ in before} | {tenant} != {"default"}:
        return  # (tenants' shares order the victims: tests/core/test_tenant_shares.py)
    idle = [group for group, was_busy in before if not was_busy]
    assert evicted == idle[:len(evicted)]
    needed, freed = 0, 0
    while used - freed + total > HIGH * index.capacity and needed < len(idle):
        freed += sum(map(rounded, idle[needed].sizes))
        needed += 1
    assert len(evicted) <= needed + STEP


def outcomes(found: list) -> list[tuple]:
    return [(o.status, o.segment.segment_id if o.segment is not None else None, o.offset if o.segment else 0)
            for o in found]


def pool(roomy: bool = False) -> tuple[PoolIndex, Clock]:
    """Two segments on the writer's host (a batch's groups take them in turn) and one on another (spill), small
    enough that puts pass the high watermark and evict, a few groups a batch. ``roomy``: two of 24 KB on the
    writer's host, whose holes mostly take a batch as the watermark passes (a put at once past it)."""
    clock = Clock()
    index = PoolIndex(IndexSettings(alignment=ALIGNMENT, stripe_min_bytes=2 * KB, high_watermark=HIGH,
                                    low_watermark=0.8, max_evictions_per_put=STEP), clock=clock)
    for i, host in enumerate(["host0", "host0"] if roomy else ["host0", "host0", "host1"]):
        index.mount_segment(f"seg{i}", f"127.0.0.1:{9000 + i}", host, 0x10000000 * (i + 1), (24 if roomy else 8) * KB)
    return index, clock


def two() -> tuple[tuple[PoolIndex, Clock], tuple[PoolIndex, Clock]]:
    return pool(), pool()


@pytest.mark.parametrize("roomy", [False, True])
@settings(max_examples=60, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_a_put_of_whole_groups_at_once_decides_what_its_items_decide(roomy: bool, rng: random.Random) -> None:
    fast, fast_clock = pool(roomy)
    items_only = Recorded(roomy)  # the same calls, each kept: its twin takes a put's items where the two part ways
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
            items = items_of(ids, sizes, by_member, tenant)
            assert fast.expire_leases() == items_only.expire_leases()  # (as a put does first)
            before = [(group, group.busy) for group in fast.groups.values()]  # in LRU order
            total = sum(map(rounded, sizes)) * len(ids)
            used = fast.used_bytes
            past = used + total > HIGH * fast.capacity
            placed = fast.put_groups("host0", ids, sizes, by_member, tenant, lease)
            if past and placed is not None:
                # it evicts what the items would, then places each group at once where the items go member by
                # member (some before the eviction, some after): the same decisions but for where in its segment
                # each member lies. The items go on a twin (the two part ways here), then both take the same put.
                twin = items_only.twin()
                want_items = twin.put_start("host0", items, lease)
                assert [(o.status, o.segment.segment_id) for o in placed.outcomes(len(sizes), by_member)] == \
                    [(o.status, o.segment and o.segment.segment_id) for o in want_items]
                assert decisions(fast) == decisions(twin), f"step {step}"
                other = items_only.put_groups("host0", ids, sizes, by_member, tenant, lease)
                assert other is not None
                assert as_items(placed, len(sizes), by_member) == as_items(other, len(sizes), by_member)
                check_evicted_for_the_batch(fast, before, used, placed, ids, total, tenant)
                assert state(fast) == state(items_only.index), f"step {step}"
                known.extend(ids)
                continue
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
            got = outcomes(fast.put_start("host0", items, lease)) if placed is None else \
                as_items(placed, len(sizes), by_member)
            assert got == want
            known.extend(ids)
        elif op < 0.6:  # a group keeping its keys whole, keys "<an id>/<m>" no group of that id holds yet
            owner, taken = f"w{step}", f"x{step}"
            items = [PutRequestItem(f"{taken}/{m}", owner, 2, 128) for m in range(2)]
            assert outcomes(fast.put_start("host0", items)) == outcomes(items_only.put_start("host0", items))
            whole.append(taken)
        elif op < 0.75:  # commit some of what is in flight
            keys = list(items_only.index.puts.in_flight)
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
            keys = rng.sample(list(items_only.index.puts.in_flight), min(2, len(items_only.index.puts.in_flight)))
            assert fast.put_revoke(keys) == items_only.put_revoke(keys)
            refused.extend(key.rpartition("/")[0] for key in keys)
        else:  # time passes: holds and leases run out, incomplete groups go
            fast_clock.now += rng.choice([0.5, 5.0, 40.0])
            items_only.tick(fast_clock.now)
            assert fast.drop_incomplete_groups() == items_only.drop_incomplete_groups()
        assert state(fast) == state(items_only.index), f"step {step}"


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


def test_saves_at_the_watermark_evict_then_place_each_group_at_once() -> None:
    """The master bench's pattern: saves of new groups of one size into a pool at its watermark, a reader holding
    the oldest groups. Each save past the watermark evicts what its items would (the rules above), then places
    its groups each at once; the leased groups stay."""
    index = PoolIndex(IndexSettings(alignment=ALIGNMENT, stripe_min_bytes=2 * KB, high_watermark=HIGH,
                                    low_watermark=0.8, max_evictions_per_put=STEP), clock=Clock())
    for i in range(2):
        index.mount_segment(f"seg{i}", f"127.0.0.1:{9000 + i}", "host0", 0x10000000 * (i + 1), 32 * KB)
    saved: list[str] = []

    def save(count: int) -> PlacedGroups | None:
        ids = [f"s{len(saved) + i}" for i in range(count)]
        index.expire_leases()
        before, used = [(group, group.busy) for group in index.groups.values()], index.used_bytes
        placed = index.put_groups("host0", ids, [256] * 4, True)
        if placed is not None:
            check_evicted_for_the_batch(index, before, used, placed, ids, count * KB, "default")
        index.put_end([(key, 1) for key in list(index.puts.in_flight)])
        saved.extend(ids)
        return placed

    while index.used_bytes + KB <= HIGH * index.capacity:
        assert isinstance(save(1), PlacedGroups)
    lease = index.lookup(saved[:2], 60.0)
    assert lease.num_found == 2 and index.counters.evicted_groups == 0
    placed = [save(3) for _ in range(20)]
    assert all(isinstance(p, PlacedGroups) for p in placed), [type(p).__name__ for p in placed]
    assert index.counters.evicted_groups >= 20 * 3 and saved[0] in index.groups and saved[1] in index.groups
    assert saved[2] not in index.groups


def test_past_the_watermark_a_pool_evicting_by_object_puts_the_items() -> None:
    """Eviction by object (``IndexSettings.eviction``, for comparisons) leaves groups in part: a batch past the
    watermark is not placed at once there (None: the caller puts the items), below it is."""
    index = PoolIndex(IndexSettings(alignment=ALIGNMENT, high_watermark=HIGH, eviction="object"), clock=Clock())
    index.mount_segment("seg0", "127.0.0.1:9000", "host0", 0x10000000, 8 * KB)
    assert isinstance(index.put_groups("host0", [f"a{i}" for i in range(7)], [256] * 4, True), PlacedGroups)
    before = state(index)
    assert index.put_groups("host0", ["b"], [256] * 4, True) is None and state(index) == before


def test_past_the_watermark_two_tenants_of_unaligned_objects_evict_as_the_items_would() -> None:
    """Two tenants; a put of tenant b's new groups of unaligned members (65 bytes, 128 of room) passes the
    watermark. One at a time, each of its items makes room for itself with the items before it in place, their
    room counted against the watermark and against b's share: the put at once evicts exactly the same groups."""
    index, twin = (PoolIndex(IndexSettings(alignment=ALIGNMENT, stripe_min_bytes=2 * KB, high_watermark=HIGH,
                                           low_watermark=0.8, max_evictions_per_put=STEP), clock=Clock())
                   for _ in range(2))
    for pool_index in (index, twin):
        for i in range(2):
            pool_index.mount_segment(f"seg{i}", f"127.0.0.1:{9000 + i}", "host0", 0x10000000 * (i + 1), 24 * KB)
        for i in range(25):  # a: 16 groups of 4 x 256 bytes; b: 25 of 4 x 200 (256 of room each)
            for tenant, count, size in (("a", 16, 256), ("b", 25, 200)):
                if i < count:
                    pool_index.put_start("host0", items_of([f"{tenant}{i}"], [size] * 4, True, tenant))
                    pool_index.put_end([(f"{tenant}{i}/{m}", 1) for m in range(4)])
    ids = [f"n{i}" for i in range(6)]
    assert index.used_bytes + 6 * 4 * 128 > HIGH * index.capacity  # past the watermark
    placed = index.put_groups("host0", ids, [65] * 4, True, "b")
    want = twin.put_start("host0", items_of(ids, [65] * 4, True, "b"))
    assert placed is not None and {o.status for o in want} == {PutStatus.RESERVED}
    assert index.counters.evicted_groups_by_tenant == twin.counters.evicted_groups_by_tenant != {}
    assert decisions(index) == decisions(twin)
