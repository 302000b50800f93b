"""Weight names and [out, in] shapes of the HF DeepSeek-V3 checkpoint, by stage; torch-free, so a directory's
weights can be checked against them before anything loads."""

from __future__ import annotations

from kvpool.model.config import ModelConfig


def weight_shapes(config: ModelConfig, layer_start: int, layer_end: int) -> dict[str, tuple[int, ...]]:
    """Shape of every weight a stage over layers [layer_start, layer_end) needs.

    The first stage (layer_start == 0) adds the embedding; the last
    (layer_end == num_hidden_layers) adds the final norm and lm_head.
    """
    c = config
    shapes: dict[str, tuple[int, ...]] = {}
    if layer_start == 0:
        shapes["model.embed_tokens.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(layer_start, layer_end):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        if c.q_lora_rank is None:
            shapes[p + "self_attn.q_proj.weight"] = (c.num_attention_heads * c.qk_head_dim, c.hidden_size)
        else:
            shapes[p + "self_attn.q_a_proj.weight"] = (c.q_lora_rank, c.hidden_size)
            shapes[p + "self_attn.q_a_layernorm.weight"] = (c.q_lora_rank,)
            shapes[p + "self_attn.q_b_proj.weight"] = (c.num_attention_heads * c.qk_head_dim, c.q_lora_rank)
        shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (c.kv_entry_dim, c.hidden_size)
        shapes[p + "self_attn.kv_a_layernorm.weight"] = (c.kv_lora_rank,)
        shapes[p + "self_attn.kv_b_proj.weight"] = (
            c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank,
        )
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.num_attention_heads * c.v_head_dim)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    if layer_end == c.num_hidden_layers:
        shapes["model.norm.weight"] = (c.hidden_size,)
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def all_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    return weight_shapes(config, 0, config.num_hidden_layers)
