"""Multi-head latent attention (MLA) over one layer of a paged KV cache."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpool.model.config import ModelConfig
from kvpool.model.invariant import einsum_rows, linear
from kvpool.model.kv_cache import read_kv_blocks, token_slots, write_kv
from kvpool.model.layers import RotaryEmbedding, rms_norm

# Positions are cut at the multiples of SEGMENT. A query attends to the segments before its own in one unmasked
# call and to its own segment (keys through the kernel's key tile that holds the last query) in a causal one: the
# key tiles of both calls sit at the same positions whatever the call's first query, so a token's output is
# bitwise the same from any compute start.
# Bounds the [heads, queries, keys] score tensor too.
SEGMENT = 2048
KEY_TILE = 512  # the CPU flash kernel's keys per tile (torch 2.13); SEGMENT is a multiple of it
# the blocks that pick the absorbed or expanded form by their size: at multiples of FORM_BLOCK, so a chunk size
# that is a multiple of it (the default, 256, is) has every chunk-aligned start pick the same forms
FORM_BLOCK = 256


def cut(start: int, end: int, size: int) -> list[tuple[int, int]]:
    """Positions [start, end) cut at the multiples of ``size``."""
    cuts = range((start // size + 1) * size, end, size)
    return list(zip([start, *cuts], [*cuts, end]))


def _runs(start: int, end: int, absorb: bool | Callable[[int], bool]) -> list[tuple[int, bool]]:
    """The query blocks of [start, end) merged into runs of one form: (run end, absorbed), in order.

    ``absorb`` decides per block, by its size (or for all, given a bool), so a
    block takes the same form whatever the call it is in.
    """
    runs: list[tuple[int, bool]] = []
    for first, last in cut(start, end, FORM_BLOCK):
        absorbed = absorb if isinstance(absorb, bool) else absorb(last - first)
        if runs and runs[-1][1] == absorbed:
            runs[-1] = (last, absorbed)
        else:
            runs.append((last, absorbed))
    return runs


@dataclass(slots=True)
class MLAttention:
    """One layer's MLA weights (HF DeepSeek-V3 names, [out, in] matrices).

    Invariant: the cache entry of a token is `cat(kv_a_layernorm(latent),
    rope(k_pe))`; everything else (per-head keys and values) is recomputed
    from it, so attention reads only the cache, never the fresh activations.
    Exactly one of `q_proj` and (`q_a_proj`, `q_a_layernorm`, `q_b_proj`) is set.
    """

    config: ModelConfig
    q_proj: torch.Tensor | None
    q_a_proj: torch.Tensor | None
    q_a_layernorm: torch.Tensor | None
    q_b_proj: torch.Tensor | None
    kv_a_proj_with_mqa: torch.Tensor
    kv_a_layernorm: torch.Tensor
    kv_b_proj: torch.Tensor
    o_proj: torch.Tensor

    @classmethod
    def from_weights(
        cls, config: ModelConfig, weights: Mapping[str, torch.Tensor], prefix: str
    ) -> MLAttention:
        """Take `{prefix}q_proj.weight`-style tensors from weights."""
        lora = config.q_lora_rank is not None

        def get(name: str, present: bool = True) -> torch.Tensor | None:
            return weights[f"{prefix}{name}.weight"] if present else None

        return cls(
            config=config,
            q_proj=get("q_proj", not lora),
            q_a_proj=get("q_a_proj", lora),
            q_a_layernorm=get("q_a_layernorm", lora),
            q_b_proj=get("q_b_proj", lora),
            kv_a_proj_with_mqa=get("kv_a_proj_with_mqa"),
            kv_a_layernorm=get("kv_a_layernorm"),
            kv_b_proj=get("kv_b_proj"),
            o_proj=get("o_proj"),
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_layer: torch.Tensor,
        block_table: torch.Tensor,
        num_cached_tokens: int,
        absorb: bool | None = None,
    ) -> torch.Tensor:
        """Causal attention of n new tokens over all cached + new tokens.

        x: [n, hidden] at `positions` = num_cached_tokens + arange(n).
        kv_layer: this layer's pages [num_blocks, block_size, kv_entry_dim].
        block_table: the sequence's blocks, covering num_cached_tokens + n
        tokens; the new tokens' entries are written to their slots first.
        absorb: fold kv_b_proj into the query/output (cheap for few queries)
        instead of expanding every cached latent; None picks the cheaper for
        each block of ``FORM_BLOCK`` positions by its size.
        """
        cfg = self.config
        n = x.shape[0]
        heads, nope, rope, rank = (
            cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
        )
        if self.q_proj is not None:
            q = linear(x, self.q_proj)
        else:
            q_latent = rms_norm(linear(x, self.q_a_proj), self.q_a_layernorm, cfg.rms_norm_eps)
            q = linear(q_latent, self.q_b_proj)
        q_nope, q_pe = q.view(n, heads, cfg.qk_head_dim).split([nope, rope], dim=-1)
        q_pe = rotary.apply(q_pe, positions, cfg.rope_interleave)

        latent, k_pe = linear(x, self.kv_a_proj_with_mqa).split([rank, rope], dim=-1)
        latent = rms_norm(latent, self.kv_a_layernorm, cfg.rms_norm_eps)
        k_pe = rotary.apply(k_pe, positions, cfg.rope_interleave)
        total = num_cached_tokens + n
        write_kv(kv_layer, token_slots(block_table, num_cached_tokens, total, kv_layer.shape[1]),
                 torch.cat((latent, k_pe), dim=-1))

        # read back through the cache dtype so fresh and restored KV match
        entries = read_kv_blocks(kv_layer, block_table, total, x.dtype)  # [T, rank + rope]
        w_kv = self.kv_b_proj.view(heads, nope + cfg.v_head_dim, rank)
        w_uk, w_uv = w_kv.split([nope, cfg.v_head_dim], dim=1)
        # each block takes the cheaper form for its size: the blocks sit at the same positions whatever this
        # call's first token, so a token's output never depends on where the computing started
        runs = _runs(num_cached_tokens, total, absorb if absorb is not None else self._absorb_is_cheaper)
        expand_end = max((end for end, absorbed in runs if not absorbed), default=0)
        if expand_end:
            kv = linear(entries[:expand_end, :rank], self.kv_b_proj).view(-1, heads, nope + cfg.v_head_dim)
            k_rope = entries[:expand_end, rank:].unsqueeze(1).expand(-1, heads, -1)
            expanded_key = torch.cat((kv[..., :nope], k_rope), dim=-1).transpose(0, 1)
            # the fast SDPA kernel wants the value as wide as the key: where v is at least as wide as the
            # rope part (and no wider than the key), the last qk_head_dim columns of [k_nope | v] are such
            # a value with no copy (the k_nope columns' outputs are dropped below); else _causal_attention pads
            window = rope <= cfg.v_head_dim <= cfg.qk_head_dim
            expanded_value = (kv[..., -cfg.qk_head_dim:] if window else kv[..., nope:]).transpose(0, 1)
        outputs, start = [], num_cached_tokens
        for end, absorbed in runs:
            rows = slice(start - num_cached_tokens, end - num_cached_tokens)
            if absorbed:
                # scores = (q_nope W_uk) . latent + q_pe . k_pe; values = latent
                q_lat = einsum_rows("nhd,hdr->hnr", q_nope[rows], w_uk)
                query = torch.cat((q_lat, q_pe[rows].transpose(0, 1)), dim=-1)
                key = entries[:end].unsqueeze(0).expand(heads, -1, -1)
                # value = whole entry: equal q/k/v dims take the fast SDPA kernel;
                # the rope columns of the output are dropped below
                out = _causal_attention(query, key, key, start, cfg.softmax_scale)
                outputs.append(einsum_rows("hnr,hvr->hnv", out[..., :rank], w_uv, rows_dim=1))
            else:
                query = torch.cat((q_nope[rows], q_pe[rows]), dim=-1).transpose(0, 1)
                out = _causal_attention(query, expanded_key[:, :end], expanded_value[:, :end], start,
                                        cfg.softmax_scale)
                outputs.append(out[..., -cfg.v_head_dim:])
            start = end
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        return linear(out.transpose(0, 1).reshape(n, heads * cfg.v_head_dim), self.o_proj)

    def _absorb_is_cheaper(self, num_queries: int) -> bool:
        # per (key, head): absorbed costs n*(2*rank + rope) multiply-adds; expanded
        # costs rank*(nope + v) to up-project the key plus n*(nope + rope + v)
        cfg = self.config
        absorbed = num_queries * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        expanded = cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim) + num_queries * (
            cfg.qk_head_dim + cfg.v_head_dim
        )
        return absorbed < expanded


def _causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_cached_tokens: int, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale) v with query i at position num_cached_tokens + i.

    query [h, n, d], key [h, T, d], value [h, T, dv] with T = num_cached + n;
    returns [h, n, dv]. Queries go by ``SEGMENT`` (``_segment_attention``).
    """
    n, dim, value_dim = query.shape[1], query.shape[2], value.shape[2]
    # PyTorch's fused CPU kernel needs equal q/k/v head dims, else it falls
    # back to a ~4x slower path; zero padding changes neither scores nor outputs
    if value_dim < dim:
        value = F.pad(value, (0, dim - value_dim))
    elif dim < value_dim:
        query, key = F.pad(query, (0, value_dim - dim)), F.pad(key, (0, value_dim - dim))
    same = value is key
    query, key = query.unsqueeze(0), key.unsqueeze(0)
    value = key if same else value.unsqueeze(0)
    outputs = []
    for first, end in cut(num_cached_tokens, num_cached_tokens + n, SEGMENT):
        rows = query[:, :, first - num_cached_tokens:end - num_cached_tokens]
        if _FLASH_CPU is not None and query.device.type == "cpu":
            out = _segment_attention(rows, key, value, first, scale)
        else:  # one masked call (no bitwise guarantee off the CPU kernel)
            key_pos = torch.arange(end, device=query.device)
            query_pos = torch.arange(first, end, device=query.device)
            mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
            out = F.scaled_dot_product_attention(rows, key[:, :, :end], value[:, :, :end], attn_mask=mask,
                                                 scale=scale)
        outputs.append(out[0, ..., :value_dim])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


