"""Whole-group eviction against per-object eviction (``IndexSettings.eviction``) — exact values.

Per-object eviction (upstream Mooncake's best-effort groups) can leave a
partial group: a chunk some stages could load and others not, which lookups
never count, so it is a miss that still holds space. Whole-group eviction
never leaves one.
"""

from __future__ import annotations

import random

import pytest

from kvpool.core.pool.index import IndexSettings, PoolIndex
from kvpool.core.pool.records import PutRequestItem, PutStatus
from tests.core.fixtures import KB, make_index

# high 0.75 × 8 KiB = 6 KiB, low 0.5 × 8 KiB = 4 KiB
WATERMARKS = {"high_watermark": 0.75, "low_watermark": 0.5}


def put_group(index: PoolIndex, group_id: str, members: int = 2, size: int = KB) -> None:
    items = [PutRequestItem(f"{group_id}/{m}", group_id, members, size) for m in range(members)]
    assert [o.status for o in index.put_start("host0", items)] == [PutStatus.RESERVED] * members
    index.put_end([(item.key, 7) for item in items])


def partial_groups(index: PoolIndex) -> list[str]:
    """Groups holding some but not all members, none in flight: loadable by only some stages."""
    return [g.group_id for g in index.groups.values() if not g.complete and g.num_in_flight == 0]


def test_group_eviction_drops_whole_groups() -> None:
    index = make_index(8 * KB, eviction="group", **WATERMARKS)[0]
    for name in "abc":
        put_group(index, name)
    put_group(index, "d")  # 6 KiB + 1 KiB passes the high watermark: free down to 4 KiB
    assert list(index.groups) == ["c", "d"]
    assert partial_groups(index) == []
    assert (index.counters.evicted_groups, index.counters.evicted_bytes) == (2, 4 * KB)
    assert index.used_bytes == 4 * KB
    assert [g.group_id for g in index.lookup(["c", "d"]).groups] == ["c", "d"]


def test_object_eviction_leaves_a_partial_group_invisible_to_lookups() -> None:
    index = make_index(8 * KB, eviction="object", **WATERMARKS)[0]
    for name in "abc":
        put_group(index, name)
    put_group(index, "d")  # evicts a/0, a/1, then b/0 alone: used 3 KiB + 1 KiB reaches the low watermark
    assert list(index.groups) == ["b", "c", "d"]
    assert partial_groups(index) == ["b"]
    assert list(index.groups["b"].members) == ["b/1"]
    assert index.exists(["b/0", "b/1"]) == [False, True]
    # only a (emptied) counts as an evicted group; 3 objects' bytes were freed
    assert (index.counters.evicted_groups, index.counters.evicted_bytes) == (1, 3 * KB)
    assert index.used_bytes == 5 * KB  # b/1 still holds space nobody can use
    assert index.lookup(["b", "c"]).groups == []  # a session's prefix stops at the partial chunk
    assert [g.group_id for g in index.lookup(["c", "d"]).groups] == ["c", "d"]


def test_partial_group_whole_again_when_the_missing_member_is_put() -> None:
    index = make_index(8 * KB, eviction="object", **WATERMARKS)[0]
    for name in "abcd":
        put_group(index, name)
    item = PutRequestItem("b/0", "b", 2, KB)
    assert index.put_start("host0", [item])[0].status is PutStatus.RESERVED
    index.put_end([("b/0", 7)])
    assert partial_groups(index) == []
    assert [g.group_id for g in index.lookup(["b"]).groups] == ["b"]


def test_object_eviction_spares_leased_groups() -> None:
    index = make_index(8 * KB, eviction="object", **WATERMARKS)[0]
    for name in "abc":
        put_group(index, name)
    assert index.lookup(["a"]).lease_id == 1  # a is leased (and now most recent): b, then c, go first
    put_group(index, "d")
    assert list(index.groups) == ["c", "a", "d"]
    assert partial_groups(index) == ["c"]
    assert list(index.groups["c"].members) == ["c/1"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_same_puts_partial_groups_only_with_object_eviction(seed: int) -> None:
    """One random workload of 4-member groups (sizes 256 B–1 KiB) under pressure, replayed on both modes."""
    rng = random.Random(seed)
    workload = [(f"g{i}", rng.choice([256, 512, 768, 1024]), rng.random() < 0.3) for i in range(200)]
    seen_partial = {}
    for mode in ("group", "object"):
        index = make_index(16 * KB, eviction=mode, **WATERMARKS)[0]
        count = 0
        for i, (group_id, size, reread) in enumerate(workload):
            put_group(index, group_id, members=4, size=size)
            if reread and i >= 5:
                index.release_lease(index.lookup([workload[i - 5][0]]).lease_id)
            count += len(partial_groups(index))
            assert index.used_bytes <= 16 * KB
        seen_partial[mode] = count
    assert seen_partial["group"] == 0
    assert seen_partial["object"] > 0


def test_eviction_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="eviction must be 'group' or 'object', got 'chunk'"):
        IndexSettings(eviction="chunk")
