"""The master's index: groups, LRU order, watermarks, leases, timeouts — exact values."""

from __future__ import annotations

import pytest

from kvpool.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kvpool.core.pool.index import IndexSettings, PoolIndex
from kvpool.core.pool.records import PutRequestItem, PutStatus
from tests.core.fixtures import KB, make_index


def put_group(index: PoolIndex, group_id: str, members: int = 2, size: int = KB, host: str = "host0") -> None:
    items = [PutRequestItem(f"{group_id}/{m}", group_id, members, size) for m in range(members)]
    outcomes = index.put_start(host, items)
    assert [o.status for o in outcomes] == [PutStatus.RESERVED] * members
    index.put_end([(item.key, 7) for item in items])


def test_group_visible_only_when_every_member_committed() -> None:
    index, _ = make_index()
    items = [PutRequestItem(f"g/{m}", "g", 3, KB) for m in range(3)]
    index.put_start("host0", items[:2])
    index.put_end([("g/0", 1), ("g/1", 2)])
    assert index.lookup(["g"]).groups == []
    assert index.exists(["g/0", "g/1", "g/2"]) == [True, True, False]
    index.put_start("host0", items[2:])
    assert index.lookup(["g"]).groups == []  # third member in flight
    index.put_end([("g/2", 3)])
    result = index.lookup(["g"])
    assert [g.group_id for g in result.groups] == ["g"]
    assert sorted(m.checksum for m in result.groups[0].members.values()) == [1, 2, 3]


def test_lookup_counts_leading_complete_groups_only() -> None:
    index, _ = make_index()
    for name in ("a", "b", "d"):
        put_group(index, name)
    result = index.lookup(["a", "b", "c", "d"])
    assert [g.group_id for g in result.groups] == ["a", "b"]
    assert result.lease_id == 1
    assert index.lookup(["c", "a"]).groups == []


def test_first_writer_wins() -> None:
    index, _ = make_index()
    first = index.put_start("host0", [PutRequestItem("k", "g", 1, KB)])
    second = index.put_start("host0", [PutRequestItem("k", "g", 1, KB)])
    assert first[0].status is PutStatus.RESERVED
    assert second[0].status is PutStatus.ALREADY_EXISTS
    index.put_end([("k", 5)])
    assert index.put_start("host0", [PutRequestItem("k", "g", 1, KB)])[0].status is PutStatus.ALREADY_EXISTS
    assert index.used_bytes == KB


def test_eviction_is_lru_by_whole_group_between_watermarks() -> None:
    # 100 KB pool, 10 KB groups (2 × 5 KB): high 90% = 90 KB, low 85% = 85 KB
    index, _ = make_index()
    for i in range(9):
        put_group(index, f"g{i}", size=5 * KB)
    assert index.used_bytes == 90 * KB
    index.lookup(["g0"])  # g0 becomes most recent
    index.release_lease(1)
    # first member: 90 + 5 > 90, so evict until 5 more fits under 85 → g1 goes
    # (g0 was used since); second member: 85 + 5 is not above 90, no eviction
    put_group(index, "g9", size=5 * KB)
    assert list(index.groups) == ["g2", "g3", "g4", "g5", "g6", "g7", "g8", "g0", "g9"]
    assert index.used_bytes == 90 * KB
    assert index.counters.evicted_groups == 1
    assert index.counters.evicted_bytes == 10 * KB
    assert index.exists(["g1/0", "g1/1", "g2/0", "g0/0"]) == [False, False, True, True]
    put_group(index, "g10", members=1, size=10 * KB)  # 10 KB past 90: g2 and g3 go (90 → 70 + 10)
    assert list(index.groups)[:2] == ["g4", "g5"]
    assert index.used_bytes == 80 * KB


def test_touch_makes_the_head_of_a_prefix_most_recent() -> None:
    index, _ = make_index()
    for name in ("a", "b", "c"):
        put_group(index, name)
    index.lookup(["a", "b", "c"])
    # within one request the tail is older, so it is evicted before the head
    assert list(index.groups) == ["c", "b", "a"]


