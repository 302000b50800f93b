"""DeepSeek-V3's routing, exactly: which experts each token picks and their weights, by hand and against
transformers' ``DeepseekV3TopkRouter``; the MoE layer against transformers' ``DeepseekV3MoE``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import pytest
import torch

from kvpool.model.config import MoEConfig
from kvpool.model.layers import SwiGLUMLP
from kvpool.model.moe import MoE, route
from tests.model.inputs import max_abs_diff

if TYPE_CHECKING:  # imported where used: importing it scans its whole package, ~1 s of every test worker's collection
    import transformers

# 8 experts in 4 groups of 2 ({0, 1}, {2, 3}, {4, 5}, {6, 7}); 2 groups kept, 2 experts a token
MOE = MoEConfig(first_k_dense_replace=0, n_routed_experts=8, moe_intermediate_size=16, num_experts_per_tok=2,
                n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
# one token's router logits: expert 0 scores best alone, but its group's second is the worst, so group 0 (0.98 +
# 0.02) loses to groups 2 (0.88 + 0.62) and 1 (0.73 + 0.71); group 3 (0.27 + 0.95) is third
LOGITS = [4.0, -4.0, 1.0, 0.9, 2.0, 0.5, -1.0, 3.0]


def picks(logits: list[float], moe: MoEConfig, bias: list[float] | None = None) -> dict[int, float]:
    """expert id -> weight of one token."""
    routing = route(torch.tensor([logits]), torch.tensor(bias or [0.0] * len(logits)), moe)
    return dict(zip(routing.expert_ids[0].tolist(), routing.weights[0].tolist()))


def sigmoid(*logits: float) -> list[float]:
    return torch.tensor(logits, dtype=torch.float32).sigmoid().tolist()


def normed(expert_ids: tuple[int, int], scale: float) -> dict[int, float]:
    """float32 s / (s_a + s_b + 1e-20) * scale, as transformers rounds it."""
    s = torch.tensor(LOGITS, dtype=torch.float32).sigmoid()[list(expert_ids)]
    return dict(zip(expert_ids, (s / (s.sum() + 1e-20) * scale).tolist()))


def test_the_best_groups_are_kept_and_the_best_experts_in_them_picked() -> None:
    assert picks(LOGITS, MOE) == normed((4, 2), 2.5)
    # one group holding every expert: plain top-2, experts 0 and 7
    assert picks(LOGITS, dataclasses.replace(MOE, n_group=1, topk_group=1)) == normed((0, 7), 2.5)
    # every group kept: the same
    assert picks(LOGITS, dataclasses.replace(MOE, topk_group=4)) == normed((0, 7), 2.5)


def test_the_bias_moves_the_choice_and_never_the_weights() -> None:
    # +0.5 on expert 6 lifts group 3 (0.77 + 0.95) to the top; experts 7 and 4 have the best biased scores there
    bias = [0.0] * 6 + [0.5, 0.0]
    assert picks(LOGITS, MOE, bias) == normed((7, 4), 2.5)  # weights from the unbiased scores
    # a bias that lifts no expert past another changes nothing
    assert picks(LOGITS, MOE, [0.01] * 8) == normed((4, 2), 2.5)


def test_norm_topk_prob_and_the_scaling_factor() -> None:
    unnormed = dataclasses.replace(MOE, norm_topk_prob=False, routed_scaling_factor=1.0)
    s4, s2 = sigmoid(LOGITS[4], LOGITS[2])
    assert picks(LOGITS, unnormed) == {4: s4, 2: s2}
    scaled = dataclasses.replace(unnormed, routed_scaling_factor=2.0)
    assert picks(LOGITS, scaled) == {4: 2 * s4, 2: 2 * s2}  # times 2 is exact in floating point
    three = dataclasses.replace(MOE, num_experts_per_tok=3)
    assert sorted(picks(LOGITS, three)) == [2, 3, 4]  # from groups 1 and 2 only, never 0 or 7


def test_a_routing_that_cannot_pick_is_refused() -> None:
    with pytest.raises(ValueError, match="n_group: 3 does not divide n_routed_experts 8"):
        dataclasses.replace(MOE, n_group=3)
    with pytest.raises(ValueError, match="fewer than two per group"):
        dataclasses.replace(MOE, n_group=8, topk_group=2)
    with pytest.raises(ValueError, match="topk_group: 5 exceeds n_group 4"):
        dataclasses.replace(MOE, topk_group=5)
    with pytest.raises(ValueError, match="num_experts_per_tok: 5 exceeds the 4 experts of topk_group groups"):
        dataclasses.replace(MOE, num_experts_per_tok=5)


def modeling():  # type: ignore[no-untyped-def]
    """transformers' DeepSeek-V3 modeling, imported when a test needs it: seconds to import, and every test
    worker collects this module."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    return modeling_deepseek_v3


