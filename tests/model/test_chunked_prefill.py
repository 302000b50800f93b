"""Prefill in chunks over cached tokens equals one full prefill."""

from __future__ import annotations

from kvpool.model import InProcessPipeline, ModelConfig
from tests.model.inputs import max_abs_diff, random_token_ids, scrambled_block_table

CHUNK = 256


def test_two_chunks_then_rest_equals_full_prefill(tiny: ModelConfig, tiny_weights) -> None:
    token_ids = random_token_ids(tiny, 2 * CHUNK + 190)
    table = scrambled_block_table(64)
    full = InProcessPipeline(tiny, 64, 16, weights=tiny_weights)(token_ids, table, 0)
    chunked_model = InProcessPipeline(tiny, 64, 16, weights=tiny_weights)
    first = chunked_model(token_ids[: 2 * CHUNK], table, 0)
    rest = chunked_model(token_ids[2 * CHUNK :], table, 2 * CHUNK)
    assert max_abs_diff(first, full[: 2 * CHUNK]) <= 1e-4
    assert max_abs_diff(rest, full[2 * CHUNK :]) <= 1e-4
    assert int(rest[-1].argmax()) == int(full[-1].argmax())


def test_chunk_by_chunk_equals_full_prefill(tiny: ModelConfig, tiny_weights) -> None:
    token_ids = random_token_ids(tiny, 3 * CHUNK + 5, seed=4)
    full = InProcessPipeline(tiny, 4, CHUNK, weights=tiny_weights)(token_ids, [2, 0, 3, 1], 0)
    model = InProcessPipeline(tiny, 4, CHUNK, weights=tiny_weights)
    for start in range(0, token_ids.numel(), CHUNK):
        logits = model(token_ids[start : start + CHUNK], [1, 3, 0, 2], start)
        assert max_abs_diff(logits, full[start : start + CHUNK]) <= 1e-4


def test_greedy_generation_continues_from_cache(tiny: ModelConfig, tiny_weights) -> None:
    prompt = random_token_ids(tiny, 100, seed=5)
    fresh = InProcessPipeline(tiny, 16, 16, weights=tiny_weights).generate_greedy(prompt, list(range(16)), 5)
    model = InProcessPipeline(tiny, 16, 16, weights=tiny_weights)
    model(prompt[:64], list(range(16)), 0)
    assert model.generate_greedy(prompt, list(range(16)), 5, num_cached_tokens=64) == fresh