def test_leased_and_in_flight_groups_are_never_evicted() -> None:
    index, clock = make_index(lease_s=5.0)
    for i in range(4):
        put_group(index, f"g{i}", size=10 * KB)
    lease = index.lookup(["g0"]).lease_id
    index.put_start("host0", [PutRequestItem("w/0", "w", 2, 10 * KB)])  # in flight
    for i in range(4, 9):
        put_group(index, f"g{i}", size=5 * KB)
    assert "g0" in index.groups and "w" in index.groups
    assert index.used_bytes <= 90 * KB
    # once the lease ends and the put is revoked, both become evictable
    assert index.release_lease(lease)
    assert index.put_revoke(["w/0"]) == 1
    assert "w" not in index.groups
    clock.now += 1
    assert index.remove(["g0"]) == (1, [])


def test_lease_expires_by_clock() -> None:
    index, clock = make_index(lease_s=5.0)
    put_group(index, "a")
    index.lookup(["a"])
    assert index.remove(["a"]) == (0, ["a"])
    clock.now += 4.9
    assert index.remove(["a"]) == (0, ["a"])
    clock.now += 0.2
    assert index.remove(["a"]) == (1, [])
    assert index.num_leases == 0


def test_put_that_never_ends_is_revoked_after_timeout() -> None:
    index, clock = make_index(put_timeout_s=30.0)
    index.put_start("host0", [PutRequestItem("a/0", "a", 1, KB)])
    clock.now += 10
    index.put_start("host0", [PutRequestItem("b/0", "b", 1, 2 * KB)])
    clock.now += 20.5
    assert index.revoke_expired_puts() == ["a/0"]
    assert index.used_bytes == 2 * KB
    clock.now += 10
    assert index.revoke_expired_puts() == ["b/0"]
    assert index.used_bytes == 0 and not index.groups and index.counters.revoked_puts == 2
    with pytest.raises(FailedPrecondition, match=r"items\[0\]\.key: no put in flight for 'a/0'"):
        index.put_end([("a/0", 1)])


def test_no_space_when_nothing_evictable() -> None:
    index, _ = make_index(segment_bytes=10 * KB)
    index.put_start("host0", [PutRequestItem("a/0", "a", 1, 8 * KB)])  # in flight: not evictable
    outcome = index.put_start("host0", [PutRequestItem("b/0", "b", 1, 4 * KB)])
    assert outcome[0].status is PutStatus.NO_SPACE
    assert index.used_bytes == 8 * KB


def test_store_expiry_drops_its_objects_and_whole_groups() -> None:
    index, clock = make_index(segments=2, segment_ttl_s=10.0)
    # a group spread over both segments (writers on two hosts, each writing its own) dies with either one
    outcomes = index.put_start("host0", [PutRequestItem("g/0", "g", 2, KB)])
    outcomes += index.put_start("host1", [PutRequestItem("g/1", "g", 2, KB)])
    assert [o.segment.segment_id for o in outcomes if o.segment] == ["seg0", "seg1"]
    index.put_end([("g/0", 1), ("g/1", 1)])
    clock.now += 6
    index.heartbeat("seg0")
    clock.now += 5
    assert index.expire_segments() == ["seg1"]
    assert index.lookup(["g"]).groups == []
    assert index.exists(["g/0", "g/1"]) == [False, False]
    assert index.used_bytes == 0
    with pytest.raises(NotFound, match="segment_id: unknown segment 'seg1'"):
        index.heartbeat("seg1")


def test_placement_prefers_writer_host_then_most_free() -> None:
    index, _ = make_index(segments=2)
    assert index.put_start("host1", [PutRequestItem("a/0", "a", 1, KB)])[0].segment.segment_id == "seg1"
    # hostX is neither: most free space wins, so seg0
    assert index.put_start("hostX", [PutRequestItem("b/0", "b", 1, KB)])[0].segment.segment_id == "seg0"
    # equal free space: the lower segment id, then the emptier one
    assert index.put_start("hostX", [PutRequestItem("c/0", "c", 1, 2 * KB)])[0].segment.segment_id == "seg0"
    assert index.put_start("hostX", [PutRequestItem("d/0", "d", 1, KB)])[0].segment.segment_id == "seg1"


