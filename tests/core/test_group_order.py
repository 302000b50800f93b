"""The group table's order is exactly the one two ordered dicts moved one group at a time gave, with its
shortcuts: one tenant's dict is ``groups`` itself, and a release whose groups are still where its lookup left
them moves nothing."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpool.core.pool.groups import GroupTable
from kvpool.core.pool.leases import LeaseTable
from kvpool.core.pool.records import Group, PutRequestItem, PutStatus
from tests.core.fixtures import KB, make_index

IDS = [f"g{i}" for i in range(10)]
TENANTS = ["a", "b"]

table_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from(IDS), st.sampled_from(TENANTS)),
    st.tuples(st.just("remove"), st.sampled_from(IDS)),
    st.tuples(st.just("touch"), st.lists(st.sampled_from(IDS), max_size=6)),
    st.tuples(st.just("touch_groups"), st.lists(st.sampled_from(IDS), max_size=6)),
    st.tuples(st.just("demote"), st.lists(st.sampled_from(IDS), max_size=4)),
), max_size=50)


class Reference:
    """The former table: one ordered dict for all, one per tenant, each group moved in both."""

    def __init__(self) -> None:
        self.groups: OrderedDict[str, Group] = OrderedDict()
        self.by_tenant: dict[str, OrderedDict[str, Group]] = {}

    def add(self, group: Group) -> None:
        self.groups[group.group_id] = group
        self.by_tenant.setdefault(group.tenant, OrderedDict())[group.group_id] = group

    def remove(self, group_id: str) -> None:
        group = self.groups.pop(group_id)
        del self.by_tenant[group.tenant][group_id]
        if not self.by_tenant[group.tenant]:
            del self.by_tenant[group.tenant]

    def touch(self, group_ids: list[str]) -> None:
        for group_id in reversed(group_ids):
            if group_id in self.groups:
                self.groups.move_to_end(group_id)
                self.by_tenant[self.groups[group_id].tenant].move_to_end(group_id)

    def demote(self, group_ids: list[str]) -> None:
        for group_id in group_ids:
            if group_id in self.groups:
                self.groups.move_to_end(group_id, last=False)
                self.by_tenant[self.groups[group_id].tenant].move_to_end(group_id, last=False)


@settings(max_examples=300, deadline=None)
@given(table_ops)
def test_the_table_orders_groups_and_tenants_exactly_as_two_dicts_moved_in_step(steps: list[tuple]) -> None:
    """(The C order where built; tests/core/test_lru_order.py holds the Python order to the same moves.)"""
    table, ref = GroupTable(), Reference()
    removed: list[Group] = []
    for step in steps:
        kind = step[0]
        version = table.version
        if kind == "add" and step[1] not in ref.groups:
            group = Group(step[1], 1, tenant=step[2])
            table.add(group)
            ref.add(group)
        elif kind == "remove" and step[1] in ref.groups:
            before = list(table.groups)
            removed.append(ref.groups[step[1]])
            table.remove(ref.groups[step[1]])
            ref.remove(step[1])
            assert table.version == version  # a removal leaves the others' order
            assert list(table.groups) == [g for g in before if g != step[1]]
        elif kind == "touch":
            table.touch(step[1])
            ref.touch(step[1])
        elif kind == "touch_groups":
            found = [ref.groups[g] for g in step[1] if g in ref.groups]
            table.touch_groups(found)
            ref.touch([g.group_id for g in found])
        elif kind == "demote":
            assert table.demote(step[1]) == sum(g in ref.groups for g in step[1])
            ref.demote(step[1])
        assert list(table.groups) == list(ref.groups)
        assert {t: list(g) for t, g in table.by_tenant.items()} == {t: list(g) for t, g in ref.by_tenant.items()}
        assert {t: [i for i in IDS if i in g] for t, g in table.by_tenant.items()} == \
            {t: [i for i in IDS if i in g] for t, g in ref.by_tenant.items()}
        assert not table.one_tenant or len(ref.by_tenant) == 1
        assert sorted(g.slot for g in ref.groups.values()) == sorted(set(g.slot for g in ref.groups.values()))
        assert all(g.slot == -1 for g in removed)


class AlwaysMoves(LeaseTable):
    """Leases whose release never finds its lookup's mark: it always moves its groups."""

    def mark_of(self, lease_id: int) -> int | None:
        return None


