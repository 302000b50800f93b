"""A new group's members placed at once (``PutTable._place_run``: one hole, one run of space given back when the
group goes) decide exactly what placing them one by one decides, whatever the order of the batch's items: the
same statuses, the same groups evicted in the same order, the same segments, bytes and tenants' bytes, the same
store journals. Only where in a segment the bytes lie may differ: with objects of one size (the KV case: holes
are whole objects) that never changes what fits."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.puts import PutTable
from kvpool.core.pool.records import PutRequestItem, PutStatus
from tests.core.fixtures import KB, make_index


@contextmanager
def one_by_one() -> Iterator[None]:
    """Every member placed alone, as before runs (no run is ever found)."""
    with mock.patch.object(PutTable, "_runs", lambda *args: {}):
        yield


def state(index: PoolIndex) -> tuple[object, ...]:
    counters = index.counters
    journals = {sid: [(c.sequence, c.added and c.added.key, c.removed_key) for c in s.journal.pending(1 << 30)]
                for sid, s in index.segments.items()}
    keys = {sid: sorted(k for g in s.groups.values() for k, at in zip(g.keys, g.segment_ids) if at == sid)
            for sid, s in index.segments.items()}
    return (list(index.groups), index.used_bytes, dict(index.group_table.tenant_bytes), sorted(index.objects),
            counters.evicted_groups, counters.evicted_bytes, counters.failed_groups,
            dict(counters.evicted_groups_by_tenant), keys,
            journals, {g: (x.num_committed, x.num_in_flight) for g, x in index.groups.items()},
            list(index.puts.incomplete), sorted(index.puts.in_flight))


# one save: groups of 1-4 members, a tenant each; commit or leave in flight
SAVE = st.lists(st.tuples(st.integers(1, 4), st.sampled_from(["a", "b"]), st.booleans()), min_size=1, max_size=5)
OPS = st.lists(st.one_of(st.tuples(st.just("save"), SAVE), st.tuples(st.just("use"), st.integers(0, 40))),
               min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, weights=st.sampled_from([(), ("a=3",)]), alignment=st.sampled_from([1, 1024]),
       size=st.integers(KB // 2, 6 * KB), order=st.sampled_from(["groups", "stages", "shuffled"]),
       shuffle=st.randoms(use_true_random=False))
def test_placing_a_groups_members_at_once_decides_what_one_by_one_decides(
        ops: list[tuple[str, object]], weights: tuple[str, ...], alignment: int, size: int, order: str,
        shuffle: random.Random) -> None:
    runs, _ = make_index(segment_bytes=40 * KB, segments=2, tenant_weights=list(weights), alignment=alignment)
    alone, _ = make_index(segment_bytes=40 * KB, segments=2, tenant_weights=list(weights), alignment=alignment)
    made = 0
    for op, arg in ops:
        if op == "use":  # a lookup touches (and releases) the arg-th group still there
            for index in (runs, alone):
                ids = list(index.groups)
                if ids:
                    found = index.lookup([ids[arg % len(ids)]])
                    index.release_lease(found.lease_id)
            continue
        items, commits = [], []
        for members, tenant, commit in arg:  # type: ignore[union-attr]
            group = f"g{made}"
            made += 1
            batch = [PutRequestItem(f"{group}/{m}", group, members, size, tenant) for m in range(members)]
            items += batch
            if commit:
                commits += [item.key for item in batch]
        if order == "stages":  # every group's first member, then every second one... (as stage 0 sends a save)
            items.sort(key=lambda item: int(item.key.rsplit("/", 1)[1]))
        elif order == "shuffled":
            shuffle.shuffle(items)
        got = runs.put_start("host0", items)
        with one_by_one():
            expected = alone.put_start("host0", items)
        assert [o.status for o in got] == [o.status for o in expected]
        reserved = {item.key for item, o in zip(items, got) if o.status is PutStatus.RESERVED}
        for index in (runs, alone):
            index.put_end([(key, 7) for key in commits if key in reserved and key in index.puts.in_flight])
        assert state(runs) == state(alone)


def test_a_groups_members_lie_back_to_back_and_go_back_as_one_extent() -> None:
    index, _ = make_index(segment_bytes=40 * KB, segments=1, alignment=1024)
    items = [PutRequestItem(f"g/{m}", "g", 3, KB + m) for m in range(3)]
    outcomes = index.put_start("host0", items)
    assert [o.offset for o in outcomes] == [0, KB, 3 * KB]  # each rounded to the alignment, in order
    allocator = index.segments["seg0"].allocator
    assert allocator.num_allocations == 1 and allocator.allocation_size(0) == 5 * KB  # one allocation, one entry
    index.put_end([(item.key, 7) for item in items])
    index.drop_group("g")
    assert allocator.num_free_extents == 1 and allocator.used_bytes == 0 and index.used_bytes == 0


def test_a_member_taken_out_of_a_run_splits_it_and_the_rest_still_go_back_as_one_extent() -> None:
    index, _ = make_index(segment_bytes=40 * KB, segments=1, alignment=1024)
    items = [PutRequestItem(f"g/{m}", "g", 3, KB + m) for m in range(3)]
    index.put_start("host0", items)
    allocator = index.segments["seg0"].allocator
    index.put_revoke(["g/1"])  # its writer gave up: the run splits, its room alone goes back
    assert "g" in index.groups and [k for k in index.objects] == ["g/0", "g/2"]
    assert allocator.num_allocations == 2 and allocator.used_bytes == 3 * KB
    assert [allocator.allocation_size(o) for o in index.groups["g"].offsets] == [KB, 2 * KB]
    index.put_end([("g/0", 1), ("g/2", 2)])  # the group failed: dropped once nothing is in flight
    assert "g" not in index.groups
    assert allocator.num_free_extents == 1 and allocator.used_bytes == 0 and index.used_bytes == 0
