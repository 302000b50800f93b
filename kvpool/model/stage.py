"""A pipeline stage: a contiguous range of decoder layers over a paged KV cache."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpool.model.attention import MLAttention
from kvpool.model.config import ModelConfig
from kvpool.model.invariant import linear
from kvpool.model.kv_cache import (
    KV_DTYPES,
    BlockTable,
    allocate_kv_cache,
    as_block_table,
    check_block_table,
    kv_layer,
    token_slots,
)
from kvpool.model.layers import RotaryEmbedding, SwiGLUMLP, rms_norm
from kvpool.model.moe import MoE
from kvpool.model.weights import (
    check_weights,
    init_weights,
    load_weights,
    weight_shapes,
)

# seeded (None), a safetensors directory, or tensors by HF name
WeightSource = Mapping[str, torch.Tensor] | str | Path | None


@dataclass(slots=True)
class DecoderLayer:
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)); the MLP is dense or DeepSeek-V3's MoE."""

    input_layernorm: torch.Tensor
    self_attn: MLAttention
    post_attention_layernorm: torch.Tensor
    mlp: SwiGLUMLP | MoE


class ModelStage:
    """Decoder layers [layer_start, layer_end) of `config`, single sequence per call.

    Invariants: the first stage (layer_start == 0) takes token ids and embeds
    them; the last (layer_end == num_hidden_layers) returns float32 logits;
    every other stage maps hidden states [n, hidden_size] to hidden states.
    The stage's KV cache holds its layers only, stage-local layer 0 first.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_start: int,
        layer_end: int,
        weights: WeightSource = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if not 0 <= layer_start < layer_end <= config.num_hidden_layers:
            raise ValueError(
                f"need 0 <= layer_start < layer_end <= {config.num_hidden_layers}, "
                f"got [{layer_start}, {layer_end})"
            )
        self.config = config
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", comparable
        shapes = weight_shapes(config, layer_start, layer_end)
        if weights is None:
            tensors: Mapping[str, torch.Tensor] = init_weights(config, shapes)
        elif isinstance(weights, (str, Path)):
            tensors = load_weights(weights, shapes)
        else:
            tensors = weights
        check_weights(tensors, shapes)
        w = {name: tensors[name].to(self.device, torch.float32) for name in shapes}
        self.embed_tokens = w["model.embed_tokens.weight"] if self.is_first else None
        self.norm = w["model.norm.weight"] if self.is_last else None
        self.lm_head = w["lm_head.weight"] if self.is_last else None
        self.layers = [self._layer(w, i) for i in range(layer_start, layer_end)]
        self.rotary = RotaryEmbedding.build(
            config.qk_rope_head_dim, config.rope_theta, config.max_position_embeddings, self.device,
            config.rope_scaling,
        )

    def _layer(self, w: Mapping[str, torch.Tensor], index: int) -> DecoderLayer:
        p = f"model.layers.{index}."
        mlp: SwiGLUMLP | MoE
        if self.config.moe is not None and self.config.is_moe_layer(index):
            mlp = MoE.from_weights(self.config.moe, w, p + "mlp.")
        else:
            mlp = SwiGLUMLP(w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
        return DecoderLayer(
            input_layernorm=w[p + "input_layernorm.weight"],
            self_attn=MLAttention.from_weights(self.config, w, p + "self_attn."),
            post_attention_layernorm=w[p + "post_attention_layernorm.weight"],
            mlp=mlp,
        )

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_end == self.config.num_hidden_layers

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
        storage: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Zeroed cache [num_blocks, num_layers, block_size, kv_entry_dim] for this stage
        (block-major: see ``kvpool.model.kv_cache``), over ``storage`` if given."""
        return allocate_kv_cache(self.config, self.num_layers, num_blocks, block_size, dtype, self.device, storage)

    @torch.inference_mode()
    def forward(
        self,
        inputs: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: BlockTable,
        num_cached_tokens: int,
        slot_mapping: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run n new tokens at positions [num_cached_tokens, num_cached_tokens + n).

        inputs: token ids [n] (first stage) or hidden states [n, hidden_size].
        kv_cache: this stage's pages; tokens [0, num_cached_tokens) must already
        be in the pages `block_table` names, and the new tokens' entries are
        written at `slot_mapping` (derived from the block table if None; if
        given it must equal that). Positions are implied: the sequence's
        cached tokens come first. Returns logits [n, vocab_size] (last stage)
        or hidden states [n, hidden_size].
        """
        n = self._check_inputs(inputs)
        self._check_kv_cache(kv_cache)
        if num_cached_tokens < 0:
            raise ValueError(f"num_cached_tokens must be >= 0, got {num_cached_tokens}")
        total = num_cached_tokens + n
        if total > self.config.max_position_embeddings:
            raise ValueError(
                f"{total} tokens exceed max_position_embeddings={self.config.max_position_embeddings}"
            )
        table = as_block_table(block_table, self.device)
        check_block_table(kv_cache, table, total)
        if slot_mapping is not None and not torch.equal(
            torch.as_tensor(slot_mapping, dtype=torch.int64, device=self.device),
            token_slots(table, num_cached_tokens, total, kv_cache.shape[2]),
        ):
            raise ValueError("slot_mapping disagrees with block_table for the new tokens")
        positions = torch.arange(num_cached_tokens, total, device=self.device)

        eps = self.config.rms_norm_eps
        if self.is_first:
            x = F.embedding(inputs.to(self.device), self.embed_tokens)
        else:
            x = inputs.to(self.device, torch.float32)
        for local, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_layernorm, eps)
            h = layer.self_attn.forward(h, positions, self.rotary, kv_layer(kv_cache, local), table, num_cached_tokens)
            x = x + h
            x = x + layer.mlp.forward(rms_norm(x, layer.post_attention_layernorm, eps))
        if self.is_last:
            return linear(rms_norm(x, self.norm, eps), self.lm_head)
        return x

    __call__ = forward

    def _check_inputs(self, inputs: torch.Tensor) -> int:
        if self.is_first:
            if inputs.dim() != 1 or inputs.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    f"first stage takes token ids [n] int64, got {tuple(inputs.shape)} {inputs.dtype}"
                )
            if inputs.numel() and (int(inputs.min()) < 0 or int(inputs.max()) >= self.config.vocab_size):
                raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        elif (
            inputs.dim() != 2
            or inputs.shape[1] != self.config.hidden_size
            or not inputs.is_floating_point()
        ):
            raise ValueError(
                f"stage takes hidden states [n, {self.config.hidden_size}], got {tuple(inputs.shape)}"
            )
        if inputs.shape[0] == 0:
            raise ValueError("need at least one new token")
        return inputs.shape[0]

    def _check_kv_cache(self, kv_cache: torch.Tensor) -> None:
        expected = (self.num_layers, self.config.kv_entry_dim)
        if kv_cache.dim() != 4 or (kv_cache.shape[1], kv_cache.shape[3]) != expected:
            raise ValueError(
                f"kv_cache must be [num_blocks, {self.num_layers}, block_size, "
                f"{self.config.kv_entry_dim}], got {tuple(kv_cache.shape)}"
            )
        if kv_cache.dtype not in KV_DTYPES.values():
            raise ValueError(f"kv_cache dtype must be one of {sorted(KV_DTYPES)}, got {kv_cache.dtype}")
        if kv_cache.device != self.device:
            raise ValueError(f"kv_cache is on {kv_cache.device}, stage on {self.device}")
