"""Groups a reader found corrupt: hidden at once, dropped when no lease holds them, put again afresh."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.records import PutRequestItem, PutStatus
from tests.core.fixtures import KB, make_index


def put_group(index: PoolIndex, group_id: str, members: int = 2) -> list[PutStatus]:
    items = [PutRequestItem(f"{group_id}/{m}", group_id, members, KB) for m in range(members)]
    outcomes = index.put_start("host0", items)
    index.put_end([(item.key, 7) for item, o in zip(items, outcomes) if o.status is PutStatus.RESERVED])
    return [o.status for o in outcomes]


def test_a_corrupt_group_is_dropped_when_its_lease_is_released_and_put_again() -> None:
    index, _ = make_index()
    for name in ("a", "b", "c"):
        put_group(index, name)
    lease = index.lookup(["a", "b", "c"]).lease_id
    assert index.release_lease(lease, corrupt_group_ids=["b"])
    assert list(index.groups) == ["c", "a"]
    assert index.exists(["b/0", "b/1"]) == [False, False]
    assert index.counters.corrupt_groups == 1
    assert index.used_bytes == 4 * KB
    # the prefix stops where the chunk went; its next save stores it afresh
    assert [g.group_id for g in index.lookup(["a", "b", "c"]).groups] == ["a"]
    assert put_group(index, "b") == [PutStatus.RESERVED, PutStatus.RESERVED]
    assert [g.group_id for g in index.lookup(["a", "b", "c"]).groups] == ["a", "b", "c"]


def test_a_group_another_reader_holds_is_hidden_then_dropped_when_that_lease_ends() -> None:
    index, clock = make_index(lease_s=5.0)
    put_group(index, "a")
    first = index.lookup(["a"]).lease_id
    second = index.lookup(["a"]).lease_id
    index.release_lease(first, corrupt_group_ids=["a"])
    assert "a" in index.groups and index.groups["a"].corrupt
    assert index.lookup(["a"]).groups == []  # invisible at once
    assert put_group(index, "a") == [PutStatus.ALREADY_EXISTS] * 2  # still there until the lease ends
    assert index.counters.corrupt_groups == 0
    index.release_lease(second)
    assert "a" not in index.groups and index.counters.corrupt_groups == 1
    assert put_group(index, "a") == [PutStatus.RESERVED] * 2


def test_a_condemned_group_goes_when_the_other_lease_expires() -> None:
    index, clock = make_index(lease_s=5.0)
    put_group(index, "a")
    first = index.lookup(["a"], lease_s=1.0).lease_id
    index.lookup(["a"], lease_s=5.0)
    index.release_lease(first, corrupt_group_ids=["a"])
    clock.now += 4.9
    assert index.expire_leases() == 0 and "a" in index.groups
    clock.now += 0.1
    assert index.expire_leases() == 1
    assert "a" not in index.groups and index.used_bytes == 0


def test_a_reader_condemns_only_what_its_own_lease_held() -> None:
    index, clock = make_index(lease_s=5.0)
    put_group(index, "a")
    put_group(index, "b")
    lease = index.lookup(["a"]).lease_id
    index.release_lease(lease, corrupt_group_ids=["a", "b", "zz"])
    assert list(index.groups) == ["b"] and not index.groups["b"].corrupt
    # an expired lease is unknown: its report changes nothing
    lease = index.lookup(["b"], lease_s=1.0).lease_id
    clock.now += 1.0
    index.expire_leases()  # the master's sweep
    assert not index.release_lease(lease, corrupt_group_ids=["b"])
    assert list(index.groups) == ["b"] and index.counters.corrupt_groups == 1


def test_a_group_put_again_under_the_same_id_is_not_condemned_by_a_late_report() -> None:
    index, clock = make_index(lease_s=5.0)
    put_group(index, "a")
    stale = index.lookup(["a"]).lease_id
    fresh_reader = index.lookup(["a"]).lease_id
    index.release_lease(fresh_reader, corrupt_group_ids=["a"])
    index.release_lease(stale)  # the bad copy goes with the last lease
    put_group(index, "a")  # a good copy under the same id
    late = index.lookup(["a"]).lease_id
    index.release_lease(late)
    assert index.release_lease(stale, corrupt_group_ids=["a"]) is False
    assert [g.group_id for g in index.lookup(["a"]).groups] == ["a"]
    assert index.counters.corrupt_groups == 1


# ---- the rule under random steps ------------------------------------------

GROUPS = ("g0", "g1", "g2", "g3")


class CorruptGroupMachine(RuleBasedStateMachine):
    """Random puts, lookups, releases with corrupt reports and clock steps.

    After every step: no lookup can return a condemned group; a condemned group
    is still in the index only while a lease holds it; the index's lease counts
    match the live leases; every report of a held group was acted on.
    """

    def __init__(self) -> None:
        super().__init__()
        self.index, self.clock = make_index(lease_s=3.0)
        self.leases: list[tuple[int, list[str]]] = []

    @rule(group_id=st.sampled_from(GROUPS))
    def put(self, group_id: str) -> None:
        put_group(self.index, group_id)

    @rule(names=st.lists(st.sampled_from(GROUPS), min_size=1, max_size=3, unique=True))
    def lookup(self, names: list[str]) -> None:
        result = self.index.lookup(names)
        assert not any(g.corrupt for g in result.groups)
        if result.lease_id:
            self.leases.append((result.lease_id, [g.group_id for g in result.groups]))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.leases:
            return
        lease_id, held = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        report = data.draw(st.lists(st.sampled_from(GROUPS), max_size=2, unique=True))
        held_now = {g: self.index.groups.get(g) for g in held}
        known = self.index.release_lease(lease_id, corrupt_group_ids=report)
        if known:
            for group_id in set(report) & set(held):
                group = held_now[group_id]
                if group is not None:  # reported while held: hidden, or gone with its last lease
                    assert group.corrupt
                    assert self.index.groups.get(group_id) is not group or group.busy

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        self.index.expire_leases()

    @invariant()
    def condemned_groups_live_only_under_a_lease(self) -> None:
        for group in self.index.groups.values():
            assert not group.corrupt or group.num_leases > 0

    @invariant()
    def ready_is_complete_not_corrupt_not_dropped(self) -> None:
        leased = list(self.index.leases.leased())  # (dropped ones among them too)
        for group in [*self.index.groups.values(), *leased]:
            assert group.ready == (group.complete and not group.corrupt and not group.dropped), group.group_id

    @invariant()
    def lease_counts_match(self) -> None:
        held: dict[int, int] = {}
        for group in self.index.leases.leased():
            held[id(group)] = held.get(id(group), 0) + 1
        for group in self.index.groups.values():
            assert group.num_leases == held.get(id(group), 0)


CorruptGroupMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_corrupt_group_machine = CorruptGroupMachine.TestCase
