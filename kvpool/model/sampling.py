"""Next-token sampling: greedy, temperature, top-k, top-p, reproducible per request.

A request's randomness is its own ``torch.Generator`` seeded once from the
request's seed, so the same request with the same logits draws the same
tokens whatever else shares its decode steps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kvpool.model.config import ModelConfig


@dataclass(slots=True)
class SamplingParams:
    """How one sequence picks its tokens.

    temperature 0 is greedy (argmax; ties to the lowest id); top_k 0 means
    all tokens; top_p 1 means no nucleus cut. Validated at the service edge.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(self.seed & (2**63 - 1))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: torch.Tensor, params: SamplingParams) -> int:
    """One token id from float32 logits [vocab_size]."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits.to(torch.float32) / params.temperature
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always the top token)
        keep = (torch.cumsum(sorted_probs, dim=0) - sorted_probs) < params.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=params.generator))


@functools.lru_cache(maxsize=8)
def _blocked(vocab_size: int, output_ids: tuple[int, int]) -> torch.Tensor:
    blocked = torch.ones(vocab_size, dtype=torch.bool)
    blocked[output_ids[0]:output_ids[1]] = False
    return blocked


def output_logits(logits: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Logits [..., vocab] as the sampler sees them: ids outside ``config.output_ids`` at -inf (a copy; the
    model's own logits are untouched). Unchanged when the config sets no range."""
    if config.output_ids is None:
        return logits
    return logits.masked_fill(_blocked(logits.shape[-1], config.output_ids), float("-inf"))


def greedy_token(logits: torch.Tensor, config: ModelConfig) -> int:
    """The greedy pick of the config's sampler from logits [vocab]."""
    return int(torch.argmax(output_logits(logits, config)))
