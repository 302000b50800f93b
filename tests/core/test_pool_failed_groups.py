"""A group with a member that failed to save is dropped at once and refused for a while — exact values."""

from __future__ import annotations

from kvpool.core.pool.records import PutRequestItem, PutStatus
from tests.core.fixtures import KB, make_index

# one 10 KiB segment; a failed group's other members are refused for 10 s
SMALL = {"segment_bytes": 10 * KB, "failed_group_hold_s": 10.0}


def item(group_id: str, member: int, size: int = KB, group_size: int = 4) -> PutRequestItem:
    return PutRequestItem(f"{group_id}/{member}", group_id, group_size, size)


def statuses(outcomes) -> list[PutStatus]:  # type: ignore[no-untyped-def]
    return [o.status for o in outcomes]


def test_no_space_for_a_member_drops_the_committed_others_and_refuses_the_rest() -> None:
    index, clock = make_index(**SMALL)
    index.put_start("host0", [item("busy", 0, size=8 * KB)])  # in flight: nothing evictable
    index.put_start("host0", [item("g", 0), item("g", 1)])
    index.put_end([("g/0", 1), ("g/1", 2)])
    # the pool is full and g is evictable, but never for a member of its own
    assert statuses(index.put_start("host0", [item("g", 2)])) == [PutStatus.NO_SPACE]
    # g's two committed members went at once: their space is back
    assert "g" not in index.groups and index.used_bytes == 8 * KB
    assert index.counters.failed_groups == 1
    index.put_revoke(["busy/0"])
    # the last member arrives later: it would only make an incomplete group
    assert statuses(index.put_start("host0", [item("g", 3)])) == [PutStatus.GROUP_FAILED]
    clock.now += 10.0
    assert statuses(index.put_start("host0", [item("g", 3)])) == [PutStatus.RESERVED]


def test_members_reserved_earlier_in_the_same_batch_are_given_back() -> None:
    index, _ = make_index(**SMALL)
    outcomes = index.put_start("host0", [item("a", 0, 3 * KB), item("g", 0, 3 * KB), item("g", 1, 5 * KB),
                                         item("g", 2, KB)])
    # g/1 finds no room (a's 3 KB + g/0's 3 KB are in flight): g/0 is undone, g/2 refused
    assert statuses(outcomes) == [PutStatus.RESERVED, PutStatus.GROUP_FAILED, PutStatus.NO_SPACE,
                                  PutStatus.GROUP_FAILED]
    assert list(index.groups) == ["a"] and index.used_bytes == 3 * KB and index.num_in_flight == 1
    assert index.counters.failed_groups == 0  # nothing of g was left to drop


def test_a_revoked_member_drops_its_group_once_the_others_end() -> None:
    index, _ = make_index(**SMALL)
    index.put_start("host0", [item("g", 0), item("g", 1), item("g", 2)])
    index.put_end([("g/0", 1)])
    assert index.put_revoke(["g/1"]) == 1
    # g/2 is still being written: the group waits for it, then goes
    assert list(index.groups["g"].members) == ["g/0", "g/2"] and index.groups["g"].failed
    assert index.put_end([("g/2", 3)]) == 1
    assert "g" not in index.groups and index.used_bytes == 0 and index.counters.failed_groups == 1
    assert index.exists(["g/0", "g/2"]) == [False, False]


def test_a_timed_out_member_fails_its_group() -> None:
    index, clock = make_index(**SMALL, put_timeout_s=30.0)
    index.put_start("host0", [item("g", 0)])
    index.put_end([("g/0", 1)])
    index.put_start("host0", [item("g", 1)])
    clock.now += 31.0
    assert index.revoke_expired_puts() == ["g/1"]
    assert "g" not in index.groups and index.used_bytes == 0
    assert statuses(index.put_start("host0", [item("g", 2)])) == [PutStatus.GROUP_FAILED]


def test_a_one_member_group_may_be_saved_again_at_once() -> None:
    index, _ = make_index(**SMALL)
    index.put_start("host0", [item("busy", 0, 10 * KB)])
    assert statuses(index.put_start("host0", [item("s", 0, group_size=1)])) == [PutStatus.NO_SPACE]
    index.put_revoke(["busy/0"])
    assert statuses(index.put_start("host0", [item("s", 0, group_size=1)])) == [PutStatus.RESERVED]


def test_a_group_left_incomplete_is_dropped_after_incomplete_group_s() -> None:
    index, clock = make_index(**SMALL, incomplete_group_s=30.0)
    index.put_start("host0", [item("g", 0), item("h", 0)])
    index.put_end([("g/0", 1), ("h/0", 1)])
    clock.now += 20.0
    index.put_start("host0", [item("h", 1)])  # h's members keep arriving: its clock starts again
    index.put_end([("h/1", 1)])
    clock.now += 9.9
    assert index.drop_incomplete_groups() == []
    clock.now += 0.1
    assert index.drop_incomplete_groups() == ["g"]
    assert list(index.groups) == ["h"] and index.used_bytes == 2 * KB
    index.put_start("host0", [item("h", 2)])  # in flight at h's deadline: left to its put timeout
    clock.now += 20.0
    assert index.drop_incomplete_groups() == []
    index.put_revoke(["h/2"])  # a failed member drops h at once
    assert index.groups == {} and index.counters.abandoned_groups == 1 and index.counters.failed_groups == 1


def test_a_complete_group_is_never_dropped_as_incomplete() -> None:
    index, clock = make_index(**SMALL, incomplete_group_s=30.0)
    index.put_start("host0", [item("g", m, group_size=2) for m in range(2)])
    index.put_end([("g/0", 1), ("g/1", 2)])
    clock.now += 100.0
    assert index.drop_incomplete_groups() == [] and list(index.groups) == ["g"]
