"""DeepSeek-style MLA decoder over a paged KV cache, runnable as pipeline stages.

Public API: configs (`ModelConfig`, `get_config`), weights (`init_weights`,
`save_weights`, `load_weights`), the paged cache (`allocate_kv_cache`,
`token_slots`, `pack_kv`, `unpack_kv`, `kv_chunk_nbytes`), `ModelStage`,
`split_layers`, and the in-process `InProcessPipeline`.
"""

from __future__ import annotations

from kvpool.model.config import CONFIGS, ModelConfig, get_config
from kvpool.model.kv_cache import (
    KV_DTYPES,
    allocate_kv_cache,
    kv_chunk_nbytes,
    kv_dtype,
    pack_kv,
    token_slots,
    unpack_kv,
)
from kvpool.model.pipeline import InProcessPipeline
from kvpool.model.stage import ModelStage, split_layers
from kvpool.model.weights import init_weights, load_weights, save_weights, weight_shapes

__all__ = [
    "CONFIGS",
    "KV_DTYPES",
    "InProcessPipeline",
    "ModelConfig",
    "ModelStage",
    "allocate_kv_cache",
    "get_config",
    "init_weights",
    "kv_chunk_nbytes",
    "kv_dtype",
    "load_weights",
    "pack_kv",
    "save_weights",
    "split_layers",
    "token_slots",
    "unpack_kv",
    "weight_shapes",
]
