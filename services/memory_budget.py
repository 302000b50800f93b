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
    prefill = 0
    for stage in range(s.stages):
        stage_settings = load_settings(PrefillSettings, "prefill", config, {
            **model, **handed["prefill"], "stage": stage, "num_stages": s.stages,
            "stage_addresses": ["later-stage"] * (s.stages - 1), "next_stage": "next-stage"})
        prefill += sum(stage_settings.memory().values())
    budget["prefill device caches"] = s.pipelines * prefill
    decode = load_settings(DecodeSettings, "decode", config, {**model, **handed["decode"]})
    budget["decode pages and arenas"] = s.decode_shards * sum(decode.memory().values())
    return budget
