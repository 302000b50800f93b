"""Seeded weight init and the safetensors round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvpool.model import InProcessPipeline, ModelConfig, ModelStage, init_weights, load_weights, save_weights, weight_shapes
from tests.model.inputs import random_token_ids


def test_seeded_init_is_deterministic(tiny: ModelConfig, tiny_weights) -> None:
    again = init_weights(tiny)
    assert tiny_weights.keys() == again.keys()
    assert all(torch.equal(tiny_weights[name], again[name]) for name in again)
    other_seed = init_weights(dataclasses.replace(tiny, seed=1), ["lm_head.weight"])
    assert not torch.equal(other_seed["lm_head.weight"], tiny_weights["lm_head.weight"])


def test_seeded_init_values_are_pinned(tiny: ModelConfig) -> None:
    # the same on every machine: a change here breaks weights shared across hosts
    w = init_weights(tiny, ["model.layers.0.self_attn.kv_b_proj.weight", "model.norm.weight"])
    kv_b = w["model.layers.0.self_attn.kv_b_proj.weight"].flatten()[:4]
    expected = [-0.010645827278494835, -0.1486034393310547, -0.18796195089817047, -0.022578751668334007]
    assert torch.equal(kv_b, torch.tensor(expected, dtype=torch.float32))
    assert torch.equal(w["model.norm.weight"][:3], torch.tensor([0.9481738805770874, 0.990395724773407, 1.0384706258773804]))


def test_stage_weights_are_a_subset_of_the_model(tiny: ModelConfig, tiny_weights) -> None:
    middle = init_weights(tiny, weight_shapes(tiny, 2, 4))
    assert sorted(middle) == sorted(n for n in tiny_weights if n.startswith(("model.layers.2.", "model.layers.3.")))
    assert all(torch.equal(middle[name], tiny_weights[name]) for name in middle)


def test_safetensors_round_trip(tiny: ModelConfig, tiny_weights, tmp_path: Path) -> None:
    path = save_weights(tmp_path, tiny)
    loaded = load_weights(tmp_path, tiny_weights)
    assert all(torch.equal(loaded[name], tiny_weights[name]) for name in tiny_weights)
    with safe_open(str(path), framework="pt") as f:  # readable by safetensors itself
        assert sorted(f.keys()) == sorted(tiny_weights)
        assert torch.equal(f.get_tensor("lm_head.weight"), tiny_weights["lm_head.weight"])
    token_ids = random_token_ids(tiny, 20)
    from_files = InProcessPipeline(tiny, 2, 16, stage_bounds=[(0, 5), (5, 8)], weights=tmp_path)
    seeded = InProcessPipeline(tiny, 2, 16)
    assert torch.equal(from_files(token_ids, [0, 1], 0), seeded(token_ids, [0, 1], 0))


def test_custom_weights_are_used(tiny: ModelConfig, tiny_weights, tmp_path: Path) -> None:
    changed = dict(tiny_weights, **{"lm_head.weight": torch.zeros(tiny.vocab_size, tiny.hidden_size)})
    save_weights(tmp_path, tiny, changed)
    stage = ModelStage(tiny, 6, 8, tmp_path)
    hidden = torch.randn(3, tiny.hidden_size)
    assert torch.equal(stage(hidden, stage.allocate_kv_cache(1, 16), [0], 0), torch.zeros(3, tiny.vocab_size))


def test_bad_weights_are_rejected(tiny: ModelConfig, tiny_weights, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_weights(tmp_path, ["lm_head.weight"])
    missing = {n: t for n, t in tiny_weights.items() if n != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing"):
        ModelStage(tiny, 0, tiny.num_hidden_layers, missing)
    wrong = dict(tiny_weights, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="shape"):
        save_weights(tmp_path, tiny, wrong)
    save_weights(tmp_path, dataclasses.replace(tiny, num_hidden_layers=2))
    with pytest.raises(ValueError, match="missing"):
        ModelStage(tiny, 0, 4, tmp_path)
