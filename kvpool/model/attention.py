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

# queries per attention call, the blocks cut at its multiples (positions): bounds the [heads, queries, keys] score
# tensor; a chunk size that is a multiple of it (the default, 256, is) has a prefill cut the same blocks whatever
# chunk-aligned token it starts computing at. 128 costs a 256-token chunk after 8K cached tokens ~1.15x.
QUERY_BLOCK = 256


def query_blocks(start: int, end: int) -> list[tuple[int, int]]:
    """Positions [start, end) cut at the multiples of ``QUERY_BLOCK``."""
    cuts = range((start // QUERY_BLOCK + 1) * QUERY_BLOCK, end, QUERY_BLOCK)
    return list(zip([start, *cuts], [*cuts, end]))


def _runs(start: int, end: int, absorb: bool | Callable[[int], bool]) -> list[tuple[int, bool]]:
    """The query blocks of [start, end) merged into runs of one form: (run end, absorbed), in order.

    ``absorb`` decides per block, by its size (or for all, given a bool), so a
    block takes the same form whatever the call it is in.
    """
    runs: list[tuple[int, bool]] = []
    for first, last in query_blocks(start, end):
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
        each query block (``query_blocks``) by its size.
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
        # each query block takes the cheaper form for its size: the blocks sit at the same positions whatever
        # this call's first token, so a token's output never depends on where the computing started
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
    returns [h, n, dv]. Queries go in ``query_blocks``, each seeing only the
    keys it may attend to: a block's output is the same whatever the call's
    first query, so a token computes the same after any chunk-aligned start.
    """
    n, dim, value_dim = query.shape[1], query.shape[2], value.shape[2]
    # PyTorch's fused CPU kernel needs equal q/k/v head dims, else it falls
    # back to a ~4x slower path; zero padding changes neither scores nor outputs
    if value_dim < dim:
        value = F.pad(value, (0, dim - value_dim))
    elif dim < value_dim:
        query, key = F.pad(query, (0, value_dim - dim)), F.pad(key, (0, value_dim - dim))
    query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    outputs = []
    for first, num_keys in query_blocks(num_cached_tokens, num_cached_tokens + n):
        block_q = query[:, :, first - num_cached_tokens:num_keys - num_cached_tokens]
        if first == 0:
            # square block at position 0: top-left causal == ours, and it skips masked tiles
            out = F.scaled_dot_product_attention(block_q, key[:, :, :num_keys], value[:, :, :num_keys],
                                                 is_causal=True, scale=scale)
        elif _FLASH_CPU is not None and query.device.type == "cpu":
            out = _prefix_then_diagonal(block_q, key[:, :, :num_keys], value[:, :, :num_keys], first, scale)
        else:
            key_pos = torch.arange(num_keys, device=query.device)
            query_pos = torch.arange(first, num_keys, device=query.device)
            mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
            out = F.scaled_dot_product_attention(block_q, key[:, :, :num_keys], value[:, :, :num_keys],
                                                 attn_mask=mask, scale=scale)
        outputs.append(out[0, ..., :value_dim])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


# PyTorch's CPU flash kernel, with the log-sum-exp SDPA keeps to itself (torch pins it: 2.13.0)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefix_then_diagonal(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first: int, scale: float
) -> torch.Tensor:
    """A query block at positions first .. first + n - 1 over keys 0 .. first + n - 1, without a mask.

    The keys before ``first`` are all visible: one unmasked call. The last n
    keys form a square the block sees causally: one ``is_causal`` call, which
    skips its masked tiles. The two softmaxes merge exactly by their
    log-sum-exps. A boolean mask over all keys instead costs ~1.4x as much.
    """
    out_prefix, lse_prefix = _FLASH_CPU(query, key[:, :, :first], value[:, :, :first], scale=scale)
    out_diag, lse_diag = _FLASH_CPU(query, key[:, :, first:], value[:, :, first:], is_causal=True, scale=scale)
    top = torch.maximum(lse_prefix, lse_diag)
    w_prefix, w_diag = torch.exp(lse_prefix - top).unsqueeze(-1), torch.exp(lse_diag - top).unsqueeze(-1)
    return ((out_prefix * w_prefix + out_diag * w_diag) / (w_prefix + w_diag)).to(query.dtype)
