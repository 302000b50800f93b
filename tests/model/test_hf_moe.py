"""DeepSeek-V3's MoE layers from a directory written by transformers' ``save_pretrained``: kvpool's logits and greedy
tokens equal transformers' ``DeepseekV3ForCausalLM`` (eager, float32) whole, split over four pipeline stages, and on
a second turn whose first turn's KV came back from the pool's bytes; an FP8 directory equals its dequantized
reference the same way.

Every directory has four layers, MoE from layer 1 or 2, random router biases; the cases vary the seed, the rope
layout, YaRN, the groups, ``norm_topk_prob``, the shared experts and ``q_lora_rank``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpool.model import InProcessPipeline, ModelConfig, pack_kv, split_layers, unpack_kv
from kvpool.model.hf_checkpoint import checked_model_dir
from kvpool.tokenizer import HFTokenizer
from tests.model.hf_directory import YARN, dequantized_copy, load_reference, quantize_fp8, words, write_hf_directory
from tests.model.inputs import max_abs_diff

NUM_LAYERS = 4
NUM_BLOCKS, BLOCK_SIZE = 16, 16
NEW_TOKENS = 12
TOLERANCE = 1e-4  # the dense directory test's (tests/model/test_hf_directory.py)
CASES: dict[str, dict[str, Any]] = {
    # DeepSeek-V3's shape: interleaved RoPE with its YaRN, 4 groups of which 2 are kept, MoE from layer 1
    "seed0-v3": {"seed": 0, "moe": {}},
    # rotate-half, MoE from layer 2, one group of 4 kept of 2, weights not renormalized, two shared experts
    "seed1-rotate-half": {"seed": 1, "rope_interleave": False,
                          "moe": {"first_k_dense_replace": 2, "n_group": 2, "topk_group": 1, "norm_topk_prob": False,
                                  "n_shared_experts": 2, "routed_scaling_factor": 1.0}},
    # YaRN's cos/sin factor at work, no q_lora_rank, 3 experts a token from one group of 8
    "seed2-yarn-cos-sin": {"seed": 2, "rope": {**YARN, "mscale_all_dim": 0}, "q_lora_rank": None,
                           "moe": {"num_experts_per_tok": 3, "n_group": 1, "topk_group": 1}},
    # plain RoPE, interleaved, MoE from layer 2
    "seed3-plain-rope": {"seed": 3, "rope": {"rope_type": "default", "rope_theta": 10000.0},
                         "moe": {"first_k_dense_replace": 2}},
}
# a prompt of words (ids 4..63: never the pad id transformers' generate would mask out)
PROMPT = list(range(30, 64)) + list(range(4, 30))


def moe_directory(tmp_path: Path, case: str) -> Path:
    return write_hf_directory(tmp_path / case, num_layers=NUM_LAYERS, **CASES[case])


def prompt_ids(path: Path, word_ids: list[int]) -> torch.Tensor:
    return torch.tensor(HFTokenizer(path).encode(words(word_ids)))


def transformers_greedy(reference, prompt: torch.Tensor) -> list[int]:  # type: ignore[no-untyped-def]
    ids = reference.generate(prompt.unsqueeze(0), attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=1)
    return ids[0, prompt.numel():].tolist()  # type: ignore[no-any-return]


def check_equals_transformers(config: ModelConfig, weights: Path, reference_dir: Path, stages: int) -> None:
    """Logits and greedy tokens of kvpool over ``stages`` pipeline stages against transformers on reference_dir."""
    reference = load_reference(reference_dir)
    prompt = prompt_ids(reference_dir, PROMPT * 2)  # 120 tokens
    bounds = split_layers(config.num_hidden_layers, stages)
    table = list(range(NUM_BLOCKS))
    with torch.inference_mode():
        ours = InProcessPipeline(config, NUM_BLOCKS, BLOCK_SIZE, stage_bounds=bounds, weights=str(weights))
        assert max_abs_diff(ours.forward(prompt, table, 0), reference(prompt.unsqueeze(0)).logits[0]) < TOLERANCE
        fresh = InProcessPipeline(config, NUM_BLOCKS, BLOCK_SIZE, stage_bounds=bounds, weights=str(weights))
        assert fresh.generate_greedy(prompt, table, NEW_TOKENS) == transformers_greedy(reference, prompt)


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_directory_equals_transformers_whole(tmp_path: Path, case: str) -> None:
    path = moe_directory(tmp_path, case)
    config = checked_model_dir(str(path)).config
    assert config.moe is not None and config.num_hidden_layers == NUM_LAYERS
    first_moe = CASES[case]["moe"].get("first_k_dense_replace", 1)
    assert [config.is_moe_layer(i) for i in range(NUM_LAYERS)] == [i >= first_moe for i in range(NUM_LAYERS)]
    check_equals_transformers(config, path, path, stages=1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_directory_equals_transformers_over_four_stages(tmp_path: Path, case: str) -> None:
    path = moe_directory(tmp_path, case)
    check_equals_transformers(checked_model_dir(str(path)).config, path, path, stages=4)


def second_turn_from_the_pool(config: ModelConfig, path: Path, turn1: torch.Tensor, turn2: torch.Tensor,
                              chunk: int) -> tuple[torch.Tensor, list[int]]:
    """Turn 1 on one 4-stage pipeline; its full chunks packed out of every stage's pages as pool objects and
    unpacked into a fresh pipeline's (other pages); turn 2 there from the first uncached token: its logits and
    greedy tokens."""
    bounds = split_layers(config.num_hidden_layers, 4)
    first = InProcessPipeline(config, NUM_BLOCKS, BLOCK_SIZE, stage_bounds=bounds, weights=str(path))
    first.forward(turn1, list(range(NUM_BLOCKS)), 0)
    num_restored = turn1.numel() // chunk * chunk
    table = list(reversed(range(NUM_BLOCKS)))

    def restored() -> InProcessPipeline:
        pipe = InProcessPipeline(config, NUM_BLOCKS, BLOCK_SIZE, stage_bounds=bounds, weights=str(path))
        for source, target in zip(first.kv_caches, pipe.kv_caches):
            for start in range(0, num_restored, chunk):
                unpack_kv(target, table, start, pack_kv(source, list(range(NUM_BLOCKS)), start, start + chunk))
        return pipe

    logits = restored().forward(turn2[num_restored:], table, num_restored)
    return logits, restored().generate_greedy(turn2, table, NEW_TOKENS, num_cached_tokens=num_restored)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_second_turn_restored_from_the_pool_equals_transformers(tmp_path: Path, case: str) -> None:
    path = moe_directory(tmp_path, case)
    config = checked_model_dir(str(path)).config
    reference = load_reference(path)
    turn1 = prompt_ids(path, PROMPT)  # 60 tokens: one 32-token chunk restores, 28 are computed again
    with torch.inference_mode():
        answer = transformers_greedy(reference, turn1)
        turn2 = torch.cat((turn1, torch.tensor(answer), prompt_ids(path, list(range(40, 60)))))
        logits, tokens = second_turn_from_the_pool(config, path, turn1, turn2, chunk=32)
        theirs = reference(turn2.unsqueeze(0)).logits[0, 32:]
        assert max_abs_diff(logits, theirs) < TOLERANCE
        assert tokens == transformers_greedy(reference, turn2)


@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_an_fp8_directory_equals_its_dequantized_reference(tmp_path: Path, block: tuple[int, int]) -> None:
    """DeepSeek-V3's own 128x128 blocks (each tiny matrix one partial block), and 16x32 blocks (many, with partial
    edges, rows and columns told apart)."""
    original = moe_directory(tmp_path, "seed0-v3")
    fp8 = quantize_fp8(original, tmp_path / "fp8", block)
    reference = dequantized_copy(fp8, tmp_path / "dequantized")
    config = checked_model_dir(str(fp8)).config
    assert config == dataclasses.replace(checked_model_dir(str(reference)).config, name="fp8")
    check_equals_transformers(config, fp8, reference, stages=1)
    # the quantization is real: the bfloat16 original computes other logits
    prompt = prompt_ids(original, PROMPT)
    table = list(range(NUM_BLOCKS))
    with torch.inference_mode():
        quantized = InProcessPipeline(config, NUM_BLOCKS, BLOCK_SIZE, weights=str(fp8)).forward(prompt, table, 0)
        plain = InProcessPipeline(config, NUM_BLOCKS, BLOCK_SIZE, weights=str(original)).forward(prompt, table, 0)
        assert max_abs_diff(quantized, plain) > 1e-3


def test_an_fp8_directory_it_cannot_load_is_refused_naming_file_and_field(tmp_path: Path) -> None:
    fp8 = quantize_fp8(moe_directory(tmp_path, "seed0-v3"), tmp_path / "fp8", (16, 32))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # [64, 32]: 4 x 1 blocks

    def refused(change) -> str:  # type: ignore[no-untyped-def]
        path = tmp_path / f"broken{len(list(tmp_path.iterdir()))}"
        shutil.copytree(fp8, path)
        tensors = load_file(str(path / "model.safetensors"))
        config = json.loads((path / "config.json").read_text())
        change(tensors, config)
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError) as info:
            checked_model_dir(str(path))
        return str(info.value).replace(str(path), "DIR")

    assert refused(lambda t, c: t.pop(name + "_scale_inv")) == (
        f"model_dir: DIR: weight {name} is F8_E4M3 and {name}_scale_inv is in no *.safetensors file")
    assert refused(lambda t, c: t.update({name + "_scale_inv": torch.ones(2, 1)})) == (
        f"model_dir: DIR/model.safetensors: {name}_scale_inv has shape [2, 1]; [64, 32] in [16, 32] blocks "
        "(quantization_config.weight_block_size) makes it [4, 1]")
    assert refused(lambda t, c: t.update({name + "_scale_inv": torch.ones(4, 1, dtype=torch.float16)})) == (
        f"model_dir: DIR/model.safetensors: {name}_scale_inv is F16; supported: F32, BF16")
    assert refused(lambda t, c: c.pop("quantization_config")).startswith(
        "model_dir: DIR/model.safetensors: model.layers.0.self_attn.q_a_proj.weight is F8_E4M3; supported: F32, "
        "BF16, F16, F8_E4M3 matrices (quantization_config fp8)")
    assert refused(lambda t, c: t.update({name: t[name].to(torch.float8_e5m2)})) == (
        f"model_dir: DIR/model.safetensors: {name} is F8_E5M2; supported: F32, BF16, F16")
