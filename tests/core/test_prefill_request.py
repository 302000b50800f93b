"""A prefill request's life: admit, plan, apply the restore, compute — exact block ids and counts."""

from __future__ import annotations

import pytest

from kvpool.core.prefill.block_manager import BlockManager, NoFreeBlocks
from kvpool.core.chunk_hash import chunk_hashes
from kvpool.core.errors import FailedPrecondition, ResourceExhausted
from kvpool.core.prefill.request import Phase, PrefillRequest, try_admit

NS = "ns"
CHUNK = 4


def request(request_id: str, tokens: list[int]) -> PrefillRequest:
    return PrefillRequest(request_id, len(tokens), CHUNK, chunk_hashes(NS, tokens, CHUNK))


def run_through(req: PrefillRequest, blocks: BlockManager, pool_found: int, restored: list[int]) -> None:
    req.admit(blocks)
    req.plan(pool_found)
    req.apply_restore(restored, blocks)
    req.finish_compute(blocks)


def test_cold_prompt_computes_everything_and_saves_every_full_chunk() -> None:
    blocks = BlockManager(8, CHUNK)
    req = request("a", list(range(10)))  # 2 full chunks + 2 tokens
    req.admit(blocks)
    assert (req.block_table, req.num_device_chunks, req.hit_limit) == ([0, 1, 2], 0, 2)
    assert req.pool_candidates == req.chunk_hashes[:2]
    plan = req.plan(0)
    assert (plan.num_device_chunks, plan.num_pool_chunks) == (0, 0)
    assert req.apply_restore([], blocks) == 0
    assert (req.compute_start, req.save_first_chunk, req.chunks_to_save) == (0, 0, req.chunk_hashes)
    req.finish_compute(blocks)
    assert blocks.cached_block_id(req.chunk_hashes[0]) == 0 and blocks.cached_block_id(req.chunk_hashes[1]) == 1
    assert (req.num_device_tokens, req.num_pool_tokens, req.num_computed_tokens, req.num_pool_chunks_lost) == (
        0, 0, 10, 0)


def test_device_hit_then_pool_hit_then_compute() -> None:
    blocks = BlockManager(8, CHUNK)
    first = request("a", list(range(9)))
    run_through(first, blocks, 0, [])
    blocks.free("a")
    # 5 chunks + 1 token: chunks 0-1 on device; the pool has chunks 2-3; 4 is computed
    second = request("b", list(range(21)))
    second.admit(blocks)
    assert second.num_device_chunks == 2 and second.block_table[:2] == [0, 1]
    assert second.pool_candidates == second.chunk_hashes[2:5]
    plan = second.plan(2)
    assert (plan.num_device_chunks, plan.num_pool_chunks) == (2, 2)
    assert second.restore_targets() == [(2, second.block_table[2]), (3, second.block_table[3])]
    assert second.apply_restore([2, 2, 2, 2], blocks) == 2
    assert (second.compute_start, second.save_first_chunk) == (16, 4)
    assert second.chunks_to_save == second.chunk_hashes[4:]
    assert (second.num_device_tokens, second.num_pool_tokens, second.num_computed_tokens) == (8, 8, 5)
    # restored chunks are device hits for later requests
    assert blocks.match_prefix(second.chunk_hashes) == 4


def test_a_prefix_counts_only_as_far_as_every_stage_restored_it() -> None:
    blocks = BlockManager(8, CHUNK)
    req = request("a", list(range(17)))  # 4 full chunks
    req.admit(blocks)
    req.plan(4)
    assert req.apply_restore([4, 1, 3, 4], blocks) == 1
    assert (req.num_pool_tokens, req.num_pool_chunks_lost, req.compute_start) == (4, 3, 4)
    assert req.chunks_to_save == req.chunk_hashes[1:]
    assert blocks.match_prefix(req.chunk_hashes) == 1  # only the chunk all stages hold
    # a stage that reports more than was planned is clipped to the plan
    other = request("b", [9] * 9)
    other.admit(blocks)
    other.plan(1)
    assert other.apply_restore([5, 5], blocks) == 1


def test_transitions_in_order_only() -> None:
    blocks = BlockManager(4, CHUNK)
    req = request("a", list(range(5)))
    with pytest.raises(FailedPrecondition, match="is new, expected admitted"):
        req.plan(0)
    req.admit(blocks)
    with pytest.raises(FailedPrecondition):
        req.admit(blocks)
    with pytest.raises(FailedPrecondition):
        req.finish_compute(blocks)
    req.plan(0)
    req.apply_restore([], blocks)
    req.finish_compute(blocks)
    assert req.phase is Phase.COMPUTED


