"""Restore planner: device → pool → compute, capped so one token is computed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import InvalidArgument
from services.prefill.planner import RestorePlan, plan_restore


def test_pool_hit_capped_at_one_computed_token() -> None:
    # 1000 tokens / 256 → 3 full chunks; device 1, pool 5 → pool capped to 2
    plan = plan_restore(1000, 256, 3, 1, 5)
    assert plan == RestorePlan(num_tokens=1000, chunk_size=256, num_device_chunks=1, num_pool_chunks=2)
    assert (plan.num_device_tokens, plan.num_pool_tokens, plan.num_computed_tokens) == (256, 512, 232)
    assert plan.compute_start == 768
    assert plan.pool_chunk_range == range(1, 3)


def test_chunk_aligned_prompt_recomputes_its_last_chunk() -> None:
    # 512 tokens, both chunks cached on device: only (512 - 1) // 256 = 1 may be a hit
    plan = plan_restore(512, 256, 2, 2, 0)
    assert (plan.num_device_chunks, plan.num_pool_chunks, plan.num_computed_tokens) == (1, 0, 256)
    plan = plan_restore(512, 256, 2, 0, 2)
    assert (plan.num_device_chunks, plan.num_pool_chunks, plan.compute_start) == (0, 1, 256)
    assert plan.pool_chunk_range == range(0, 1)


def test_short_prompts_compute_everything() -> None:
    for num_tokens in (1, 255, 256):
        plan = plan_restore(num_tokens, 256, num_tokens // 256, 1, 1)
        assert (plan.num_device_chunks, plan.num_pool_chunks, plan.compute_start) == (0, 0, 0)
        assert plan.num_computed_tokens == num_tokens
        assert plan.pool_chunk_range == range(0, 0)


def test_no_hit_and_full_hit() -> None:
    plan = plan_restore(128 * 1024 + 7, 256, 512, 0, 0)
    assert (plan.compute_start, plan.num_computed_tokens) == (0, 128 * 1024 + 7)
    plan = plan_restore(128 * 1024 + 7, 256, 512, 300, 212)
    assert (plan.num_device_tokens, plan.num_pool_tokens, plan.num_computed_tokens) == (76_800, 54_272, 7)
    assert plan.pool_chunk_range == range(300, 512)


def test_hits_never_exceed_the_hashed_chunks() -> None:
    plan = plan_restore(1000, 256, 2, 1, 5)
    assert (plan.num_device_chunks, plan.num_pool_chunks, plan.num_cached_tokens) == (1, 1, 512)


@given(
    num_tokens=st.integers(1, 5000),
    chunk_size=st.sampled_from([1, 4, 16, 256]),
    num_device=st.integers(0, 5000),
    num_pool=st.integers(0, 5000),
)
def test_tiers_sum_to_the_prompt(num_tokens: int, chunk_size: int, num_device: int, num_pool: int) -> None:
    num_hashed = num_tokens // chunk_size
    plan = plan_restore(num_tokens, chunk_size, num_hashed, num_device, num_pool)
    assert plan.num_device_tokens + plan.num_pool_tokens + plan.num_computed_tokens == num_tokens
    assert plan.num_computed_tokens >= 1
    assert plan.num_device_chunks == min(num_device, (num_tokens - 1) // chunk_size)
    assert len(plan.pool_chunk_range) == plan.num_pool_chunks
    assert plan.compute_start == plan.pool_chunk_range.stop * chunk_size


def test_rejects_bad_input() -> None:
    with pytest.raises(InvalidArgument):
        plan_restore(0, 256, 0, 0, 0)
    with pytest.raises(InvalidArgument):
        plan_restore(10, 0, 0, 0, 0)
    with pytest.raises(InvalidArgument):
        plan_restore(1000, 256, 3, -1, 0)
    with pytest.raises(InvalidArgument):
        RestorePlan(num_tokens=512, chunk_size=256, num_device_chunks=2, num_pool_chunks=0)