def test_a_batch_stays_on_one_segment_while_it_fits() -> None:
    index, _ = make_index(segment_bytes=10 * KB, segments=2)
    first = index.put_start("hostX", [PutRequestItem(f"a{i}/0", f"a{i}", 1, 3 * KB) for i in range(4)])
    # three fit in seg0 (the emptiest, lowest id); the fourth spills to seg1
    assert [o.segment.segment_id for o in first] == ["seg0", "seg0", "seg0", "seg1"]
    second = index.put_start("hostX", [PutRequestItem(f"b{i}/0", f"b{i}", 1, KB) for i in range(2)])
    assert [o.segment.segment_id for o in second] == ["seg1", "seg1"]  # now the emptier one


def test_a_big_batch_is_striped_over_one_hosts_segments() -> None:
    index, _ = make_index(segments=0, stripe_min_bytes=6 * KB)
    index.mount_segment("a0", "127.0.0.1:9000", "hostA", 0x10000000, 10 * KB)
    index.mount_segment("a1", "127.0.0.1:9001", "hostA", 0x20000000, 10 * KB)
    index.mount_segment("b0", "127.0.0.1:9002", "hostB", 0x30000000, 100 * KB)
    # the writer's own host, round robin over its segments, the emptiest (then lowest id) first
    first = index.put_start("hostA", [PutRequestItem(f"a{i}/0", f"a{i}", 1, 3 * KB) for i in range(3)])
    assert [o.segment.segment_id for o in first] == ["a0", "a1", "a0"]
    # a1 is the emptier now, so it leads; what hostA cannot hold spills to hostB
    second = index.put_start("hostA", [PutRequestItem(f"b{i}/0", f"b{i}", 1, 3 * KB) for i in range(4)])
    assert [o.segment.segment_id for o in second] == ["a1", "a0", "a1", "b0"]
    # a writer on neither host: the host of the segment with the most free space
    third = index.put_start("hostX", [PutRequestItem(f"c{i}/0", f"c{i}", 1, 3 * KB) for i in range(2)])
    assert [o.segment.segment_id for o in third] == ["b0", "b0"]
    # below stripe_min_bytes a batch stays on one segment: a1, the emptier one of the writer's host
    index.put_revoke([f"b{i}/0" for i in range(4)])
    small = index.put_start("hostA", [PutRequestItem(f"d{i}/0", f"d{i}", 1, 2 * KB) for i in range(2)])
    assert [o.segment.segment_id for o in small] == ["a1", "a1"]


def test_remount_same_segment_is_idempotent_but_a_changed_one_drops_objects() -> None:
    index, _ = make_index()
    put_group(index, "a")
    assert index.mount_segment("seg0", "127.0.0.1:9000", "host0", 0x10000000, 100 * KB).fresh is False
    assert index.exists(["a/0"]) == [True]
    assert index.mount_segment("seg0", "127.0.0.1:9999", "host0", 0x20000000, 100 * KB).fresh is True
    assert index.exists(["a/0"]) == [False] and index.used_bytes == 0


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([PutRequestItem("k", "g", 1, KB), PutRequestItem("k", "g", 1, KB)], r"items\[1\]\.key: duplicate key"),
        ([PutRequestItem("k", "g", 1, 200 * KB)], r"items\[0\]\.size: 204800 bytes is larger than any segment"),
        ([PutRequestItem("a", "g", 2, KB), PutRequestItem("b", "g", 3, KB)], r"items\[1\]\.group_size: 3 disagrees"),
        ([PutRequestItem("a", "g", 1, KB), PutRequestItem("b", "g", 1, KB)], r"items\[1\]\.key: group 'g' already"),
    ],
)
def test_bad_put_batches_change_nothing(items: list[PutRequestItem], message: str) -> None:
    index, _ = make_index()
    with pytest.raises(InvalidArgument, match=message):
        index.put_start("host0", items)
    assert index.used_bytes == 0 and not index.groups and not index.objects


def test_group_size_must_agree_with_stored_members() -> None:
    index, _ = make_index()
    put_group(index, "g", members=2)
    with pytest.raises(InvalidArgument, match=r"items\[0\]\.group_size: 4 disagrees with 2"):
        index.put_start("host0", [PutRequestItem("g/9", "g", 4, KB)])


