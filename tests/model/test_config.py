"""Registered configs and their KV entry shapes."""

from __future__ import annotations

import dataclasses

import pytest

from kvpool.model import CONFIGS, get_config


def test_dsv3_kv_has_deepseek_v3_entries() -> None:
    for name in ("dsv3-kv", "dsv3-kv-61"):
        config = get_config(name)
        assert (config.kv_lora_rank, config.qk_rope_head_dim, config.kv_entry_dim) == (512, 64, 576)
    assert get_config("dsv3-kv-61").num_hidden_layers == 61


def test_tiny_is_small_and_long() -> None:
    tiny = get_config("tiny")
    assert tiny.kv_entry_dim == 96
    assert tiny.max_position_embeddings >= 16384
    assert tiny.vocab_size <= 1024 and tiny.hidden_size <= 256


def test_registry() -> None:
    assert set(CONFIGS) == {"tiny", "dsv3-kv", "dsv3-kv-61", "dsv3-kv-lean"}
    # the lean one keeps dsv3-kv's KV bytes per token: 8 layers of 576-value entries
    lean, dsv3 = get_config("dsv3-kv-lean"), get_config("dsv3-kv")
    assert (lean.kv_entry_dim, lean.num_hidden_layers) == (dsv3.kv_entry_dim, dsv3.num_hidden_layers) == (576, 8)
    with pytest.raises(ValueError, match="unknown model config"):
        get_config("gpt-2")


def test_invalid_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        dataclasses.replace(get_config("tiny"), qk_rope_head_dim=33)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        dataclasses.replace(get_config("tiny"), kv_lora_rank=0)
