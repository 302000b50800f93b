"""Our model against Hugging Face transformers' DeepseekV3ForCausalLM, same weights 1:1, both rope layouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpool.model import InProcessPipeline, ModelConfig, init_weights
from kvpool.model.hf_checkpoint import from_hf_config
from tests.model.inputs import max_abs_diff, random_token_ids


def hf_model(config: ModelConfig, weights: dict[str, torch.Tensor]):
    # a dev dependency: the reference must run here, never be skipped; imported here, as importing it scans
    # its whole package, ~1 s of every test worker's collection
    import transformers

    hf_config = transformers.DeepseekV3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads, kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings, rope_interleave=config.rope_interleave,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        first_k_dense_replace=config.num_hidden_layers,  # dense MLPs only: no MoE layer
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = transformers.DeepseekV3ForCausalLM(hf_config).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # every HF parameter comes from our weights, and every one of ours is used
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model, hf_config


@pytest.mark.parametrize("interleave", [False, True])
def test_logits_and_greedy_tokens_match_hf(tiny: ModelConfig, interleave: bool) -> None:
    config = dataclasses.replace(tiny, rope_interleave=interleave, max_position_embeddings=4096, output_ids=None)
    weights = init_weights(config)
    model, hf_config = hf_model(config, weights)
    # the config we would load from that checkpoint's config.json keeps its layout
    assert from_hf_config(hf_config.to_dict()).rope_interleave is interleave
    prompt = random_token_ids(config, 40, seed=3)
    pipe = InProcessPipeline(config, num_blocks=8, block_size=16, weights=weights)
    with torch.inference_mode():
        ours = pipe.forward(prompt, list(range(8)), 0)
        theirs = model(prompt.unsqueeze(0)).logits[0]
        assert max_abs_diff(ours, theirs) < 1e-5  # measured 3.8e-6 (rotate-half), 4.1e-6 (interleaved)
        ours_tokens = pipe.generate_greedy(prompt, list(range(8)), 16)
        ids = prompt.unsqueeze(0)
        for _ in range(16):  # HF greedy without its generate() machinery: argmax, append, rerun
            ids = torch.cat((ids, model(ids).logits[:, -1:].argmax(-1)), dim=1)
        assert ours_tokens == ids[0, prompt.numel():].tolist()


def test_wrong_rope_layout_attends_differently(tiny: ModelConfig) -> None:
    """The layout matters: an interleaved checkpoint run as rotate-half gives other logits."""
    config = dataclasses.replace(tiny, rope_interleave=True, max_position_embeddings=4096, output_ids=None)
    weights = init_weights(config)
    model, _ = hf_model(config, weights)
    prompt = random_token_ids(config, 40, seed=3)
    wrong = InProcessPipeline(dataclasses.replace(config, rope_interleave=False), 8, 16, weights=weights)
    with torch.inference_mode():
        assert max_abs_diff(wrong.forward(prompt, list(range(8)), 0), model(prompt.unsqueeze(0)).logits[0]) > 1e-2


def test_hf_configs_we_cannot_run_are_refused() -> None:
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8, "v_head_dim": 8}
    assert from_hf_config(base).rope_interleave is True  # absent: DeepSeek's (and HF's) interleaved layout
    assert from_hf_config({**base, "rope_interleave": False}).rope_interleave is False
    with pytest.raises(ValueError, match="rope_parameters: 'linear' rope scaling is not supported"):
        from_hf_config({**base, "rope_scaling": {"type": "linear", "factor": 4}})
    with pytest.raises(ValueError, match="rope_parameters.original_max_position_embeddings: missing"):
        from_hf_config({**base, "rope_scaling": {"type": "yarn", "factor": 40}})
    moe = {"n_routed_experts": 8, "first_k_dense_replace": 1, "moe_intermediate_size": 16, "n_group": 2,
           "topk_group": 1, "num_experts_per_tok": 2}
    assert from_hf_config({**base, **moe}).is_moe_layer(1)
    assert from_hf_config({**base, **moe, "first_k_dense_replace": 2}).moe is None  # every layer dense
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert from_hf_config({**base, "quantization_config": fp8}) == from_hf_config(base)  # dequantized at load
    for field, value, message in (
        ("model_type", "llama", "model_type: 'llama' is not supported"),
        ("architectures", ["LlamaForCausalLM"], "architectures: .* has no 'DeepseekV3ForCausalLM'"),
        ("quantization_config", {"quant_method": "compressed-tensors"},
         "quantization_config.quant_method: 'compressed-tensors' is not supported"),
        ("quantization_config", {"quant_method": "awq", "bits": 4}, "quantization_config.quant_method: 'awq'"),
        ("quantization_config", {**fp8, "fmt": "e5m2"}, "quantization_config.fmt: 'e5m2' is not supported"),
        ("quantization_config", {**fp8, "activation_scheme": "static"},
         "quantization_config.activation_scheme: 'static' is not supported"),
        ("quantization_config", {**fp8, "weight_block_size": None},
         r"quantization_config.weight_block_size: None is not supported"),
        ("num_key_value_heads", 1, "num_key_value_heads: 1 differs from num_attention_heads 2"),
        ("hidden_act", "gelu", "hidden_act: 'gelu' is not supported"),
        ("tie_word_embeddings", True, "tie_word_embeddings: true is not supported"),
        ("attention_bias", True, "attention_bias: true is not supported"),
        ("kv_lora_rank", 16.0, "kv_lora_rank: must be an integer"),
    ):
        with pytest.raises(ValueError, match=message):
            from_hf_config({**base, field: value})
    for field, value, message in (
        ("scoring_func", "softmax", "scoring_func: 'softmax' is not supported"),
        ("topk_method", "greedy", "topk_method: 'greedy' is not supported"),
        ("moe_layer_freq", 2, "moe_layer_freq: 2 is not supported"),
        ("n_group", 3, "n_group: 3 does not divide n_routed_experts 8"),
        ("num_experts_per_tok", 5, "num_experts_per_tok: 5 exceeds the 4 experts"),
        ("norm_topk_prob", "yes", "norm_topk_prob: must be true or false"),
        ("moe_intermediate_size", 16.0, "moe_intermediate_size: must be an integer"),
    ):
        with pytest.raises(ValueError, match=message):
            from_hf_config({**base, **moe, field: value})
    with pytest.raises(ValueError, match="v_head_dim: missing"):
        from_hf_config({k: v for k, v in base.items() if k != "v_head_dim"})
