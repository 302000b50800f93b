"""An independent dense MLA forward in float64: no cache, no pages, no stages.

Written from the DeepSeek-V3 equations (non-absorbed form) straight from the
weight dict, to check the paged implementation against.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvpool.model import ModelConfig


def dense_logits(config: ModelConfig, weights: Mapping[str, torch.Tensor], token_ids: torch.Tensor) -> torch.Tensor:
    c = config
    w = {name: t.double() for name, t in weights.items()}
    n, heads = token_ids.numel(), c.num_attention_heads

    def norm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.rms_norm_eps) * gain

    inv_freq = c.rope_theta ** (-torch.arange(0, c.qk_rope_head_dim, 2, dtype=torch.float64) / c.qk_rope_head_dim)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]

    def rope(x: torch.Tensor) -> torch.Tensor:  # x [n, ..., rope]
        shape = (n,) + (1,) * (x.dim() - 2) + (angles.shape[1],)
        cos, sin = angles.cos().view(shape), angles.sin().view(shape)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][token_ids]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        if c.q_lora_rank is None:
            q = h @ w[p + "self_attn.q_proj.weight"].T
        else:
            q_a = norm(h @ w[p + "self_attn.q_a_proj.weight"].T, w[p + "self_attn.q_a_layernorm.weight"])
            q = q_a @ w[p + "self_attn.q_b_proj.weight"].T
        q = q.view(n, heads, c.qk_head_dim)
        q = torch.cat((q[..., : c.qk_nope_head_dim], rope(q[..., c.qk_nope_head_dim :])), dim=-1)
        kv_a = h @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T
        latent = norm(kv_a[:, : c.kv_lora_rank], w[p + "self_attn.kv_a_layernorm.weight"])
        k_pe = rope(kv_a[:, c.kv_lora_rank :])
        kv = (latent @ w[p + "self_attn.kv_b_proj.weight"].T).view(n, heads, -1)
        k = torch.cat((kv[..., : c.qk_nope_head_dim], k_pe[:, None, :].expand(n, heads, -1)), dim=-1)
        v = kv[..., c.qk_nope_head_dim :]
        scores = torch.einsum("nhd,thd->hnt", q, k) * c.qk_head_dim**-0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hnt,thv->nhv", probs, v).reshape(n, -1)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T
