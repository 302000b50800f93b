"""Batched decode over token-major KV pages: one step serves every running sequence.

Pages: one tensor ``[num_pages, page_size, num_layers, kv_entry_dim]`` in the
KV dtype, so a page holds ``page_size`` tokens × every layer — token t of a
sequence is at ``(page_table[t // page_size], t % page_size)`` in every layer.
Entries are what the prefill caches (normed latent, then roped key), stored
in the KV dtype and upcast for compute, exactly as ``kvpool.model.kv_cache``.

One step takes B sequences' newest tokens: embedding, every projection and the
MLP run as one [B, hidden] matmul per layer (the step's fixed cost, shared);
attention runs once per layer over the B sequences' own pages, gathered at
once and padded to the longest, each sequence attending over its own keys only
(``invariant.attend_each``: its logits are bitwise the same in any batch). The
math is ``MLAttention``'s absorbed form, so a greedy generation here equals the
single-sequence reference token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpool.model.config import ModelConfig
from kvpool.model.invariant import attend_each, einsum_rows, linear
from kvpool.model.kv_cache import KV_DTYPES
from kvpool.model.layers import rms_norm
from kvpool.model.stage import ModelStage, WeightSource


@dataclass(frozen=True, slots=True)
class DecodeInput:
    """One sequence's part of a step: feed ``token_id`` at ``position``.

    Tokens [0, position) are already in the pages ``page_table`` names; the
    step writes this token's entries at ``position`` in every layer.
    """

    token_id: int
    position: int
    page_table: Sequence[int]


class DecodeModel:
    """The whole model (all layers) over one shard's token-major pages.

    Invariant: ``pages`` is contiguous, its dtype one of ``KV_DTYPES``; only
    ``step`` and ``write_pages`` change it, and only at the slots they name.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        kv_dtype: torch.dtype = torch.float32,
        weights: WeightSource = None,
    ) -> None:
        if kv_dtype not in KV_DTYPES.values():
            raise ValueError(f"kv dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype}")
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.config = config
        self.model = ModelStage(config, 0, config.num_hidden_layers, weights)
        self.page_size = page_size
        self.num_layers = config.num_hidden_layers
        self.pages = torch.zeros(
            (num_pages, page_size, self.num_layers, config.kv_entry_dim), dtype=kv_dtype
        )
        # [num_slots, num_layers, entry bytes]: copies as bytes (CPU index kernels lack float8)
        self._slot_bytes = self.pages.view(torch.uint8).view(num_pages * page_size, self.num_layers, -1)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.pages.dtype

    @property
    def entry_bytes(self) -> int:
        return self.config.kv_entry_dim * self.pages.element_size()

    def slots(self, page_table: Sequence[int], token_start: int, token_end: int) -> torch.Tensor:
        """Slot (page_id * page_size + offset) of each token in [token_start, token_end)."""
        table = torch.as_tensor(page_table, dtype=torch.int64)
        tokens = torch.arange(token_start, token_end)
        return table[tokens // self.page_size] * self.page_size + tokens % self.page_size

    @torch.inference_mode()
    def step(self, batch: Sequence[DecodeInput]) -> torch.Tensor:
        """Feed one token per sequence; float32 logits [B, vocab_size] for the next tokens."""
        if not batch:
            raise ValueError("a step needs at least one sequence")
        cfg, model = self.config, self.model
        num_seqs = len(batch)
        positions = torch.tensor([b.position for b in batch], dtype=torch.int64)
        lengths = positions + 1
        max_len = int(lengths.max())
        # every sequence's slots, padded with its own first slot (never attended to)
        key_slots = torch.empty((num_seqs, max_len), dtype=torch.int64)
        for i, b in enumerate(batch):
            slots = self.slots(b.page_table, 0, b.position + 1)
            key_slots[i, : slots.numel()] = slots
            key_slots[i, slots.numel():] = slots[0]
        new_slots = key_slots[torch.arange(num_seqs), positions]
        # one gather of every layer's history per step; each layer patches in its new token
        history = self._slot_bytes.index_select(0, key_slots.view(-1))  # [B*T, L, bytes]

        eps = cfg.rms_norm_eps
        x = F.embedding(torch.tensor([b.token_id for b in batch]), model.embed_tokens)
        for layer_index, layer in enumerate(model.layers):
            h = rms_norm(x, layer.input_layernorm, eps)
            h = self._attention(layer_index, layer.self_attn, h, positions, new_slots, history)
            x = x + h
            x = x + layer.mlp.forward(rms_norm(x, layer.post_attention_layernorm, eps))
        return linear(rms_norm(x, model.norm, eps), model.lm_head)

    def _attention(self, layer_index, attn, x, positions, new_slots, history) -> torch.Tensor:
        cfg = self.config
        num_seqs = x.shape[0]
        heads, nope, rope, rank = (
            cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
        )
        if attn.q_proj is not None:
            q = linear(x, attn.q_proj)
        else:
            q = linear(rms_norm(linear(x, attn.q_a_proj), attn.q_a_layernorm, cfg.rms_norm_eps), attn.q_b_proj)
        q_nope, q_pe = q.view(num_seqs, heads, cfg.qk_head_dim).split([nope, rope], dim=-1)
        q_pe = self.model.rotary.apply(q_pe, positions, cfg.rope_interleave)
        latent, k_pe = linear(x, attn.kv_a_proj_with_mqa).split([rank, rope], dim=-1)
        latent = rms_norm(latent, attn.kv_a_layernorm, cfg.rms_norm_eps)
        k_pe = self.model.rotary.apply(k_pe, positions, cfg.rope_interleave)
        stored = torch.cat((latent, k_pe), dim=-1).to(self.kv_dtype).contiguous().view(torch.uint8)
        self._slot_bytes[new_slots, layer_index] = stored
        # keys through the cache dtype, as the reference reads them back
        keys = history[:, layer_index].view(num_seqs, -1, history.shape[-1])
        keys[torch.arange(num_seqs), positions] = stored
        entries = keys.view(self.kv_dtype).to(torch.float32)  # [B, T, rank + rope]

        # absorbed MLA: scores = (q_nope W_uk) . latent + q_pe . k_pe; values = latent
        w_uk, w_uv = attn.kv_b_proj.view(heads, nope + cfg.v_head_dim, rank).split([nope, cfg.v_head_dim], dim=1)
        q_lat = einsum_rows("bhd,hdr->bhr", q_nope, w_uk)
        query = torch.cat((q_lat, q_pe), dim=-1)  # [B, h, rank + rope]
        # one key per token shared by every head (MQA-like): no per-head copies; each sequence over its own keys
        out = attend_each(query, entries, (positions + 1).tolist(), cfg.softmax_scale, rank)  # [B, h, rank]
        out = einsum_rows("bhr,hvr->bhv", out, w_uv)
        return linear(out.reshape(num_seqs, heads * cfg.v_head_dim), attn.o_proj)

    def write_pages(self, page_table: Sequence[int], token_start: int, entries: torch.Tensor) -> None:
        """Store entries [n, num_layers, kv_entry_dim] (KV dtype) for tokens from token_start."""
        n = entries.shape[0]
        if entries.dtype != self.kv_dtype or tuple(entries.shape[1:]) != tuple(self.pages.shape[2:]):
            raise ValueError(f"entries must be [n, {self.num_layers}, {self.config.kv_entry_dim}] {self.kv_dtype}")
        slots = self.slots(page_table, token_start, token_start + n)
        self._slot_bytes.index_copy_(0, slots, entries.contiguous().view(torch.uint8).view(n, self.num_layers, -1))

    def read_pages(self, page_table: Sequence[int], token_start: int, token_end: int) -> torch.Tensor:
        """Entries [n, num_layers, kv_entry_dim] (KV dtype) of tokens [token_start, token_end)."""
        slots = self.slots(page_table, token_start, token_end)
        return self._slot_bytes.index_select(0, slots).view(self.kv_dtype)
