"""Reuse bounds: the trace's block bound and the chunk-granular prefix bound, exact values."""

from __future__ import annotations

import pytest

from kvpool.core.chunk_hash import chunk_hashes
from kvpool.workload.bounds import BoundResult, chunk_prefix_bound, trace_block_bound
from kvpool.workload.tokens import turn_token_ids
from kvpool.workload.weka import Session, Turn


def session(session_id: str, *turns: tuple[int, tuple[int, ...]]) -> Session:
    return Session(
        session_id, 64, 0, 0, tuple(Turn(float(i), n, 1, ids, 0.0) for i, (n, ids) in enumerate(turns))
    )


def test_trace_block_bound_exact() -> None:
    a = session(
        "a",
        (130, (1, 2)),  # first turn: nothing seen; 2-token tail has no id
        (200, (1, 2, 3)),  # 1, 2 seen: 128
        (150, (1, 2, 3)),  # ceil ids: 64 + 64 + partial 22 = 150
        (128, (7, 7)),  # a repeat inside one turn is not "earlier": 0
    )
    b = session("b", (64, (1,)))  # ids are per session: 1 is new here
    assert trace_block_bound([a, b]) == pytest.approx((128 + 150) / (130 + 200 + 150 + 128 + 64))
    assert trace_block_bound([]) == 0.0


def test_bound_counts_the_systems_own_chunk_names() -> None:
    # the bound hashes with the pool's chunk hashing: under the serving namespace
    # a prompt's cached chunks are exactly the groups the pool would name
    namespace = "0123456789abcdef"
    first = list(range(1, 13))
    second = first[:8] + [0, 0, 0, 0]
    result = chunk_prefix_bound([first, second], 4, namespace)
    assert result.hit_tokens == [0, 8]
    pool_names = set(chunk_hashes(namespace, first, 4))
    assert [h in pool_names for h in chunk_hashes(namespace, second, 4)] == [True, True, False]
    # the namespace is the root of the chain, not a salt on the bound's answer
    assert chunk_prefix_bound([first, second], 4).hit_tokens == [0, 8]


def test_chunk_prefix_bound_exact_with_cap() -> None:
    prompts = [
        list(range(1, 11)),  # 10 tokens, cold: 0; inserts [1-4], [1-8]
        list(range(1, 9)),  # both chunks cached, cap (8-1)//4 = 1: 4
        list(range(1, 9)) + [99, 100, 101, 102, 103],  # [1-8] hit, then new: 8; inserts 3 chunks
        [1, 2, 3, 4, 0, 6, 7, 8, 9],  # diverges in chunk 2: 4
        [5, 6, 7, 8, 1, 2, 3, 4],  # chunk content seen but not as a prefix: 0
        [1, 2, 3],  # shorter than a chunk: 0
        list(range(1, 9)) + [99, 100, 101, 102, 103],  # all 3 cached, cap 3: 12
    ]
    result = chunk_prefix_bound(prompts, 4)
    assert result.hit_tokens == [0, 4, 8, 4, 0, 0, 12]
    assert result.total_tokens == 10 + 8 + 13 + 9 + 8 + 3 + 13
    assert result.ratio == pytest.approx(28 / 64)
    assert chunk_prefix_bound([], 4) == BoundResult(0.0, [], 0)
    with pytest.raises(ValueError):
        chunk_prefix_bound(prompts, 0)


def test_prefix_bound_on_trace_tokens_at_block_granularity() -> None:
    # scale 1, chunk = block: a prefix cache hits exactly the leading blocks seen before
    turns = [(128, (1, 2)), (192, (1, 2, 3)), (192, (1, 9, 3))]
    prompts = [turn_token_ids("s", ids, n, 64, 1, 32000) for n, ids in turns]
    result = chunk_prefix_bound(prompts, 64)
    # turn 2: 2 blocks; turn 3: block 1 only (9 breaks the prefix; 3 follows 9 so it is not reused)
    assert result.hit_tokens == [0, 128, 64]
