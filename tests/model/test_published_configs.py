"""DeepSeek-V3's and Kimi K2's published ``config.json`` (their values written here as the Hub serves them) pass the
directory check, and ``kvpool up``'s memory check says what each would need: every weight in float32, experts
included — 2.4 TiB for DeepSeek-V3's 671,026,419,200 parameters (its FP8 files hold about 1 byte a parameter),
3.7 TiB for Kimi K2's 1,026,408,232,448."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.core.supervision.memory_budget import memory_refusal
from kvpool.model.config import MoEConfig, YarnScaling, split_layers
from kvpool.model.hf_checkpoint import checked_model_dir, from_hf_config
from kvpool.model.weight_names import all_weight_shapes, is_quantizable, scale_inv_shape, weight_nbytes
from kvpool.services.memory_budget import memory_budget
from kvpool.services.prefill.settings import PrefillSettings
from kvpool.tools.up import UpSettings
from tests.model.hf_directory import write_hf_directory

FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# deepseek-ai/DeepSeek-V3, config.json (auto_map left out)
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "quantization_config": FP8, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
# moonshotai/Kimi-K2-Instruct, config.json (auto_map left out): DeepSeek-V3's architecture under its own model_type
KIMI_K2: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 131072, "model_type": "kimi_k2", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "quantization_config": FP8, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3", "use_cache": True, "v_head_dim": 128, "vocab_size": 163840,
}
PUBLISHED = {"DeepSeek-V3": DEEPSEEK_V3, "Kimi-K2-Instruct": KIMI_K2}
PARAMETERS = {"DeepSeek-V3": 671_026_419_200, "Kimi-K2-Instruct": 1_026_408_232_448}
MOE = {
    "DeepSeek-V3": MoEConfig(first_k_dense_replace=3, n_routed_experts=256, moe_intermediate_size=2048,
                             num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, norm_topk_prob=True,
                             routed_scaling_factor=2.5),
    "Kimi-K2-Instruct": MoEConfig(first_k_dense_replace=1, n_routed_experts=384, moe_intermediate_size=2048,
                                  num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
                                  norm_topk_prob=True, routed_scaling_factor=2.827),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_published_config_passes_and_counts_every_parameter_transformers_builds(name: str) -> None:
    import transformers  # here: importing it scans its whole package, ~1 s of every test worker's collection

    config = from_hf_config(PUBLISHED[name], name)
    assert config.moe == MOE[name]
    assert (config.kv_entry_dim, config.num_hidden_layers, config.rope_interleave) == (576, 61, True)
    rope = PUBLISHED[name]["rope_scaling"]
    assert config.rope_scaling == YarnScaling(
        factor=rope["factor"], original_max_position_embeddings=4096, beta_fast=rope["beta_fast"],
        beta_slow=rope["beta_slow"], mscale=1.0, mscale_all_dim=1.0)
    assert weight_nbytes(config, 0, 61) == 4 * PARAMETERS[name]
    # transformers' own model of that config, built without memory, has exactly those parameters
    hf = {k: v for k, v in PUBLISHED[name].items() if k not in ("model_type", "quantization_config")}
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf))
    counted = sum(p.numel() for p in model.parameters())
    counted += sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    assert counted == PARAMETERS[name]


def headers_only_directory(path: Path, hf: dict[str, Any]) -> Path:
    """A directory with the published config.json and safetensors *headers* naming every tensor the checkpoint
    ships (FP8 matrices, their float32 ``*_scale_inv``, bfloat16 the rest) and no tensor bytes: what the directory
    check and the memory check read (terabytes of weights are not written for a test)."""
    tiny = write_hf_directory(path.parent / "tokenizer-source")
    path.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / file, path / file)
    (path / "config.json").write_text(json.dumps(hf))
    config = from_hf_config(hf)
    header: dict[str, Any] = {}
    offset = 0

    def add(name: str, dtype: str, shape: tuple[int, ...], itemsize: int) -> None:
        nonlocal offset
        size = itemsize * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size

    for name, shape in all_weight_shapes(config).items():
        if is_quantizable(name, shape):
            add(name, "F8_E4M3", shape, 1)
            add(name + "_scale_inv", "F32", scale_inv_shape(shape, (128, 128)), 4)
        else:
            add(name, "BF16", shape, 2)
    encoded = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded)
    return path


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_memory_check_says_what_the_published_checkpoint_needs(tmp_path: Path, name: str) -> None:
    path = headers_only_directory(tmp_path / name, PUBLISHED[name])
    config = checked_model_dir(str(path)).config
    whole = 4 * PARAMETERS[name]
    # every stage holds its own layers' weights, experts included; together the whole model
    stages = [PrefillSettings(model_dir=str(path), num_stages=4, stage=i, port=0, admin_port=0,
                              stage_addresses=["later-stage"] * 3, next_stage="next-stage") for i in range(4)]
    assert [s.memory()["model_dir weights"] for s in stages] == [
        weight_nbytes(config, start, end) for start, end in split_layers(61, 4)]
    assert sum(s.memory()["model_dir weights"] for s in stages) == whole
    budget = memory_budget(UpSettings(model_dir=str(path), stores=0), None)
    assert budget["prefill weights"] == budget["decode weights"] == whole
    refusal = memory_refusal("up", budget, 1 << 40)
    size = {"DeepSeek-V3": "2.4 TiB", "Kimi-K2-Instruct": "3.7 TiB"}[name]
    assert refusal is not None and refusal.startswith(
        f"up: the configured memory (prefill device caches 22.6 GiB, prefill weights {size}, decode pages and "
        f"arenas 383 MiB, decode weights {size}: ")
    assert "exceeds the 1.0 TiB this host has available" in refusal