def test_admission_waits_then_refuses_past_its_deadline() -> None:
    blocks = BlockManager(2, CHUNK)
    holder = request("a", list(range(8)))
    assert try_admit(holder, blocks, now=0.0, deadline=10.0)
    waiting = request("b", list(range(100, 105)))
    assert not try_admit(waiting, blocks, now=1.0, deadline=10.0)  # wait: nothing changed
    assert waiting.phase is Phase.NEW and blocks.num_free_blocks == 0
    with pytest.raises(ResourceExhausted, match="need 2 free blocks, have 0"):
        try_admit(waiting, blocks, now=10.0, deadline=10.0)
    blocks.free("a")
    assert try_admit(waiting, blocks, now=11.0, deadline=10.0)  # freed in time for this try
    with pytest.raises(NoFreeBlocks):
        request("c", list(range(9))).admit(blocks)


def test_device_hits_the_pool_lost_are_written_back_before_the_computed_chunks() -> None:
    blocks = BlockManager(8, CHUNK)
    run_through(request("a", list(range(17))), blocks, 0, [])  # 4 chunks cached on device
    blocks.free("a")
    req = request("b", list(range(17)))
    req.admit(blocks)
    assert req.num_device_chunks == 4 and req.lookup_candidates == req.chunk_hashes[:4]
    # the pool still has chunk 0 only: chunks 1-3 lost their pool copy
    plan = req.plan_lookup(1)
    assert (plan.num_device_chunks, plan.num_pool_chunks) == (4, 0)
    assert (req.num_device_chunks_in_pool, req.num_write_back_chunks) == (1, 3)
    req.apply_restore([], blocks)
    assert (req.compute_start, req.save_first_chunk) == (16, 1)
    assert req.chunks_to_save == req.chunk_hashes[1:]
    req.finish_compute(blocks)  # re-committing the device hits changes nothing
    assert [blocks.cached_block_id(h) for h in req.chunk_hashes] == [0, 1, 2, 3]


def test_lookup_from_the_head_past_the_device_hit_plans_pool_chunks_and_writes_nothing_back() -> None:
    blocks = BlockManager(8, CHUNK)
    run_through(request("a", list(range(9))), blocks, 0, [])  # chunks 0-1 on device
    blocks.free("a")
    req = request("b", list(range(21)))  # 5 chunks + 1 token
    req.admit(blocks)
    assert req.lookup_candidates == req.chunk_hashes[:5]
    plan = req.plan_lookup(4)  # groups 0-3 complete: 0-1 are the device hits, 2-3 come from the pool
    assert (plan.num_device_chunks, plan.num_pool_chunks, req.num_write_back_chunks) == (2, 2, 0)
    assert req.restore_targets() == [(2, req.block_table[2]), (3, req.block_table[3])]
    req.apply_restore([2, 2], blocks)
    assert (req.save_first_chunk, req.chunks_to_save) == (4, req.chunk_hashes[4:])
    # a lookup that found nothing: both device hits are written back, nothing is restored
    run_through(request("c", list(range(9))), blocks, 0, [])
    late = request("d", list(range(9)))
    late.admit(blocks)
    late.plan_lookup(0)
    assert (late.num_write_back_chunks, late.save_first_chunk) == (2, 0)


def test_plan_without_a_lookup_writes_nothing_back() -> None:
    blocks = BlockManager(8, CHUNK)
    run_through(request("a", list(range(9))), blocks, 0, [])
    req = request("b", list(range(9)))
    req.admit(blocks)
    req.plan(0)
    assert (req.num_write_back_chunks, req.save_first_chunk, req.chunks_to_save) == (0, 2, [])


def test_restore_targets_must_be_private_and_the_save_names_its_blocks() -> None:
    blocks = BlockManager(8, CHUNK)
    req = request("a", list(range(13)))  # 3 full chunks + 1 token
    req.admit(blocks)
    req.plan(2)
    assert req.restore_targets(blocks) == [(0, 0), (1, 1)]
    blocks.hold("other", [1])  # e.g. somebody's save still reading block 1
    with pytest.raises(FailedPrecondition, match=r"restore targets \[1\] are not private"):
        req.restore_targets(blocks)
    req.apply_restore([1], blocks)
    assert (req.save_first_chunk, req.save_block_ids) == (1, [1, 2])
