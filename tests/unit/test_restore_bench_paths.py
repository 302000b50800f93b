"""``kvpool bench restore``: the stages' bytes per path, the engine run's check, and the same-host ratio."""

from __future__ import annotations

import pytest

from kvpool.tools.bench import restore_bench


def figures(gbps: float, by_path: dict[str, float]) -> dict[str, object]:
    """One size's figures on one path, as ``_measure_size`` reports them (the keys ``_summary`` reads)."""
    return {"history_tokens": 4096, "restore_gbps_aggregate": gbps, "te_raw_gbps_aggregate": 1.5,
            "read_ms_p50": 10.0, "bytes_verified": 100, "te_raw_verified_bytes": 50,
            "pool_bytes_by_path": by_path, "memory_read_share": restore_bench.memory_read_share(by_path)}


def test_the_stages_metrics_are_summed_per_path() -> None:
    name = restore_bench.POOL_BYTES
    stage0 = {f'{name}{{direction="read",path="memory"}}': 30.0, f'{name}{{direction="read",path="engine"}}': 0.0,
              "kvpool_prefill_saved_bytes_total": 99.0}
    stage1 = {f'{name}{{direction="read",path="memory"}}': 10.0, f'{name}{{direction="write",path="engine"}}': 4.0}
    assert restore_bench.pool_bytes_by_path([stage0, stage1]) == {"memory_read": 40.0, "engine_read": 0.0,
                                                                  "engine_write": 4.0}


def test_the_engine_run_may_read_nothing_by_memory() -> None:
    assert restore_bench.memory_read_share({"memory_read": 30.0, "engine_read": 10.0}) == 0.75
    assert restore_bench.memory_read_share({"memory_write": 3.0}) is None
    restore_bench.check_path("engine", {"engine_read": 10.0, "memory_write": 0.0})
    restore_bench.check_path("auto", {"memory_read": 1.0, "engine_read": 3.0})  # reported, not voided
    with pytest.raises(RuntimeError, match="--pool-path engine"):
        restore_bench.check_path("engine", {"engine_read": 10.0, "memory_read": 1.0})
    with pytest.raises(RuntimeError, match="--pool-path auto"):
        restore_bench.check_path("auto", {})  # the stages read nothing from the pool


def test_same_host_over_engine_is_the_ratio_of_the_aggregates() -> None:
    auto = figures(6.0, {"memory_read": 3.0, "engine_read": 1.0})
    engine = figures(2.0, {"engine_read": 4.0})
    summary = restore_bench._summary([auto | {"engine": engine}])
    assert summary["same_host_over_engine"] == 3.0
    assert summary["engine_restore_gbps_aggregate"] == 2.0
    assert summary["same_host_read_share"] == 0.75
    assert summary["bytes_verified"] == 300  # both paths' restores and raw reads
    assert "WARNING" in restore_bench.format_report(summary | {"sizes": []})
