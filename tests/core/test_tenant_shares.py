"""Tenants' shares of the pool: the rule (``tenancy.shares``) and the index's eviction by it — exact ids.

Groups here are one 1 KiB member each; a 10 KiB segment with both watermarks
at 1.0 gives shares of 10 KiB unless a test sets watermarks.
"""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.core.pool.eviction import Eviction
from kvpool.core.pool.index import IndexSettings, PoolIndex
from kvpool.core.pool.records import ObjectRecord, PutRequestItem, PutStatus
from kvpool.core.tenancy.shares import TenantShares, VictimOrder, parse_weights
from tests.core.fixtures import KB, make_index, mount
from tests.core.test_put_groups_at_once import state

FULL = {"high_watermark": 1.0, "low_watermark": 1.0}


def put(index: PoolIndex, tenant: str, *group_ids: str, size: int = KB, commit: bool = True) -> list[PutStatus]:
    """Each group in a put of its own (one batch would make its tail the older: ``PoolIndex.touch``)."""
    statuses = []
    for group_id in group_ids:
        item = PutRequestItem(f"{group_id}/0", group_id, 1, size, tenant)
        status = index.put_start("host0", [item])[0].status
        if commit and status is PutStatus.RESERVED:
            index.put_end([(item.key, 7)])
        statuses.append(status)
    return statuses


# ---- the rule -------------------------------------------------------------

def test_shares_split_the_capacity_by_weight_among_active_tenants() -> None:
    shares = TenantShares(parse_weights(["alice=3"]))
    assert shares.shares({}, "alice", 100.0) == {"alice": 100.0}  # alone: everything
    assert shares.shares({"alice": 5, "bob": 0}, "bob", 100.0) == {"alice": 75.0, "bob": 25.0}
    assert shares.shares({"alice": 5, "bob": 9, "carol": 1}, "bob", 100.0) == {"alice": 60.0, "carol": 20.0,
                                                                               "bob": 20.0}


def test_victim_order_own_first_when_over_and_any_only_when_within() -> None:
    shares = TenantShares()
    over = shares.victim_order({"a": 50, "b": 10}, "a", 1, 100.0, any_allowed=True)
    assert (over.own, over.then_any, over.shares) == (True, False, {"b": 50.0, "a": 50.0})
    within = shares.victim_order({"a": 49, "b": 10}, "a", 1, 100.0, any_allowed=True)
    assert (within.own, within.then_any) == (False, True)
    assert shares.victim_order({"a": 49}, "a", 1, 100.0, any_allowed=False).then_any is False


def test_most_over_ranks_by_excess_then_name() -> None:
    order = VictimOrder("t", False, True, {"t": 25.0, "a": 25.0, "b": 25.0, "c": 25.0})
    assert TenantShares.most_over(order, {"t": 90, "a": 30, "b": 40, "c": 30}) == ["b", "a", "c"]
    assert TenantShares.most_over(order, {"a": 30, "b": 40, "c": 30}, skip=["b"]) == ["a", "c"]
    assert TenantShares.most_over(order, {"a": 25, "b": 20}) == []


@pytest.mark.parametrize("entry", ["alice", "=2", "alice=0", "alice=-1", "alice=x", "alice=inf", "a" * 65 + "=1"])
def test_bad_weights_are_refused_by_entry(entry: str) -> None:
    with pytest.raises(ValueError, match="tenant_weights"):
        parse_weights([entry])
    with pytest.raises(ValueError, match="tenant_weights"):
        IndexSettings(tenant_weights=[entry])


def test_weights_come_as_text_from_a_flag() -> None:
    assert IndexSettings(tenant_weights="alice=3,bob=1").tenant_weights == ["alice=3", "bob=1"]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="given twice"):
        parse_weights(["a=1", "a=2"])


# ---- the pool -------------------------------------------------------------

def test_a_flooding_tenant_evicts_only_its_own_oldest_groups() -> None:
    index = make_index(10 * KB, **FULL)[0]
    put(index, "alice", "a1", "a2")
    put(index, "flood", *(f"f{i}" for i in range(1, 9)))  # the pool is full: flood holds 8 KiB of a 5 KiB share
    assert put(index, "flood", "f9", "f10") == [PutStatus.RESERVED] * 2
    assert list(index.groups) == ["a1", "a2", "f3", "f4", "f5", "f6", "f7", "f8", "f9", "f10"]
    assert index.counters.evicted_groups_by_tenant == {"flood": 2}
    assert index.tenant_bytes == {"alice": 2 * KB, "flood": 8 * KB}
    # alice's history, though the least recently used, is still whole
    assert [g.group_id for g in index.lookup(["a1", "a2"]).groups] == ["a1", "a2"]


