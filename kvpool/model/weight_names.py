"""Weight names and [out, in] shapes of the HF DeepSeek-V3 checkpoint, by stage; torch-free, so a directory's
weights can be checked against them before anything loads."""

from __future__ import annotations

import math

from kvpool.model.config import ModelConfig, MoEConfig


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
        if c.moe is not None and c.is_moe_layer(i):
            shapes.update(_moe_shapes(c.moe, c.hidden_size, p + "mlp."))
        else:
            shapes.update(_swiglu_shapes(c.hidden_size, c.intermediate_size, p + "mlp."))
    if layer_end == c.num_hidden_layers:
        shapes["model.norm.weight"] = (c.hidden_size,)
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def all_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    return weight_shapes(config, 0, config.num_hidden_layers)


def _swiglu_shapes(hidden_size: int, intermediate_size: int, prefix: str) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (intermediate_size, hidden_size),
            prefix + "up_proj.weight": (intermediate_size, hidden_size),
            prefix + "down_proj.weight": (hidden_size, intermediate_size)}


def _moe_shapes(moe: MoEConfig, hidden: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """One MoE layer as DeepSeek-V3's checkpoints (and transformers' ``save_pretrained``) name it: the router
    (``gate``), every routed expert by index, the shared experts as one SwiGLU."""
    shapes: dict[str, tuple[int, ...]] = {prefix + "gate.weight": (moe.n_routed_experts, hidden),
                                          prefix + "gate.e_score_correction_bias": (moe.n_routed_experts,)}
    for expert in range(moe.n_routed_experts):
        shapes.update(_swiglu_shapes(hidden, moe.moe_intermediate_size, f"{prefix}experts.{expert}."))
    if moe.n_shared_experts:
        shapes.update(_swiglu_shapes(hidden, moe.n_shared_experts * moe.moe_intermediate_size,
                                     prefix + "shared_experts."))
    return shapes


# float32: what every weight is computed in, whatever the checkpoint stores
COMPUTE_ITEMSIZE = 4
# FP8 checkpoints (DeepSeek-V3's) quantize every linear layer's matrix but these: embedding, lm_head, router
NOT_QUANTIZED = ("model.embed_tokens.weight", "lm_head.weight")


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an FP8 checkpoint of DeepSeek-V3's kind stores ``name`` quantized, with ``{name}_scale_inv``."""
    return len(shape) == 2 and name not in NOT_QUANTIZED and not name.endswith("mlp.gate.weight")


def scale_inv_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The ``*_scale_inv`` of a [out, in] weight quantized in [block_out, block_in] blocks: one per block, the
    edge blocks partial."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def weight_nbytes(config: ModelConfig, layer_start: int, layer_end: int) -> int:
    """Bytes a stage over layers [layer_start, layer_end) holds its weights in: float32, every expert included
    (an FP8 checkpoint is dequantized at load, so it takes 4 bytes a parameter here, 1 on disk)."""
    return COMPUTE_ITEMSIZE * sum(math.prod(shape) for shape in weight_shapes(config, layer_start, layer_end).values())
