from __future__ import annotations

import pytest
import torch

from kvpool.model import ModelConfig, get_config, init_weights

# the budget (whole dir < 60 s) is for one core; pin it so timings are comparable
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny() -> ModelConfig:
    return get_config("tiny")


@pytest.fixture(scope="session")
def tiny_weights(tiny: ModelConfig) -> dict[str, torch.Tensor]:
    return init_weights(tiny)
