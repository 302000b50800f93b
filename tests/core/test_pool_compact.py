"""The compact answer's key rule, exactly: what is left out is what a reader derives, and nothing else."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.chunk_hash import group_id, object_key
from kvpool.core.pool.compact import compact_keys, full_keys


def test_a_stage_key_in_its_place_is_left_out_and_any_other_travels_whole() -> None:
    keys = [object_key("ns", "h", stage) for stage in range(4)]
    assert compact_keys(group_id("ns", "h"), keys) == ["", "", "", ""]
    assert compact_keys("ns/h", ["ns/h/1", "ns/h/0", "x", "ns/h/3"]) == ["ns/h/1", "ns/h/0", "x", ""]
    assert full_keys("ns/h", ["ns/h/1", "ns/h/0", "x", ""]) == ["ns/h/1", "ns/h/0", "x", "ns/h/3"]


@given(st.text(min_size=1, max_size=12), st.lists(st.text(min_size=1, max_size=14) | st.integers(0, 5), max_size=6))
def test_full_keys_undoes_compact_keys_for_any_non_empty_keys(group: str, parts: list[str | int]) -> None:
    keys = [f"{group}/{p}" if isinstance(p, int) else p for p in parts]
    compact = compact_keys(group, keys)
    assert full_keys(group, compact) == keys
    assert all(c == "" or c == k for c, k in zip(compact, keys))
