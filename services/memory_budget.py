"""What ``kvpool up`` will allocate, by role, from the settings each child reads: the start banner's budget.

It reads every role's own settings class (their ``memory()``), so the figures
are the ones each service checks against the host before it allocates.
"""

from __future__ import annotations

from typing import Any

from kvpool.settings import load_settings, read_config
from kvpool.services.decode.settings import DecodeSettings
from kvpool.services.prefill.settings import PrefillSettings
from kvpool.services.store.settings import StoreSettings


def memory_budget(settings: Any, config: str | None) -> dict[str, int]:
    """What every service will allocate, by role, from the same settings each child reads (its ``[<role>]``
    table, then the flags ``up`` gives it)."""
    s = settings
    handed = s.handed(read_config(config) if config else {})  # what up puts on each child's command line
    model = {"model": s.model, "model_dir": s.model_dir, "kv_dtype": s.kv_dtype}
    budget: dict[str, int] = {}
    if s.pool:
        store = load_settings(StoreSettings, "store", config, handed["store"])
        budget["pool segments"] = s.stores * sum(store.memory().values())
    prefill: dict[str, int] = {}
    for stage in range(s.stages):
        stage_settings = load_settings(PrefillSettings, "prefill", config, {
            **model, **handed["prefill"], "stage": stage, "num_stages": s.stages,
            "stage_addresses": ["later-stage"] * (s.stages - 1), "next_stage": "next-stage"})
        for name, num_bytes in _by_kind(stage_settings.memory(), "device caches").items():
            prefill[name] = prefill.get(name, 0) + s.pipelines * num_bytes
    budget.update({f"prefill {name}": num_bytes for name, num_bytes in prefill.items()})
    decode = load_settings(DecodeSettings, "decode", config, {**model, **handed["decode"]})
    for name, num_bytes in _by_kind(decode.memory(), "pages and arenas").items():
        budget[f"decode {name}"] = s.decode_shards * num_bytes
    return budget


def _by_kind(memory: dict[str, int], rest: str) -> dict[str, int]:
    """A service's memory as its weights (every stage or shard holds its own copy) and the rest."""
    weights = sum(n for name, n in memory.items() if name.endswith(" weights"))
    return {rest: sum(memory.values()) - weights, "weights": weights}
