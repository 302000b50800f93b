"""Seeded test inputs: token ids, scrambled block tables, and a diff metric."""

from __future__ import annotations

import torch

from kvpool.model import ModelConfig


def random_token_ids(config: ModelConfig, n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (n,), generator=generator)


def scrambled_block_table(num_blocks: int, seed: int = 1) -> list[int]:
    """All block ids in a seeded random order: a sequence spread over any pages."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())