def hf_config(moe: MoEConfig, hidden_size: int = 32) -> transformers.DeepseekV3Config:
    import transformers

    return transformers.DeepseekV3Config(
        hidden_size=hidden_size, n_routed_experts=moe.n_routed_experts, moe_intermediate_size=moe.moe_intermediate_size,
        num_experts_per_tok=moe.num_experts_per_tok, n_shared_experts=moe.n_shared_experts, n_group=moe.n_group,
        topk_group=moe.topk_group, norm_topk_prob=moe.norm_topk_prob,
        routed_scaling_factor=moe.routed_scaling_factor)


ROUTINGS = {
    "v3-like": MOE,
    "one-group": dataclasses.replace(MOE, n_group=1, topk_group=1, num_experts_per_tok=3),
    "unnormed": dataclasses.replace(MOE, n_routed_experts=16, n_group=4, topk_group=3, num_experts_per_tok=4,
                                    norm_topk_prob=False, routed_scaling_factor=1.5),
}


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_the_routing_is_transformers_bit_for_bit(name: str) -> None:
    """2,048 tokens with random router weights and biases, plus tied scores: the same experts, the same bits."""
    moe = ROUTINGS[name]
    generator = torch.Generator().manual_seed(7)
    router = modeling().DeepseekV3TopkRouter(hf_config(moe))
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.e_score_correction_bias.copy_(torch.rand(moe.n_routed_experts, generator=generator) * 0.2)
        router.weight[1] = router.weight[0]  # experts 0 and 1 score the same
        router.e_score_correction_bias[1] = router.e_score_correction_bias[0]
        hidden = torch.randn(2048, 32, generator=generator)
        _, their_weights, their_ids = router(hidden)
        ours = route(torch.nn.functional.linear(hidden, router.weight), router.e_score_correction_bias, moe)
    order, their_order = ours.expert_ids.argsort(dim=-1), their_ids.argsort(dim=-1)
    assert torch.equal(ours.expert_ids.gather(1, order), their_ids.gather(1, their_order))
    assert torch.equal(ours.weights.gather(1, order), their_weights.gather(1, their_order))
    assert len(ours.expert_ids.unique()) == moe.n_routed_experts  # every expert picked by some token


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_the_moe_layer_equals_transformers(name: str) -> None:
    moe = dataclasses.replace(ROUTINGS[name], n_shared_experts=2)
    torch.manual_seed(3)
    theirs = modeling().DeepseekV3MoE(hf_config(moe)).eval()
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_(0, 0.3)
        theirs.gate.e_score_correction_bias.uniform_(-0.2, 0.2)
    size = moe.moe_intermediate_size
    experts = [SwiGLUMLP(gate_up[:size], gate_up[size:], down)
               for gate_up, down in zip(theirs.experts.gate_up_proj.detach(), theirs.experts.down_proj.detach())]
    shared = theirs.shared_experts
    ours = MoE(moe, theirs.gate.weight.detach(), theirs.gate.e_score_correction_bias,
               experts, SwiGLUMLP(shared.gate_proj.weight.detach(), shared.up_proj.weight.detach(),
                                  shared.down_proj.weight.detach()))
    hidden = torch.randn(300, 32, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        out = ours.forward(hidden)
        assert max_abs_diff(out, theirs(hidden.unsqueeze(0))[0]) < 1e-5
        # a token's output is its own: alone, it gets the same
        assert max_abs_diff(torch.cat([ours.forward(hidden[i:i + 1]) for i in range(0, 300, 37)]), out[::37]) < 1e-5
