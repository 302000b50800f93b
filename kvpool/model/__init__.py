"""DeepSeek-style MLA decoder over a paged KV cache, runnable as pipeline stages.

Public API: configs (`ModelConfig`, `get_config`), weights (`init_weights`,
`save_weights`, `load_weights`), the paged cache (`allocate_kv_cache`,
`token_slots`, `pack_kv`, `unpack_kv`, `kv_chunk_nbytes`), `ModelStage`,
`split_layers`, and the in-process `InProcessPipeline`.

Names load lazily: ``kvpool.model.config`` (shapes, dtype sizes, layer splits)
needs no torch, so a process that only reads settings — a master, a store, the
command line — starts without importing it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "CONFIGS": "config", "ModelConfig": "config", "get_config": "config", "split_layers": "config",
    "KV_DTYPE_ITEMSIZES": "config",
    "KV_DTYPES": "kv_cache", "allocate_kv_cache": "kv_cache", "kv_chunk_nbytes": "kv_cache", "kv_dtype": "kv_cache",
    "pack_kv": "kv_cache", "token_slots": "kv_cache", "unpack_kv": "kv_cache",
    "InProcessPipeline": "pipeline",
    "ModelStage": "stage",
    "init_weights": "weights", "load_weights": "weights", "save_weights": "weights", "weight_shapes": "weights",
}

__all__ = [
    "CONFIGS",
    "KV_DTYPES",
    "KV_DTYPE_ITEMSIZES",
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


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvpool.model.{module}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # for type checkers and readers: the same names, eagerly
    from kvpool.model.config import (
        CONFIGS,
        KV_DTYPE_ITEMSIZES,
        ModelConfig,
        get_config,
        split_layers,
    )
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
    from kvpool.model.stage import ModelStage
    from kvpool.model.weights import (
        init_weights,
        load_weights,
        save_weights,
        weight_shapes,
    )
