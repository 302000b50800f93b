"""Pack KV chunks out of pages, unpack into other pages, continue: same output.

Measured (tiny, 512 restored tokens + 190 new, token seed 0) against a
float32 full prefill, max |logit diff| over the 190 new tokens: float32
cache 0.0; bfloat16 cache 3.9e-3; float8 e4m3 cache 7.1e-2 (logits have std
~1, max ~4.5). Over token seeds 0-7 the worst was 4.5e-3 (bf16) and 7.4e-2
(fp8); the bounds below are ~2x that. The greedy token matched at every
position for bf16 and differed at 2-7 of 190 positions for fp8.
In every dtype a restored cache gives exactly the logits of the same chunked
prefill without the detour through the pool: pack/unpack moves bytes only."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.model import (
    InProcessPipeline,
    ModelConfig,
    allocate_kv_cache,
    get_config,
    kv_chunk_nbytes,
    kv_dtype,
    pack_kv,
    split_layers,
    unpack_kv,
)
from tests.model.inputs import max_abs_diff, random_token_ids, scrambled_block_table

CHUNK = 256
NUM_BLOCKS, BLOCK_SIZE = 64, 16
RESTORE_BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float8_e4m3fn: 0.15}


def restore_then_continue(
    config: ModelConfig, weights, token_ids: torch.Tensor, num_restored: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of token_ids[num_restored:] after a pool round trip, and without one."""
    bounds = split_layers(config.num_hidden_layers, 2)
    source = InProcessPipeline(config, NUM_BLOCKS, BLOCK_SIZE, dtype, bounds, weights)
    source_table = list(range(NUM_BLOCKS))
    source(token_ids[:num_restored], source_table, 0)
    target = InProcessPipeline(config, NUM_BLOCKS, BLOCK_SIZE, dtype, bounds, weights)
    target_table = scrambled_block_table(NUM_BLOCKS, seed=7)
    for stage, source_cache, target_cache in zip(source.stages, source.kv_caches, target.kv_caches):
        for start in range(0, num_restored, CHUNK):
            chunk = pack_kv(source_cache, source_table, start, start + CHUNK)
            assert chunk.numel() == kv_chunk_nbytes(config, stage.num_layers, CHUNK, dtype)
            unpack_kv(target_cache, target_table, start, chunk)
    restored = target(token_ids[num_restored:], target_table, num_restored)
    # same chunked prefill, KV never leaving its pages
    not_moved = source(token_ids[num_restored:], source_table, num_restored)
    return restored, not_moved


@pytest.mark.parametrize("dtype", list(RESTORE_BOUNDS))
def test_restored_kv_continues_like_scratch(tiny: ModelConfig, tiny_weights, dtype: torch.dtype) -> None:
    token_ids = random_token_ids(tiny, 2 * CHUNK + 190)
    scratch = InProcessPipeline(tiny, NUM_BLOCKS, BLOCK_SIZE, weights=tiny_weights)(token_ids, list(range(NUM_BLOCKS)), 0)
    restored, not_moved = restore_then_continue(tiny, tiny_weights, token_ids, 2 * CHUNK, dtype)
    assert torch.equal(restored, not_moved)
    assert max_abs_diff(restored, scratch[2 * CHUNK :]) <= RESTORE_BOUNDS[dtype]
    if dtype == torch.float32:
        assert int(restored[-1].argmax()) == int(scratch[-1].argmax())


def test_chunk_nbytes() -> None:
    assert kv_chunk_nbytes(get_config("tiny"), 2, 256, torch.float32) == 2 * 256 * 96 * 4
    dsv3 = get_config("dsv3-kv-61")
    assert kv_chunk_nbytes(dsv3, 61, 1, torch.float8_e4m3fn) == 61 * 576
    assert kv_chunk_nbytes(dsv3, 61, 256, torch.bfloat16) == 61 * 256 * 576 * 2


def test_cache_dtypes(tiny: ModelConfig) -> None:
    assert kv_dtype("float8_e4m3fn") is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv cache dtype"):
        allocate_kv_cache(tiny, 1, 1, 16, torch.float16)
    with pytest.raises(ValueError, match="unknown kv dtype"):
        kv_dtype("int4")


def test_packed_layout_is_layer_major(tiny: ModelConfig) -> None:
    cache = allocate_kv_cache(tiny, 3, 4, 2, torch.float32)
    cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view_as(cache))
    table = [2, 0]  # tokens 0-1 in block 2, tokens 2-3 in block 0
    packed = pack_kv(cache, table, 1, 3)
    expected = torch.stack([torch.stack([cache[2, layer, 1], cache[0, layer, 0]]) for layer in range(3)])
    assert torch.equal(packed, expected.contiguous().view(torch.uint8).view(-1))


def test_pack_into_out_and_unpack_from_bytes(tiny: ModelConfig) -> None:
    cache = allocate_kv_cache(tiny, 2, 8, 16, torch.bfloat16)
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(2)))
    out = torch.empty(kv_chunk_nbytes(tiny, 2, 32, torch.bfloat16), dtype=torch.uint8)
    assert pack_kv(cache, [5, 1, 7], 16, 48, out=out) is out
    target = allocate_kv_cache(tiny, 2, 8, 16, torch.bfloat16)
    unpack_kv(target, [0, 3, 6], 16, bytes(out.tolist()))
    assert torch.equal(target[[3, 6]], cache[[1, 7]])
    with pytest.raises(ValueError, match="bytes"):
        pack_kv(cache, [5, 1, 7], 16, 48, out=out[:-1])
    with pytest.raises(ValueError, match="whole number"):
        unpack_kv(target, [0, 3, 6], 16, out[:-1])
    with pytest.raises(ValueError, match="block_table"):
        unpack_kv(target, [0, 3], 16, out)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]),
    block_size=st.sampled_from([1, 4, 16]),
    data=st.data(),
)
def test_unpack_inverts_pack(dtype: torch.dtype, block_size: int, data: st.DataObject) -> None:
    config = get_config("tiny")
    num_blocks = 12
    start = data.draw(st.integers(0, num_blocks * block_size - 1))
    end = data.draw(st.integers(start + 1, num_blocks * block_size))
    source_table = data.draw(st.permutations(range(num_blocks)))
    target_table = data.draw(st.permutations(range(num_blocks)))
    source = allocate_kv_cache(config, 2, num_blocks, block_size, dtype)
    source.copy_(torch.randn(source.shape, generator=torch.Generator().manual_seed(start)))
    target = allocate_kv_cache(config, 2, num_blocks, block_size, dtype)
    unpack_kv(target, target_table, start, pack_kv(source, source_table, start, end))
    assert torch.equal(pack_kv(target, target_table, start, end).view(-1), pack_kv(source, source_table, start, end))