# PyTorch's CPU flash kernel, with the log-sum-exp SDPA keeps to itself (torch pins it: 2.13.0)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first: int, scale: float
) -> torch.Tensor:
    """Queries at positions first .. first + m - 1, all in one segment starting at ``a``, over keys 0 .. them.

    The keys of the segments before (0 .. a - 1) are all visible: one unmasked
    call. The segment's own keys, through the key tile (``KEY_TILE``) that
    holds the last query and padded to it, go in one causal call: top-left
    causal when the queries start at ``a``, else an additive mask (the kernel
    gives every row bitwise the same either way, as it does for any subset of
    the segment's queries and any number of whole tiles past them, which add
    exact zeros). The two softmaxes merge by their log-sum-exps. So a row's
    key tiles never depend on the call's first query or on where its keys
    end; the queries are padded to a multiple of four, so no tile of the
    kernel's products has fewer rows (fewer are summed another way:
    ``kvpool.model.invariant``).
    """
    m = query.shape[2]
    a = first // SEGMENT * SEGMENT
    queries = F.pad(query, (0, 0, 0, -m % 4))
    # the segment's keys up to the kernel's key tile that holds the last query (the later tiles add exact zeros)
    own_end = a + -(-(first + m - a) // KEY_TILE) * KEY_TILE

    def own(t: torch.Tensor) -> torch.Tensor:  # past the last key: zeros no query sees
        past = own_end - t.shape[2]
        return F.pad(t[:, :, a:own_end], (0, 0, 0, past)) if past > 0 else t[:, :, a:own_end]

    own_key = own(key)
    own_value = own_key if value is key else own(value)
    if first == a:
        out, lse = _FLASH_CPU(queries, own_key, own_value, is_causal=True, scale=scale)
    else:
        # padded rows see what the last row sees
        positions = torch.arange(first, first + queries.shape[2], device=query.device).clamp_(max=first + m - 1)
        hidden = torch.arange(a, own_end, device=query.device).unsqueeze(0) > positions.unsqueeze(1)
        bias = torch.zeros(hidden.shape, dtype=query.dtype, device=query.device).masked_fill_(hidden, float("-inf"))
        out, lse = _FLASH_CPU(queries, own_key, own_value, attn_mask=bias.view(1, 1, *hidden.shape), scale=scale)
    if a:
        out_prefix, lse_prefix = _FLASH_CPU(queries, key[:, :, :a], value[:, :, :a], scale=scale)
        top = torch.maximum(lse_prefix, lse)
        w_prefix, w_own = torch.exp(lse_prefix - top).unsqueeze(-1), torch.exp(lse - top).unsqueeze(-1)
        out = ((out_prefix * w_prefix + out * w_own) / (w_prefix + w_own)).to(query.dtype)
    return out[:, :, :m]
