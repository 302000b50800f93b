"""DeepSeek-V3's MoE layer, computed as transformers' ``DeepseekV3MoE`` computes it: routing, experts, shared
experts, in float32."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvpool.model.config import MoEConfig
from kvpool.model.invariant import linear
from kvpool.model.layers import SwiGLUMLP


@dataclass(frozen=True, slots=True)
class Routing:
    """Which experts each of n tokens goes to and with what weight: ``expert_ids`` [n, k] (int64) and
    ``weights`` [n, k] (float32), row by row; the order within a row carries no meaning."""

    expert_ids: torch.Tensor
    weights: torch.Tensor


def route(router_logits: torch.Tensor, e_score_correction_bias: torch.Tensor, moe: MoEConfig) -> Routing:
    """DeepSeek-V3's group-limited routing ("noaux_tc") of router logits [n, n_routed_experts], a pure function.

    Scores are sigmoid(logits). The bias shifts only the choice: each group is rated by the sum of its two best
    biased scores, the best ``topk_group`` groups stay, and the ``num_experts_per_tok`` best biased scores in them
    are picked. Their weights are the unbiased scores, divided by their sum (+1e-20) when ``norm_topk_prob``,
    times ``routed_scaling_factor``. Step for step transformers' ``DeepseekV3TopkRouter``, so ties and rounding
    fall the same way.
    """
    n = router_logits.shape[0]
    scores = router_logits.float().sigmoid()
    for_choice = scores + e_score_correction_bias.float()
    group_scores = for_choice.view(n, moe.n_group, moe.experts_per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_ids = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1).bool()
    expert_mask = group_mask.unsqueeze(-1).expand(n, moe.n_group, moe.experts_per_group).reshape(n, -1)
    for_choice = for_choice.masked_fill(~expert_mask, float("-inf"))
    expert_ids = torch.topk(for_choice, k=moe.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, expert_ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(expert_ids, weights * moe.routed_scaling_factor)


@dataclass(slots=True)
class MoE:
    """One MoE layer's weights (HF DeepSeek-V3 names): the router ``gate`` [n_routed_experts, hidden] with its
    ``e_score_correction_bias``, the routed ``experts`` (SwiGLU each), the ``shared_experts`` (None: none).

    Invariant: ``forward`` is a token-wise map — a token's output depends on that token alone, never on the
    others in the batch — so prefill, chunked prefill and batched decode give each token the same experts.
    """

    moe: MoEConfig
    gate: torch.Tensor
    e_score_correction_bias: torch.Tensor
    experts: list[SwiGLUMLP]
    shared_experts: SwiGLUMLP | None

    @classmethod
    def from_weights(cls, moe: MoEConfig, weights: Mapping[str, torch.Tensor], prefix: str) -> MoE:
        """Take ``{prefix}gate.weight``, ``{prefix}experts.{j}.gate_proj.weight``, ... from weights."""
        def swiglu(p: str) -> SwiGLUMLP:
            return SwiGLUMLP(weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"],
                             weights[p + "down_proj.weight"])

        return cls(
            moe=moe, gate=weights[prefix + "gate.weight"],
            e_score_correction_bias=weights[prefix + "gate.e_score_correction_bias"],
            experts=[swiglu(f"{prefix}experts.{j}.") for j in range(moe.n_routed_experts)],
            shared_experts=swiglu(prefix + "shared_experts.") if moe.n_shared_experts else None,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden]: the routed experts' weighted sum plus the shared experts'."""
        routing = route(linear(x.float(), self.gate.float()), self.e_score_correction_bias, self.moe)
        out = torch.zeros_like(x)
        # expert by expert over the tokens that picked it, in expert order (as transformers adds them up)
        for expert_id in routing.expert_ids.unique().tolist():
            token_ids, slot = torch.where(routing.expert_ids == expert_id)
            y = self.experts[expert_id].forward(x[token_ids]) * routing.weights[token_ids, slot, None]
            out.index_add_(0, token_ids, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts.forward(x)
        return out
