"""``PoolIndex.evict``: eviction's victims dropped together leave the index exactly as dropping them one at a
time (``drop_group``) does, whatever the groups: keys kept in part or whole, in one segment or across two,
committed, reported by a store, of a tenant with an order of its own or of the only tenant, with an incomplete
group's deadline pending."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.records import ObjectRecord, PutRequestItem
from tests.core.fixtures import KB, make_index, mount
from tests.core.test_put_groups_at_once import state

KINDS = st.lists(st.sampled_from(["part", "whole", "split", "reported", "other"]), min_size=1, max_size=12)


def build(kinds: list[str]) -> PoolIndex:
    """An index of three segments holding a group of each kind, in that order (least recently used first; a
    reported one comes last, with its segment)."""
    index, _ = make_index(segments=2, alignment=64)
    reported: list[ObjectRecord] = []
    for n, kind in enumerate(kinds):
        group, tenant = f"g{n}", "bob" if kind == "other" else "alice"
        if kind == "reported":  # a store's block report: one member here, one in seg1
            reported.append(ObjectRecord(f"{group}/0", group, 2, 4096 + 256 * n, 100, n, tenant))
            continue
        if kind == "whole":  # keys not "<group>/<part>": the group keeps them whole
            keys = [f"{group}-a", f"{group}-b"]
        else:
            keys = [f"{group}/0", f"{group}/1"]
        if kind == "split":  # its members put one at a time, the first segment filled between them
            index.put_start("host0", [PutRequestItem(keys[0], group, 2, 100 + n, tenant)])
            index.put_end([(keys[0], n)])
            index.put_start("host1", [PutRequestItem(keys[1], group, 2, 100 + n, tenant)])
            index.put_end([(keys[1], n + 1)])
            continue
        items = [PutRequestItem(key, group, 2, 100 + n + i, tenant) for i, key in enumerate(keys)]
        index.put_start("host0", items)
        index.put_end([(key, n + i) for i, key in enumerate(keys)])
    if reported:
        mount(index, "seg2", records=reported)
    return index


@settings(max_examples=200, deadline=None)
@given(kinds=KINDS, data=st.data())
def test_victims_dropped_together_leave_what_one_at_a_time_leaves(kinds: list[str], data: st.DataObject) -> None:
    together, alone = build(kinds), build(kinds)
    tenant = data.draw(st.sampled_from(["alice", "bob"]))
    candidates = [g for g in together.groups.values() if g.tenant == tenant and not g.busy]
    if not candidates:
        return
    chosen = data.draw(st.lists(st.sampled_from(candidates), min_size=1, unique_by=lambda g: g.group_id))
    assert state(together) == state(alone)
    together.evict(chosen)
    for group in chosen:
        alone.drop_group(group.group_id)
    assert state(together) == state(alone)
    assert all(g.dropped and g.slot == -1 and not g.ready for g in chosen)


def test_the_kinds_are_what_they_say() -> None:
    index = build(["part", "whole", "split", "reported", "other"])
    groups = index.groups
    assert groups["g0"].keys == ("0", "1") and not groups["g0"].whole and groups["g0"].segment_ids == ("seg0",) * 2
    assert groups["g1"].whole and groups["g1"].keys == ("g1-a", "g1-b")
    assert groups["g2"].segment_ids == ("seg0", "seg1")
    assert groups["g3"].segment_ids == ("seg2",) and not groups["g3"].complete and "g3" in index.puts.incomplete
    assert groups["g4"].tenant == "bob" and set(index.group_table.by_tenant) == {"alice", "bob"}