def test_a_tenant_within_its_share_takes_from_the_one_furthest_over() -> None:
    index = make_index(12 * KB, **FULL)[0]
    put(index, "bob", "b1", "b2", "b3", "b4", "b5")
    put(index, "flood", "f1", "f2", "f3", "f4", "f5", "f6", "f7")  # full; with alice, shares of 4 KiB
    assert put(index, "alice", "a1", "a2", "a3", "a4") == [PutStatus.RESERVED] * 4
    # flood 3 KiB over, then 2: its oldest go; at 1 over each, bob before flood by name; then flood again
    assert index.counters.evicted_groups_by_tenant == {"flood": 3, "bob": 1}
    assert list(index.groups) == ["b2", "b3", "b4", "b5", "f4", "f5", "f6", "f7", "a1", "a2", "a3", "a4"]


def test_the_watermarks_free_only_the_tenants_over_their_share() -> None:
    # high 10 KiB × 0.8 = 8 KiB, low 6 KiB: shares are halves of 8 KiB
    index = make_index(10 * KB, high_watermark=0.8, low_watermark=0.6)[0]
    put(index, "alice", "a1", "a2", "a3")
    put(index, "flood", "f1", "f2", "f3", "f4", "f5")  # 8 KiB used: at the high watermark
    put(index, "flood", "f6")  # flood over: its own go down to the low watermark (6 KiB with the put)
    assert list(index.groups) == ["a1", "a2", "a3", "f4", "f5", "f6"]
    put(index, "alice", "a4", "a5")  # alice within (4 KiB + 1 of 4): flood is not over, nothing goes
    assert list(index.groups) == ["a1", "a2", "a3", "f4", "f5", "f6", "a4", "a5"]
    put(index, "alice", "a6")  # now alice is over: her own oldest go, down to 6 KiB, never flood's
    assert list(index.groups) == ["f4", "f5", "f6", "a4", "a5", "a6"]
    assert index.counters.evicted_groups_by_tenant == {"flood": 3, "alice": 3}


def test_a_tenant_over_its_share_with_nothing_to_give_gets_no_space() -> None:
    index = make_index(4 * KB, **FULL)[0]
    put(index, "alice", "a1", "a2")
    put(index, "flood", "f1", "f2")
    lease = index.lookup(["f1", "f2"]).lease_id
    assert put(index, "flood", "f3") == [PutStatus.NO_SPACE]  # its own are leased; alice is within her share
    assert list(index.groups) == ["a1", "a2", "f2", "f1"]  # a lookup touches its tail first
    index.release_lease(lease)
    assert put(index, "flood", "f3") == [PutStatus.RESERVED]
    assert list(index.groups) == ["a1", "a2", "f1", "f3"]


def test_a_tenant_within_its_share_falls_back_to_global_lru_when_no_one_over_can_give() -> None:
    index = make_index(6 * KB, **FULL)[0]
    put(index, "bob", "b1")
    put(index, "flood", "f1", "f2", "f3", "f4", "f5")  # share 3 KiB (bob, flood): 2 KiB over
    lease = index.lookup(["f1", "f2", "f3", "f4", "f5"]).lease_id
    assert put(index, "alice", "a1") == [PutStatus.RESERVED]  # flood's are leased: the global LRU's b1 goes
    assert list(index.groups) == ["f5", "f4", "f3", "f2", "f1", "a1"]
    index.release_lease(lease)


def test_a_group_is_its_first_writers_and_a_report_brings_its_tenant_back() -> None:
    index = make_index(10 * KB, **FULL)[0]
    for key, tenant in (("g/0", "alice"), ("g/1", "mallory")):
        assert index.put_start("host0", [PutRequestItem(key, "g", 2, KB, tenant)])[0].status is PutStatus.RESERVED
        index.put_end([(key, 7)])
    assert index.groups["g"].tenant == "alice"
    assert index.tenant_bytes == {"alice": 2 * KB}
    records = [c.added for c in index.heartbeat("seg0")[0] if c.added is not None]
    assert [(r.key, r.tenant) for r in records] == [("g/0", "alice"), ("g/1", "alice")]
    restarted = PoolIndex(IndexSettings(alignment=1, **FULL))
    mount(restarted, "seg0", records=records, size=10 * KB)
    assert restarted.groups["g"].tenant == "alice" and restarted.tenant_bytes == {"alice": 2 * KB}
    # an old store's record names no tenant: the default tenant's
    other = PoolIndex(IndexSettings(alignment=1, **FULL))
    mount(other, "seg0", records=[ObjectRecord("h/0", "h", 1, 0, KB, 7)], size=10 * KB)
    assert other.tenant_bytes == {"default": KB}


