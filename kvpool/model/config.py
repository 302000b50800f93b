"""Model configuration: field names follow the public DeepSeek-V3 HF config."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN RoPE scaling as DeepSeek-V3 configures it (``rope_scaling`` ``{"type": "yarn", ...}``), computed as
    Hugging Face transformers computes it (``_compute_yarn_parameters``, ``yarn_apply_mscale``).

    Invariant: it changes every roped key (the frequencies and the cos/sin factor), so, like the rope layout,
    it is part of the model and must match the checkpoint.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: absent (HF then takes the factor's own mscale)
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # None: from factor, mscale and mscale_all_dim
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor > 0 or not math.isfinite(self.factor):
            raise ValueError(f"rope_scaling.factor: must be positive, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("rope_scaling.original_max_position_embeddings: must be positive, "
                             f"got {self.original_max_position_embeddings}")

    @staticmethod
    def _mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (HF's ``attention_scaling``)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self._mscale(self.factor, self.mscale) / self._mscale(self.factor, self.mscale_all_dim)
        return self._mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """What the attention's softmax scale is multiplied by (DeepSeek's mscale squared)."""
        return self._mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inv_freq(self, dim: int, theta: float) -> list[float]:
        """The dim // 2 inverse frequencies: interpolated below the correction range, extrapolated above it."""
        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as HF: no division by zero
        freqs = []
        for i in range(dim // 2):
            extrapolated = theta ** (-2 * i / dim)
            keep = 1.0 - min(max((i - low) / (high - low), 0.0), 1.0)  # 1: extrapolate (high frequencies)
            freqs.append(extrapolated / self.factor * (1 - keep) + extrapolated * keep)
        return freqs


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """DeepSeek-V3's mixture of experts (``DeepseekV3MoE``), field names as its ``config.json``.

    Layers from `first_k_dense_replace` on are MoE: a sigmoid router with `e_score_correction_bias` picks
    `num_experts_per_tok` of `n_routed_experts` experts (SwiGLU, `moe_intermediate_size` wide) from the best
    `topk_group` of `n_group` groups; their weights are the unbiased scores, renormalized when `norm_topk_prob`,
    times `routed_scaling_factor`; `n_shared_experts` (one SwiGLU `n_shared_experts * moe_intermediate_size`
    wide) see every token. Invariant: the routing can always pick its experts — every group holds at least two
    (a group scores by its best two) and the chosen groups hold at least `num_experts_per_tok`.
    """

    first_k_dense_replace: int
    n_routed_experts: int
    moe_intermediate_size: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        for field in ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "n_group", "topk_group"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field}: must be positive, got {getattr(self, field)}")
        for field in ("first_k_dense_replace", "n_shared_experts"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field}: must be >= 0, got {getattr(self, field)}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_group: {self.n_group} does not divide n_routed_experts {self.n_routed_experts}")
        if self.experts_per_group < 2:
            raise ValueError(f"n_group: {self.n_group} groups of {self.n_routed_experts} experts leave fewer than "
                             "two per group (a group scores by its best two)")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group: {self.topk_group} exceeds n_group {self.n_group}")
        if self.num_experts_per_tok > self.topk_group * self.experts_per_group:
            raise ValueError(f"num_experts_per_tok: {self.num_experts_per_tok} exceeds the "
                             f"{self.topk_group * self.experts_per_group} experts of topk_group groups")
        if not self.routed_scaling_factor > 0 or not math.isfinite(self.routed_scaling_factor):
            raise ValueError(f"routed_scaling_factor: must be positive, got {self.routed_scaling_factor}")

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a DeepSeek-style MLA decoder: dense SwiGLU MLPs, or DeepSeek-V3's MoE from a layer on.

    Invariant: one KV-cache entry per token per layer holds `kv_entry_dim`
    values — the normed latent (`kv_lora_rank`) followed by the roped shared
    key (`qk_rope_head_dim`). `seed` selects the seeded weights used when no
    weight directory is given. `rope_interleave` is part of the model, not
    of a run: it changes every cached key, so it must match the checkpoint
    (``from_hf_config`` reads it, defaulting to interleaved as HF does); so is
    `rope_scaling` (None: plain RoPE; else YaRN, as DeepSeek-V3).
    `moe` (None: every layer dense) makes layers from its `first_k_dense_replace` on MoE layers.
    `output_ids` [lo, hi), when set, is every id the sampler may emit: the
    built-in configs (seeded weights read through the byte-level tokenizer)
    emit only printable ASCII, so every token they make is visible text. It
    touches sampling only, never the logits, so reference comparisons stay exact.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    seed: int = 0
    # RoPE pairs: False = rotate-half (our seeded configs), True = interleaved
    # pairs (0,1),(2,3),... as DeepSeek's checkpoints and HF's config default
    rope_interleave: bool = False
    rope_scaling: YarnScaling | None = None
    moe: MoEConfig | None = None
    output_ids: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
        )
        for field in positive:
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be positive or None, got {self.q_lora_rank}")
        # rotate-half RoPE pairs the two halves of the rope dims
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.output_ids is not None and not 0 <= self.output_ids[0] < self.output_ids[1] <= self.vocab_size:
            raise ValueError(f"output_ids must be a range within the vocabulary, got {self.output_ids}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` is an MoE layer (else a dense SwiGLU MLP), as transformers builds it."""
        return self.moe is not None and index >= self.moe.first_k_dense_replace

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_entry_dim(self) -> int:
        """Values cached per token per layer: latent + roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        return scale * self.rope_scaling.softmax_factor if self.rope_scaling is not None else scale


# byte ids " ".."~": one printable character each, whatever comes before or after
PRINTABLE_ASCII = (0x20, 0x7F)

# tiny: the default everywhere; a 2K-token prefill runs in well under a second
# on one CPU core.
TINY = ModelConfig(
    name="tiny",
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    kv_lora_rank=64,
    q_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    output_ids=PRINTABLE_ASCII,
)

# dsv3-kv: DeepSeek-V3's per-layer KV entry (512 + 64 = 576 values) and head
# dims, everything else small, so pool byte counts per token-layer are real.
DSV3_KV = ModelConfig(
    name="dsv3-kv",
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    kv_lora_rank=512,
    q_lora_rank=256,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    output_ids=PRINTABLE_ASCII,
)

# dsv3-kv-61: also DeepSeek-V3's depth, so KV bytes per token match V3's.
DSV3_KV_61 = dataclasses.replace(DSV3_KV, name="dsv3-kv-61", num_hidden_layers=61)

# dsv3-kv-lean: dsv3-kv's KV (8 layers of 576-value entries: the same bytes per token) with
# one attention head of 16 + 64 query/key dims and 16 value dims, so a 16K-token prefill's
# attention costs about a tenth of dsv3-kv's on a CPU (``kvpool bench path``'s cases).
DSV3_KV_LEAN = dataclasses.replace(DSV3_KV, name="dsv3-kv-lean", num_attention_heads=1, qk_nope_head_dim=16,
                                   v_head_dim=16)

CONFIGS: dict[str, ModelConfig] = {c.name: c for c in (TINY, DSV3_KV, DSV3_KV_61, DSV3_KV_LEAN)}


def get_config(name: str) -> ModelConfig:
    """Registered config by name; use `dataclasses.replace` to vary one."""
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model config {name!r}; known: {sorted(CONFIGS)}") from None


# KV storage dtypes by name and their bytes per value: what settings and pool
# namespaces need without importing torch (kv_cache.KV_DTYPES maps the same
# names to torch dtypes)
KV_DTYPE_ITEMSIZES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges, sizes differing by at most one."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"need 1 <= num_stages <= {num_layers}, got {num_stages}")
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
