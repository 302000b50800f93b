"""Running the model as pipeline stages equals running it whole."""

from __future__ import annotations

import pytest
import torch

from kvpool.model import InProcessPipeline, ModelConfig, ModelStage, split_layers
from tests.model.inputs import max_abs_diff, random_token_ids, scrambled_block_table


def test_split_layers() -> None:
    assert split_layers(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_layers(61, 1) == [(0, 61)]
    with pytest.raises(ValueError):
        split_layers(4, 5)


def test_four_stages_equal_whole_model(tiny: ModelConfig, tiny_weights) -> None:
    token_ids = random_token_ids(tiny, 400)
    table = scrambled_block_table(32)
    whole = InProcessPipeline(tiny, 32, 16, weights=tiny_weights)
    staged = InProcessPipeline(tiny, 32, 16, stage_bounds=split_layers(tiny.num_hidden_layers, 4), weights=tiny_weights)
    assert [s.num_layers for s in staged.stages] == [2, 2, 2, 2]
    for start, end in [(0, 300), (300, 400)]:
        assert max_abs_diff(staged(token_ids[start:end], table, start), whole(token_ids[start:end], table, start)) <= 1e-5
    # each stage's cache holds exactly its layers of the whole model's cache
    assert torch.equal(torch.cat(staged.kv_caches, dim=1), whole.kv_caches[0])


def test_seeded_stages_agree_with_seeded_whole_model(tiny: ModelConfig) -> None:
    # no weights passed: every stage seeds its own layers, as on separate workers
    token_ids = random_token_ids(tiny, 50)
    whole = InProcessPipeline(tiny, 4, 16)(token_ids, [0, 1, 2, 3], 0)
    staged = InProcessPipeline(tiny, 4, 16, stage_bounds=[(0, 3), (3, 4), (4, 8)])(token_ids, [0, 1, 2, 3], 0)
    assert max_abs_diff(whole, staged) <= 1e-5


def test_stage_roles(tiny: ModelConfig, tiny_weights) -> None:
    first, middle, last = (ModelStage(tiny, a, b, tiny_weights) for a, b in [(0, 2), (2, 5), (5, 8)])
    assert (first.is_first, first.is_last, middle.is_first, middle.is_last, last.is_last) == (
        True, False, False, False, True,
    )
    caches = [s.allocate_kv_cache(2, 16) for s in (first, middle, last)]
    hidden = first(random_token_ids(tiny, 10), caches[0], [1], 0)
    assert hidden.shape == (10, tiny.hidden_size)
    hidden = middle(hidden, caches[1], [1], 0)
    assert hidden.shape == (10, tiny.hidden_size)
    assert last(hidden, caches[2], [1], 0).shape == (10, tiny.vocab_size)
    with pytest.raises(ValueError, match="hidden states"):
        middle(random_token_ids(tiny, 10), caches[1], [1], 0)
    with pytest.raises(ValueError, match="kv_cache"):
        middle(hidden, caches[0], [1], 0)  # first stage's cache has 2 layers, middle needs 3
    with pytest.raises(ValueError, match="layer_start"):
        ModelStage(tiny, 4, 4)