def test_the_ledger_follows_every_way_a_group_leaves() -> None:
    index, clock = make_index(10 * KB, put_timeout_s=1.0, **FULL)
    put(index, "alice", "a1", "a2")
    put(index, "bob", "b1", commit=False)
    index.remove(["a1"])
    clock.now += 2
    index.revoke_expired_puts()
    assert index.tenant_bytes == {"alice": KB}
    assert {t: list(g) for t, g in index.group_table.by_tenant.items()} == {"alice": ["a2"]}
    index.unmount_segment("seg0")
    assert index.tenant_bytes == {} and index.group_table.by_tenant == {}


def test_a_lone_tenant_of_unaligned_objects_evicts_at_the_watermark() -> None:
    """Objects of 65 bytes take 128 (the alignment's room). A tenant's bytes count that room, as the segments'
    used bytes do: alone in the pool, its share is everything under the high watermark, and its puts past the
    watermark evict its oldest groups there, down toward the low one (counting the objects' own sizes, it stayed
    within its share until the pool was full, and then evicted a group for each put that found no room)."""
    index = make_index(64 * KB, alignment=64, high_watermark=0.9, low_watermark=0.85)[0]
    for i in range(700):  # 1.4 times the pool's room
        assert put(index, "default", f"g{i}", size=65) == [PutStatus.RESERVED]
        assert index.used_bytes <= 0.9 * index.capacity
        assert index.tenant_bytes == {"default": index.used_bytes}
    assert index.counters.evicted_groups > 0 and index.counters.evicted_bytes == 128 * index.counters.evicted_groups


# ---- the invariant under random steps -------------------------------------

TENANTS = ("alice", "bob", "flood")


class TenantEvictionMachine(RuleBasedStateMachine):
    """Random puts (the flooder puts most), leases and removals on a small pool, of objects whose sizes are not
    aligned (each takes its size rounded up to 64 bytes: its room, what shares count).

    After every put of tenant T: a tenant U != T that lost a group was over its
    share before the put, unless T was within its own (with the put).
    """

    # groups a put may evict toward the low watermark past its own room (the default's never binds here)
    step = 256

    def __init__(self) -> None:
        super().__init__()
        self.index = make_index(16 * KB, high_watermark=0.9, low_watermark=0.7, alignment=64,
                                tenant_weights=["alice=2"], max_evictions_per_put=self.step)[0]
        self.next_id = 0
        self.leases: list[int] = []

    @rule(tenant=st.sampled_from(TENANTS + ("flood", "flood")), size=st.integers(1, 3), commit=st.booleans())
    def put(self, tenant: str, size: int, commit: bool) -> None:
        index = self.index
        before = {g.group_id: g.tenant for g in index.groups.values()}
        usage = dict(index.tenant_bytes)
        nbytes = size * KB // 2 - 7  # (its room: size * KB // 2)
        shares = index.shares.shares(usage, tenant, index.share_capacity)
        within = usage.get(tenant, 0) + index.room(nbytes) <= shares[tenant]
        self.next_id += 1
        put(index, tenant, f"g{self.next_id}", size=nbytes, commit=commit)
        for group_id, owner in before.items():
            if group_id not in index.groups and owner != tenant:
                assert within or usage[owner] > shares[owner], (tenant, owner, usage, shares)

    @rule(data=st.data())
    def lease(self, data: st.DataObject) -> None:
        if self.index.groups:
            group_id = data.draw(st.sampled_from(list(self.index.groups)))
            lease_id = self.index.lookup([group_id]).lease_id
            if lease_id:
                self.leases.append(lease_id)

    @rule()
    def release(self) -> None:
        if self.leases:
            self.index.release_lease(self.leases.pop(0))

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        if self.index.groups:
            self.index.remove([data.draw(st.sampled_from(list(self.index.groups)))])

    @invariant()
    def ledger_mirrors_the_index(self) -> None:
        index = self.index
        for tenant in TENANTS:
            assert list(index.tenant_groups(tenant)) == [g for g, grp in index.groups.items() if grp.tenant == tenant]
        sizes: dict[str, int] = {}
        for obj in index.objects.values():
            sizes[obj.tenant] = sizes.get(obj.tenant, 0) + index.room(obj.size)
        assert index.tenant_bytes == sizes
        assert sum(sizes.values()) == index.used_bytes


TenantEvictionMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_tenant_eviction_machine = TenantEvictionMachine.TestCase


class TenantEvictionStepMachine(TenantEvictionMachine):
    """The same, with a put evicting at most one group toward the low watermark past its own room, so the step
    binds on nearly every put past the high one: the rule of shares holds whatever the step."""

    step = 1


TenantEvictionStepMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_tenant_eviction_step_machine = TenantEvictionStepMachine.TestCase


class OnePassEvictionMachine(RuleBasedStateMachine):
    """``Eviction.make_room`` evicts the putting tenant's own groups in one pass over their order
    (``_evict_run``): the same victims, in the same order, as its loop of one eviction a call. Two indexes take
    the same random puts (several groups at once, some left in flight), leases, releases and removals, of one
    tenant or several, with a step that binds or not; one evicts by the loop alone. After every step the two are
    the same index."""

    step = 256  # groups a put may evict toward the low watermark past its own room

    def __init__(self) -> None:
        super().__init__()
        kwargs = dict(high_watermark=0.9, low_watermark=0.7, alignment=64, tenant_weights=["alice=2"])
        self.fast = make_index(16 * KB, max_evictions_per_put=self.step, **kwargs)[0]  # type: ignore[arg-type]
        self.loop = make_index(16 * KB, max_evictions_per_put=self.step, **kwargs)[0]  # type: ignore[arg-type]
        self.next_id = 0
        self.leases: list[tuple[int, int]] = []

    def both(self, call: str, *args: object) -> None:
        """The call on each: the loop's index with ``_evict_run`` doing nothing, so its loop evicts each group."""
        want = getattr(self.fast, call)(*args)
        with mock.patch.object(Eviction, "_evict_run", lambda *_: False):
            got = getattr(self.loop, call)(*args)
        assert _same(want, got)
        assert _state(self.fast) == _state(self.loop)

    @rule(tenant=st.sampled_from(("default", "default", "default", "alice", "bob")), count=st.integers(1, 4),
          size=st.integers(1, 3), commit=st.booleans())
    def put(self, tenant: str, count: int, size: int, commit: bool) -> None:
        items = []
        for _ in range(count):
            self.next_id += 1
            items.append(PutRequestItem(f"g{self.next_id}/0", f"g{self.next_id}", 1, size * KB // 2 - 7, tenant))
        self.both("put_start", "host0", items)
        if commit:
            self.both("put_end", [(item.key, 7) for item in items if item.key in self.fast.puts.in_flight])

    @rule(data=st.data())
    def lease(self, data: st.DataObject) -> None:
        if self.fast.groups:
            group_id = data.draw(st.sampled_from(list(self.fast.groups)))
            a, b = self.fast.lookup([group_id], 60.0), self.loop.lookup([group_id], 60.0)
            assert (a.lease_id, a.num_found) == (b.lease_id, b.num_found)
            if a.lease_id:
                self.leases.append((a.lease_id, b.lease_id))

    @rule()
    def release(self) -> None:
        if self.leases:
            a, b = self.leases.pop(0)
            assert self.fast.release_lease(a) == self.loop.release_lease(b)

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        if self.fast.groups:
            self.both("remove", [data.draw(st.sampled_from(list(self.fast.groups)))])


def _same(a: object, b: object) -> bool:
    if isinstance(a, list):
        return [(o.status, o.segment and o.segment.segment_id, o.offset) if hasattr(o, "status") else o
                for o in a] == [(o.status, o.segment and o.segment.segment_id, o.offset)
                                if hasattr(o, "status") else o for o in b]  # type: ignore[union-attr]
    return repr(a) == repr(b)


def _state(index: PoolIndex) -> tuple:
    return state(index), index.counters.evicted_groups_by_tenant, dict(index.tenant_bytes)


OnePassEvictionMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
test_one_pass_eviction_machine = OnePassEvictionMachine.TestCase


class OnePassEvictionStepMachine(OnePassEvictionMachine):
    """The same with a step that binds (one group past a put's own room)."""

    step = 1


OnePassEvictionStepMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
test_one_pass_eviction_step_machine = OnePassEvictionStepMachine.TestCase
