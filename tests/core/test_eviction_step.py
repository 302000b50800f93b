"""A put batch past the high watermark evicts what keeps it under, then at most ``max_evictions_per_put`` groups
more toward the low one (``Eviction.step``) — exact values. The order is the same LRU order; only where a batch
stops differs, so no one call holds the master for as long as a twentieth of the pool takes to evict."""

from __future__ import annotations

import pytest

from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.records import PutRequestItem, PutStatus
from tests.core.fixtures import KB, make_index

# 100 objects of 1 KiB fill the segment; high 90 of them, low 50
WATERMARKS = {"high_watermark": 0.9, "low_watermark": 0.5}


def put(index: PoolIndex, names: list[str]) -> None:
    items = [PutRequestItem(f"{name}/0", name, 1, KB) for name in names]
    assert [o.status for o in index.put_start("host0", items)] == [PutStatus.RESERVED] * len(items)
    index.put_end([(item.key, 7) for item in items])


def filled(step: int) -> PoolIndex:
    index = make_index(100 * KB, max_evictions_per_put=step, **WATERMARKS)[0]
    for i in range(90):  # one a put: g00 the least recently used (a batch's first item is its most recent)
        put(index, [f"g{i:02d}"])
    assert index.used_bytes == 90 * KB and index.counters.evicted_groups == 0
    return index


def test_a_put_past_high_evicts_what_keeps_it_under_and_at_most_the_step_more() -> None:
    index = filled(step=2)
    put(index, ["new"])  # 91 would pass 90: g00 keeps it under, g01 and g02 are the step
    assert index.counters.evicted_groups == 3
    assert list(index.groups)[:2] == ["g03", "g04"] and index.used_bytes == 88 * KB
    put(index, ["n1", "n2"])  # fits under high: nothing goes
    assert index.counters.evicted_groups == 3 and index.used_bytes == 90 * KB
    put(index, ["n3"])  # passes again: one to stay under, two more
    assert list(index.groups)[:1] == ["g06"] and index.used_bytes == 88 * KB


def test_the_step_is_a_batch_s_not_each_item_s() -> None:
    index = filled(step=2)
    put(index, [f"b{i}" for i in range(5)])  # b0: 1 + 2 evicted (88); b1, b2 fit (90); b3, b4: 1 each
    assert index.counters.evicted_groups == 5 and index.used_bytes == 90 * KB
    assert list(index.groups)[:1] == ["g05"]


@pytest.mark.parametrize("step", [1, 7, 40, 1000])
def test_any_step_evicts_the_same_groups_in_the_same_order_and_never_passes_high(step: int) -> None:
    index = filled(step)
    order = list(index.groups)
    for turn in range(60):
        put(index, [f"t{turn}/{i}" for i in range(3)])
        assert index.used_bytes <= 90 * KB
        gone = [g for g in order if g not in index.groups]
        assert gone == order[:len(gone)]  # least recently used first, whatever the step
    if step >= 40:  # one batch went all the way to the low watermark
        assert index.counters.evicted_groups >= 40


def test_a_step_of_one_million_evicts_to_the_low_watermark_at_once() -> None:
    index = filled(step=1_000_000)
    put(index, ["new"])
    assert index.used_bytes == 50 * KB and index.counters.evicted_groups == 41


def test_a_step_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="max_evictions_per_put must be positive, got 0"):
        make_index(100 * KB, max_evictions_per_put=0)
