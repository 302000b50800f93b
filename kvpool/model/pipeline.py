"""The whole model in one process: its stages run back to back, each with its own cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.model.config import ModelConfig
from kvpool.model.kv_cache import BlockTable
from kvpool.model.sampling import greedy_token
from kvpool.model.stage import ModelStage, WeightSource


class InProcessPipeline:
    """Stages covering layers [0, num_hidden_layers) in order, for tests and demos.

    Invariants: `stages[i]` owns `kv_caches[i]` (same block_size and
    num_blocks everywhere), so one block table addresses a sequence in every
    stage. Stages are built independently, as on separate workers; seeded
    weights agree because each tensor is seeded by its name.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype = torch.float32,
        stage_bounds: Sequence[tuple[int, int]] | None = None,
        weights: WeightSource = None,
        device: torch.device | str = "cpu",
    ) -> None:
        bounds = list(stage_bounds) if stage_bounds is not None else [(0, config.num_hidden_layers)]
        expected_start = 0
        for start, end in bounds:
            if start != expected_start:
                raise ValueError(
                    f"stage_bounds must tile [0, {config.num_hidden_layers}) in order, got {bounds}"
                )
            expected_start = end
        if expected_start != config.num_hidden_layers:
            raise ValueError(f"stage_bounds must end at {config.num_hidden_layers}, got {bounds}")
        self.config = config
        self.stages = [ModelStage(config, start, end, weights, device) for start, end in bounds]
        self.kv_caches = [stage.allocate_kv_cache(num_blocks, block_size, kv_dtype) for stage in self.stages]

    def forward(
        self, token_ids: torch.Tensor, block_table: BlockTable, num_cached_tokens: int
    ) -> torch.Tensor:
        """Logits [n, vocab_size] for token_ids at positions from num_cached_tokens."""
        x = token_ids
        for stage, kv_cache in zip(self.stages, self.kv_caches):
            x = stage.forward(x, kv_cache, block_table, num_cached_tokens)
        return x

    __call__ = forward

    @torch.inference_mode()
    def generate_greedy(
        self,
        prompt_ids: torch.Tensor,
        block_table: BlockTable,
        num_new_tokens: int,
        num_cached_tokens: int = 0,
    ) -> list[int]:
        """Prefill prompt_ids[num_cached_tokens:], then decode num_new_tokens greedily."""
        logits = self.forward(prompt_ids[num_cached_tokens:], block_table, num_cached_tokens)
        position = prompt_ids.numel()
        tokens: list[int] = []
        for _ in range(num_new_tokens):
            token = greedy_token(logits[-1], self.config)
            tokens.append(token)
            if len(tokens) == num_new_tokens:
                break
            logits = self.forward(torch.tensor([token]), block_table, position)
            position += 1
        return tokens
