"""Hit planner: device → pool → compute, capped so one token is computed; one stage's share of a restore."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.errors import InvalidArgument
from kvpool.core.prefill.planner import (
    RestorePlan,
    chunks_that_fit,
    leading_count,
    plan_restore,
)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # (num_tokens, chunk_size, hashed, device, pool) -> (device chunks, pool chunks, computed tokens)
        ((1000, 256, 3, 1, 5), (1, 2, 232)),  # pool capped by the hashed chunks and the one-token rule
        ((1000, 256, 3, 0, 1), (0, 1, 744)),  # the pool serves only what it found
        ((1000, 256, 3, 3, 0), (3, 0, 232)),  # all hashed chunks on device: 1000 - 768
        ((512, 256, 2, 2, 0), (1, 0, 256)),  # chunk-aligned: the last chunk is recomputed
        ((512, 256, 2, 0, 2), (0, 1, 256)),  # ... from the pool too
        ((512, 256, 2, 1, 1), (1, 0, 256)),  # device takes the one allowed chunk, none left for the pool
        ((257, 256, 1, 0, 1), (0, 1, 1)),
        ((256, 256, 1, 1, 1), (0, 0, 256)),  # one chunk exactly: nothing may be a hit
        ((128 * 1024 + 7, 256, 512, 300, 212), (300, 212, 7)),
        ((128 * 1024 + 7, 256, 512, 300, 500), (300, 212, 7)),  # pool capped at the hashed chunks
        ((1000, 256, 2, 1, 5), (1, 1, 488)),  # fewer hashed chunks than the prompt has (caller's limit)
    ],
)
def test_plan(args: tuple[int, int, int, int, int], expected: tuple[int, int, int]) -> None:
    plan = plan_restore(*args)
    assert (plan.num_device_chunks, plan.num_pool_chunks, plan.num_computed_tokens) == expected
    device, pool, _ = expected
    assert plan.pool_chunk_range == range(device, device + pool)
    assert plan.compute_start == (device + pool) * args[1]


def oracle(num_tokens: int, chunk_size: int, hashed: int, device: int, pool: int) -> tuple[int, int]:
    """Walk the prompt chunk by chunk: device first, then pool, while a token is left to compute."""
    num_device = num_pool = 0
    for chunk in range(hashed):
        if (chunk + 1) * chunk_size >= num_tokens:
            break  # taking this chunk would leave no token to compute
        if chunk < device and num_pool == 0:
            num_device += 1
        elif chunk - num_device < pool:
            num_pool += 1
        else:
            break
    return num_device, num_pool


@given(
    num_tokens=st.integers(1, 3000),
    chunk_size=st.sampled_from([1, 3, 16, 256]),
    device=st.integers(0, 3000),
    pool=st.integers(0, 3000),
)
def test_plan_matches_a_chunk_by_chunk_walk(num_tokens: int, chunk_size: int, device: int, pool: int) -> None:
    hashed = num_tokens // chunk_size
    plan = plan_restore(num_tokens, chunk_size, hashed, device, pool)
    assert (plan.num_device_chunks, plan.num_pool_chunks) == oracle(num_tokens, chunk_size, hashed, device, pool)
    assert plan.num_device_tokens + plan.num_pool_tokens + plan.num_computed_tokens == num_tokens


def test_rejects_bad_input() -> None:
    with pytest.raises(InvalidArgument):
        plan_restore(0, 256, 0, 0, 0)
    with pytest.raises(InvalidArgument):
        plan_restore(10, 0, 0, 0, 0)
    with pytest.raises(InvalidArgument):
        plan_restore(1000, 256, 3, -1, 0)
    with pytest.raises(InvalidArgument, match="no token to compute"):
        RestorePlan(num_tokens=512, chunk_size=256, num_device_chunks=2, num_pool_chunks=0)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((10, 1000, 10_000, 1), 10),  # room for all
        ((10, 1000, 9_999, 1), 9),  # one short: restore fewer, compute the rest
        ((10, 1000, 0, 1), 0),
        ((4, 1000, 4096, 4096), 4),  # 4000 rounds up to 4096: fits
        ((5, 1000, 8191, 4096), 4),  # 5000 rounds to 8192 > 8191: only 4 (4096)
        ((3, 1000, 2048, 4096), 0),  # even one chunk rounds to 4096
        ((0, 1000, 10_000, 1), 0),
    ],
)
def test_chunks_that_fit(args: tuple[int, int, int, int], expected: int) -> None:
    assert chunks_that_fit(*args) == expected


def test_leading_count() -> None:
    assert leading_count([True, True, False, True]) == 2
    assert leading_count([False, True]) == 0
    assert leading_count([]) == 0
    assert leading_count(iter([True, True, True])) == 3
