"""A lookup by a kept history (``LookupRequest.history``) answers exactly as the same lookup by ids: the same
groups found and leased, the same LRU order after, whatever was evicted, removed, dropped, corrupted or saved
anew since the handle was made."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.pool.histories import HistoryHandles
from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.records import Group, PutRequestItem
from tests.core.fixtures import KB, make_index

IDS = [f"ns/{c:04x}" for c in range(12)]  # one history's chunks, in order


def put(index: PoolIndex, group: str, members: int = 2) -> None:
    items = [PutRequestItem(f"{group}/{m}", group, members, KB) for m in range(members)]
    index.put_start("host0", items)
    index.put_end([(item.key, 7) for item in items])


def test_a_handle_stands_for_its_groups_and_the_rest_are_named() -> None:
    index, _ = make_index(segment_bytes=200 * KB)
    for group in IDS[:8]:
        put(index, group)
    first = index.lookup(IDS[:6], 5.0)
    assert first.num_found == 6 and first.history != 0
    index.release_lease(first.lease_id)
    again = index.lookup(IDS[6:10], 5.0, held_prefix=2, history=first.history, history_len=6)
    assert again.num_found == 8 and [g.group_id for g in again.groups] == IDS[2:8]
    assert again.history not in (0, first.history)
    index.release_lease(again.lease_id)
    # the used handle is gone (the new one stands for the same history and more); one kept is not longer
    assert index.lookup(IDS[6:], 5.0, history=first.history, history_len=6).unknown_history
    assert index.lookup(IDS[9:], 5.0, history=again.history, history_len=9).unknown_history  # longer than kept
    unknown = index.lookup(IDS, 5.0, history=12345, history_len=1)
    assert unknown.unknown_history and unknown.num_found == 0 and unknown.lease_id == 0
    assert len(index.histories) == 1


def test_a_group_saved_anew_under_its_id_is_found_as_the_ids_would_find_it() -> None:
    index, _ = make_index(segment_bytes=200 * KB)
    for group in IDS[:4]:
        put(index, group)
    first = index.lookup(IDS[:4], 5.0)
    index.release_lease(first.lease_id)
    old = index.groups[IDS[1]]
    assert index.remove([IDS[1]]) == (1, [])
    kept = index.histories.get(first.history)
    assert kept is not None and kept[1] is old
    put(index, IDS[1])
    found = index.lookup([], 5.0, history=first.history, history_len=4)
    assert found.num_found == 4 and found.groups[1] is index.groups[IDS[1]] is not old


def test_the_oldest_handles_go_past_the_bound() -> None:
    handles = HistoryHandles(min_groups=5)
    groups = [Group(f"g{i}", 1) for i in range(3)]
    a, b = handles.keep(groups[:2]), handles.keep(groups[:2])
    assert handles.get(a) is not None  # a is now the most recently used
    c = handles.keep(groups)  # 7 > 5: the least recently used (b) goes
    assert handles.get(b) is None and handles.get(a) is not None and handles.get(c) is not None
    assert handles.num_groups == 5 and len(handles) == 2
    assert handles.keep([]) == 0 and handles.keep([Group("x", 1)] * 6) == 0  # nothing, or more than the bound
    d = handles.keep([Group("x", 1)] * 6, live_groups=4)  # an index of 4 groups: up to 8 kept (the oldest go)
    assert d and handles.get(a) is None and handles.get(c) is None and handles.num_groups == 6 == len(handles) * 6


OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 11)),
    st.tuples(st.just("remove"), st.integers(0, 11)),
    st.tuples(st.just("corrupt"), st.integers(0, 11)),
    st.tuples(st.just("lookup"), st.integers(0, 12), st.integers(0, 12), st.integers(0, 4)),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_lookups_by_handle_equal_lookups_by_ids_step_by_step(ops: list[tuple]) -> None:
    by_ids, _ = make_index(segment_bytes=60 * KB)  # small: saves evict
    by_handle, _ = make_index(segment_bytes=60 * KB)
    kept: dict[int, int] = {}  # length of a found prefix -> the handle by_handle returned for it
    for op in ops:
        if op[0] == "put":
            for index in (by_ids, by_handle):
                if IDS[op[1]] not in index.groups:
                    put(index, IDS[op[1]])
        elif op[0] == "remove":
            assert by_ids.remove([IDS[op[1]]]) == by_handle.remove([IDS[op[1]]])
        elif op[0] == "corrupt":  # a reader found it corrupt: hidden, dropped once no lease holds it
            for index in (by_ids, by_handle):
                found = index.lookup([IDS[op[1]]], 5.0)
                index.release_lease(found.lease_id, [IDS[op[1]]] if found.lease_id else [])
        else:
            _, length, handle_len, held = op
            held = min(held, length)
            handle_len = min(handle_len, length)
            expected = by_ids.lookup(IDS[:length], 5.0, held)
            handle = kept.pop(handle_len, 0) if handle_len else 0  # used once: the answer's replaces it
            got = by_handle.lookup(IDS[handle_len:length] if handle else IDS[:length], 5.0, held, handle,
                                   handle_len if handle else 0)
            assert not got.unknown_history
            assert got.num_found == expected.num_found
            assert [g.group_id for g in got.groups] == [g.group_id for g in expected.groups]
            if got.history:
                kept[got.num_found] = got.history
            by_ids.release_lease(expected.lease_id)
            by_handle.release_lease(got.lease_id)
        assert list(by_ids.groups) == list(by_handle.groups)  # the same LRU order, so the same evictions
        assert by_ids.used_bytes == by_handle.used_bytes
