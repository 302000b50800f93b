"""Paged MLA attention against an independent dense float64 reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpool.model import InProcessPipeline, ModelConfig, ModelStage, get_config, init_weights, token_slots
from kvpool.model import attention as attention_module
from kvpool.model.kv_cache import KV_DTYPES, kv_layer, read_kv, read_kv_blocks
from tests.model.dense_reference import dense_logits
from tests.model.inputs import max_abs_diff, random_token_ids, scrambled_block_table

TOLERANCE = 1e-4  # float32 against float64


@pytest.mark.parametrize("block_size", [16, 256])
def test_scrambled_pages_match_dense_reference(tiny: ModelConfig, tiny_weights, block_size: int) -> None:
    num_tokens, num_blocks = 300, 4096 // block_size
    token_ids = random_token_ids(tiny, num_tokens)
    model = InProcessPipeline(tiny, num_blocks, block_size, weights=tiny_weights)
    logits = model(token_ids, scrambled_block_table(num_blocks), 0)
    assert logits.shape == (num_tokens, tiny.vocab_size)
    assert max_abs_diff(logits, dense_logits(tiny, tiny_weights, token_ids)) <= TOLERANCE


def test_without_q_lora_matches_dense_reference(tiny: ModelConfig) -> None:
    config = dataclasses.replace(tiny, q_lora_rank=None, num_hidden_layers=2)
    weights = init_weights(config)
    token_ids = random_token_ids(config, 100)
    logits = InProcessPipeline(config, 16, 16, weights=weights)(token_ids, scrambled_block_table(16), 0)
    assert max_abs_diff(logits, dense_logits(config, weights, token_ids)) <= TOLERANCE


@pytest.mark.parametrize("v_head_dim", [16, 32, 48, 96])
def test_every_value_width_matches_dense_reference(tiny: ModelConfig, v_head_dim: int) -> None:
    """v narrower than the rope part or wider than the key is padded; in between, the value is a window
    of [k_nope | v] (qk_head_dim 64 here: 16 and 96 pad, 32 and 48 take the window)."""
    config = dataclasses.replace(tiny, v_head_dim=v_head_dim, num_hidden_layers=2)
    weights = init_weights(config)
    token_ids = random_token_ids(config, 100)
    logits = InProcessPipeline(config, 16, 16, weights=weights)(token_ids, scrambled_block_table(16), 0)
    assert max_abs_diff(logits, dense_logits(config, weights, token_ids)) <= TOLERANCE


def test_decode_steps_match_dense_reference(tiny: ModelConfig, tiny_weights) -> None:
    # one token at a time takes the absorbed path; the prefill takes the expanded one
    token_ids = random_token_ids(tiny, 70)
    model = InProcessPipeline(tiny, 8, 16, weights=tiny_weights)
    table = scrambled_block_table(8)
    steps = [model(token_ids[:64], table, 0)]
    steps += [model(token_ids[i : i + 1], table, i) for i in range(64, 70)]
    assert max_abs_diff(torch.cat(steps), dense_logits(tiny, tiny_weights, token_ids)) <= TOLERANCE


@pytest.mark.parametrize("num_new", [1, 40])
def test_absorbed_attention_equals_expanded(tiny: ModelConfig, tiny_weights, num_new: int) -> None:
    stage = ModelStage(tiny, 0, 1, tiny_weights)
    attention = stage.layers[0].self_attn
    num_cached, block_size = 50, 16
    table = scrambled_block_table(8)
    cache = stage.allocate_kv_cache(8, block_size)
    hidden = torch.randn(num_cached + num_new, tiny.hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(num_cached + num_new)
    attention.forward(hidden[:num_cached], positions[:num_cached], stage.rotary, kv_layer(cache, 0), table, 0)
    new_positions = positions[num_cached:]
    outputs = [
        attention.forward(hidden[num_cached:], new_positions, stage.rotary, kv_layer(cache, 0), table, num_cached, absorb=absorb)
        for absorb in (True, False)
    ]
    assert max_abs_diff(outputs[0], outputs[1]) <= 1e-5


def test_rejects_block_table_too_short(tiny: ModelConfig, tiny_weights) -> None:
    stage = ModelStage(tiny, 0, tiny.num_hidden_layers, tiny_weights)
    cache = stage.allocate_kv_cache(8, 16)
    with pytest.raises(ValueError, match="block_table"):
        stage(random_token_ids(tiny, 40), cache, [0, 1], 0)


def test_rejects_slot_mapping_that_disagrees(tiny: ModelConfig, tiny_weights) -> None:
    stage = ModelStage(tiny, 0, tiny.num_hidden_layers, tiny_weights)
    cache = stage.allocate_kv_cache(8, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        stage(random_token_ids(tiny, 4), cache, [3], 0, slot_mapping=torch.tensor([0, 1, 2, 3]))
    stage(random_token_ids(tiny, 4), cache, [3], 0, slot_mapping=torch.tensor([48, 49, 50, 51]))


def test_query_blocks_match_dense_reference(tiny: ModelConfig, tiny_weights, monkeypatch: pytest.MonkeyPatch) -> None:
    # long prefills go segment by segment; shrink the segment to cover that path cheaply
    monkeypatch.setattr(attention_module, "SEGMENT", 48)
    token_ids = random_token_ids(tiny, 200, seed=2)
    model = InProcessPipeline(tiny, 16, 16, weights=tiny_weights)
    table = scrambled_block_table(16)
    logits = torch.cat([model(token_ids[:130], table, 0), model(token_ids[130:], table, 130)])
    assert max_abs_diff(logits, dense_logits(tiny, tiny_weights, token_ids)) <= TOLERANCE


def test_dsv3_kv_shape_matches_dense_reference() -> None:
    config = dataclasses.replace(get_config("dsv3-kv"), num_hidden_layers=2)
    weights = init_weights(config)
    token_ids = random_token_ids(config, 80, seed=3)
    model = InProcessPipeline(config, 8, 16, weights=weights)
    assert model.kv_caches[0].shape == (8, 2, 16, 576)  # block-major: [blocks, layers, tokens, entry]
    logits = model(token_ids, scrambled_block_table(8), 0)
    assert max_abs_diff(logits, dense_logits(config, weights, token_ids)) <= TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_after_a_prefix_merges_exactly_what_a_mask_computes(dtype: torch.dtype,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # the unmasked prefix and the causal square, merged by log-sum-exp, against one boolean mask
    generator = torch.Generator().manual_seed(5)
    heads, n, cached, dim = 3, 70, 130, 64
    query = torch.randn(heads, n, dim, generator=generator).to(dtype)
    key = torch.randn(heads, cached + n, dim, generator=generator).to(dtype)
    value = torch.randn(heads, cached + n, 32, generator=generator).to(dtype)
    monkeypatch.setattr(attention_module, "SEGMENT", 32)
    merged = attention_module._causal_attention(query, key, value, cached, 0.125)
    monkeypatch.setattr(attention_module, "_FLASH_CPU", None)
    masked = attention_module._causal_attention(query, key, value, cached, 0.125)
    assert merged.dtype == masked.dtype == dtype and merged.shape == (heads, n, 32)
    assert max_abs_diff(merged.float(), masked.float()) <= (1e-6 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", sorted(KV_DTYPES))
@pytest.mark.parametrize("num_tokens", [1, 16, 37, 128])
def test_reading_whole_blocks_equals_reading_slots(tiny: ModelConfig, dtype: str, num_tokens: int) -> None:
    cache = torch.randn(10, 2, 16, tiny.kv_entry_dim).to(KV_DTYPES[dtype])
    table = scrambled_block_table(10)
    layer = kv_layer(cache, 1)
    by_slots = read_kv(layer, token_slots(table, 0, num_tokens, 16), torch.float32)
    assert torch.equal(read_kv_blocks(layer, table, num_tokens, torch.float32), by_slots)