def test_watermarks_are_validated() -> None:
    with pytest.raises(ValueError, match="watermarks"):
        IndexSettings(high_watermark=0.8, low_watermark=0.9)


def lru(index: PoolIndex) -> list[str]:
    return list(index.groups)


def test_a_held_prefix_is_counted_and_touched_but_not_leased_or_located() -> None:
    index, _ = make_index()
    for name in ("a", "b", "c", "d", "x"):
        put_group(index, name)
    result = index.lookup(["a", "b", "c", "d"], held_prefix=2)
    assert result.num_found == 4
    assert [g.group_id for g in result.groups] == ["c", "d"]  # located from the first past the prefix
    assert [index.groups[g].num_leases for g in "abcd"] == [0, 0, 1, 1]
    assert lru(index) == ["x", "d", "c", "b", "a"]  # the head most recently used, as without a prefix
    index.touch(["x"])
    assert index.release_lease(result.lease_id)
    assert lru(index) == ["x", "d", "c", "b", "a"]  # the release touches the prefix with the leased groups
    assert [index.groups[g].num_leases for g in "abcd"] == [0, 0, 0, 0]


def test_a_held_prefix_the_pool_lacks_part_of_finds_nothing_past_it() -> None:
    index, _ = make_index()
    for name in ("a", "c", "d"):
        put_group(index, name)
    result = index.lookup(["a", "b", "c", "d"], held_prefix=2)
    assert (result.num_found, result.groups, result.lease_id) == (1, [], 0)  # a leading run only
    assert index.num_leases == 0


def test_a_wholly_held_lookup_leases_nothing_and_touches_every_group() -> None:
    index, _ = make_index()
    for name in ("a", "b", "x"):
        put_group(index, name)
    result = index.lookup(["a", "b"], held_prefix=2)
    assert (result.num_found, result.groups, result.lease_id) == (2, [], 0)
    assert lru(index) == ["x", "b", "a"] and index.num_leases == 0


def test_the_held_prefix_leaves_eviction_order_as_a_full_lookup_leaves_it() -> None:
    """The same calls with and without a held prefix leave the same least-recently-used order."""
    orders = []
    for held in (0, 3):
        index, _ = make_index()
        for name in ("a", "b", "c", "d", "e", "f"):
            put_group(index, name)
        first = index.lookup(["a", "b", "c", "d"], held_prefix=held)
        second = index.lookup(["e", "a"], held_prefix=min(held, 1))
        index.release_lease(first.lease_id)
        index.touch(["f"])
        index.release_lease(second.lease_id)
        orders.append(lru(index))
    assert orders[0] == orders[1] == ["d", "c", "b", "f", "a", "e"]


def test_a_groups_record_keeps_one_id_string_one_size_tuple_and_one_allocation() -> None:
    # one record a group (each put item brings its own copy of the group's id, as a request parsed off the wire
    # does): its members' keys as the parts after "<group id>/" and their sizes as the ints asked for, each in
    # one tuple shared by every group alike, no string or owners entry a key, and a group placed at once is one
    # allocation in its segment, its members' offsets back to back
    index, _ = make_index()
    size = 4 * KB  # an int object of its own, past the small ints CPython shares
    for name in ("group", "other"):
        items = [PutRequestItem(f"{name}/{m}", "".join([name[:3], name[3:]]), 3, size) for m in range(3)]
        assert len({id(item.group_id) for item in items}) == 3
        index.put_start("host0", items)
    group, other = index.groups["group"], index.groups["other"]
    assert group.full_keys() == ("group/0", "group/1", "group/2") and all(s is size for s in group.sizes)
    assert not group.whole and other.keys is group.keys == ("0", "1", "2") and not index.owners
    assert other.sizes is group.sizes and other.segment_ids is group.segment_ids
    assert index.owner("other/2") == (other, 2) and index.owner("other/3") is None and "group/1" in index.objects
    allocator = index.segments["seg0"].allocator
    assert allocator.num_allocations == 2 and allocator.allocation_size(group.offsets[0]) == 3 * size
    assert group.offsets == (group.offsets[0], group.offsets[0] + size, group.offsets[0] + 2 * size)