index_ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 11), st.sampled_from(TENANTS)),
    st.tuples(st.just("lookup"), st.integers(0, 11), st.integers(1, 5), st.integers(0, 3)),
    st.tuples(st.just("release"), st.integers(0, 3), st.booleans()),
    # a save following a restore: its put uses the lease first, the lease ends after it (the master's PutStart)
    st.tuples(st.just("save"), st.integers(0, 3), st.integers(0, 11), st.booleans()),
    st.tuples(st.just("touch"), st.lists(st.integers(0, 11), max_size=3)),
    st.tuples(st.just("demote"), st.lists(st.integers(0, 11), max_size=3)),
    st.tuples(st.just("remove"), st.integers(0, 11)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(index_ops)
@example([("put", 0, "a"), ("put", 1, "a"), ("put", 2, "a"), ("lookup", 0, 2, 0), ("touch", [1]),
          ("release", 0, False)])
@example([("put", 0, "a"), ("put", 1, "b"), ("put", 2, "a"), ("lookup", 0, 3, 1), ("lookup", 1, 2, 0),
          ("release", 0, True), ("put", 3, "a"), ("release", 0, False)])
def test_a_release_that_moves_nothing_leaves_the_order_a_moving_one_leaves(steps: list[tuple]) -> None:
    """Two indexes, the same calls (puts that evict at the watermark, lookups, releases with corrupt groups,
    touches, demotions, removals): one may skip a release's moves, the other always moves. Same order."""
    pair = [make_index(segment_bytes=12 * KB, segments=1, high_watermark=0.8, low_watermark=0.6)[0]
            for _ in range(2)]
    pair[1].leases = AlwaysMoves(pair[1].clock)
    leases: list[list[int]] = [[], []]
    for step in steps:
        for index, held in zip(pair, leases):
            kind = step[0]
            if kind == "put":
                gid = f"g{step[1]}"
                items = [PutRequestItem(f"{gid}/{m}", gid, 2, KB // 2, step[2]) for m in range(2)]
                index.put_start("host0", items)
                index.put_end([(k, 1) for k in (i.key for i in items) if k in index.puts.in_flight])
            elif kind == "lookup":
                ids = [f"g{(step[1] + i) % 12}" for i in range(step[2])]
                result = index.lookup(ids, 60.0, min(step[3], step[2]))
                if result.lease_id:
                    held.append(result.lease_id)
            elif kind == "release" and held:
                lease_id = held.pop(step[1] % len(held))
                groups = index.leases._leases.get(lease_id, ([], []))[0]
                corrupt = [groups[0].group_id] if step[2] and groups else []
                index.release_lease(lease_id, corrupt)
            elif kind == "save" and held:
                lease_id = held.pop(step[1] % len(held))
                groups = index.leases._leases.get(lease_id, ([], []))[0]
                corrupt = [groups[0].group_id] if step[3] and groups else []
                gid = f"g{step[2]}"
                items = [PutRequestItem(f"{gid}/{m}", gid, 2, KB // 2) for m in range(2)]
                index.put_start("host0", items, lease_id, corrupt)
                index.release_lease(lease_id, corrupt)
                index.put_end([(k, 1) for k in (i.key for i in items) if k in index.puts.in_flight])
            elif kind == "touch":
                index.touch([f"g{i}" for i in step[1]])
            elif kind == "demote":
                index.demote([f"g{i}" for i in step[1]])
            elif kind == "remove":
                index.remove([f"g{step[1]}"])
        assert list(pair[0].groups) == list(pair[1].groups)
        assert {t: list(g) for t, g in pair[0].group_table.by_tenant.items()} == \
            {t: list(g) for t, g in pair[1].group_table.by_tenant.items()}


def test_a_save_after_a_restore_counts_the_read_before_its_own_groups_and_spares_what_was_read() -> None:
    """``put_start(read_lease=…)``: the restore's read is a use before the save (its groups, the held head
    first, then the save's); the lease holds through the put, so its eviction takes an older group; the release
    after it moves nothing."""
    index, _ = make_index(segment_bytes=4 * KB, high_watermark=0.9, low_watermark=0.75)
    for group in "abc":
        index.put_start("host0", [PutRequestItem(f"{group}/0", group, 1, KB)])
        index.put_end([(f"{group}/0", 1)])
    found = index.lookup(["a", "b"], 60.0, held_prefix=1)  # a held, b leased
    index.demote(["b", "a"])  # the order moved since the lookup: a, then b, the least recently used
    assert list(index.groups) == ["a", "b", "c"]
    # the read moves them back, b then a (the held head), before the put: its eviction takes c (not a, were the
    # read counted after it, nor b, which the lease holds)
    outcome, = index.put_start("host0", [PutRequestItem("d/0", "d", 1, KB)], read_lease=found.lease_id)
    assert outcome.status is PutStatus.RESERVED and list(index.groups) == ["b", "a", "d"]
    assert index.counters.evicted_groups == 1 and index.groups["b"].num_leases == 1
    assert index.release_lease(found.lease_id) and list(index.groups) == ["b", "a", "d"]  # nothing moved
    assert index.groups["b"].num_leases == 0
    assert not index.use_lease(found.lease_id)  # ended: unknown


def test_a_release_moves_none_of_the_groups_dropped_since_its_lookup_nor_their_successors() -> None:
    """The held prefix is not leased: it may be removed between a lookup and its release, and a new group of
    the same id saved. The release moves only what its lookup found and the index still holds."""
    index, _ = make_index(segment_bytes=64 * KB)
    for group in "abc":
        index.put_start("host0", [PutRequestItem(f"{group}/0", group, 1, KB)])
        index.put_end([(f"{group}/0", 1)])
    found = index.lookup(["a", "b"], 60.0, held_prefix=1)  # a held, b leased
    assert list(index.groups) == ["c", "b", "a"]
    assert index.remove(["a"]) == (1, [])
    index.put_start("host0", [PutRequestItem("a/0", "a", 1, KB)])  # a new group a, the newest
    index.put_end([("a/0", 2)])
    index.touch(["c"])
    assert list(index.groups) == ["b", "a", "c"]
    assert index.release_lease(found.lease_id)
    assert list(index.groups) == ["a", "c", "b"]  # b moved; the new a is not the a the lookup found


def test_a_tenant_whose_only_group_comes_and_goes_splits_the_table_once() -> None:
    """The first tenant's groups get a dict of their own when a second tenant comes, and keep it after: a
    small tenant saving and losing its one group does not copy the whole order at each return."""
    table = GroupTable()
    for i in range(100):
        table.add(Group(f"a{i}", 1, tenant="a"))
    assert table.one_tenant
    table.add(Group("b0", 1, tenant="b"))
    own = table.by_tenant["a"]
    assert own is not table.groups and list(own) == [f"a{i}" for i in range(100)]
    for i in range(50):
        table.remove(table.groups[f"b{i}"])
        assert table.by_tenant["a"] is own and not table.one_tenant
        table.add(Group(f"b{i + 1}", 1, tenant="b"))
        assert table.by_tenant["a"] is own
    assert list(table.by_tenant["a"]) == [f"a{i}" for i in range(100)] and list(table.by_tenant["b"]) == ["b50"]
