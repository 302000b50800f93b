"""The simulator's run matrix and its final JSON object, from hand-built run figures (no simulation)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.tools.sim.report import STRICT_KEYS, final_object, matrix
from kvpool.tools.sim.topology import AFFINITY_STRICT


def test_the_scale_out_has_strict_twins_shared_and_split_without_a_failure() -> None:
    specs = {s.label: s for s in matrix(900.0, 2700.0, quick=False, scale_warmup_s=1500.0)}
    for servers in (8, 16, 32, 64):
        shared, split = specs[f"scale-{servers}-strict"], specs[f"scale-{servers}-split-strict"]
        assert (shared.servers, shared.sessions_per_server, shared.pool, shared.affinity, shared.fail_at_s,
                shared.duration_s, shared.warmup_s) == (servers, 112, "shared", AFFINITY_STRICT, None, 2700.0, 1500.0)
        assert (split.servers, split.sessions_per_server, split.pool, split.affinity, split.fail_at_s,
                split.duration_s) == (servers, 112, "split", AFFINITY_STRICT, None, 2700.0)
        # the default-threshold rows keep the run settings' threshold
        assert [specs[f"scale-{servers}{suffix}"].affinity for suffix in ("", "-nofail", "-split")] == [None] * 3
    assert [s.label for s in matrix(900.0, 600.0, quick=False, scale_sessions=28) if s.label.endswith("strict")
            and s.label.startswith("scale-")] == ["scale-8-strict", "scale-8-split-strict", "scale-16-strict",
                                                   "scale-16-split-strict", "scale-32-strict", "scale-32-split-strict",
                                                   "scale-64-strict", "scale-64-split-strict"]


def run(label: str, servers: int, pool: str, throughput: float, **figures: Any) -> dict[str, Any]:
    base = dict.fromkeys(STRICT_KEYS, 0.0)
    return {**base, "label": label, "servers": servers, "pool": pool, "duration_s": 600.0, "sim_speed": 2.0,
            "throughput_per_gpu": throughput, **figures}


def test_the_scale_out_row_has_shared_over_split_at_strict_affinity() -> None:
    results = [run("scale-8-strict", 8, "shared", 30_000.0, master_utilization=0.5, ttft_p99_s=40.0),
               run("scale-8-split-strict", 8, "split", 40_000.0, master_utilization=0.125, ttft_p99_s=20.0),
               run("scale-16-strict", 16, "shared", 10_000.0)]  # no split twin: no strict figures at 16
    out = final_object(results, wall_s=900.0)
    assert list(out["scale_out"]) == ["8"]
    strict = out["scale_out"]["8"]["strict"]
    assert strict["shared_over_split"] == pytest.approx(0.75)
    assert (strict["throughput_per_gpu"], strict["split_throughput_per_gpu"]) == (30_000.0, 40_000.0)
    assert (strict["master_utilization"], strict["split_master_utilization"]) == (0.5, 0.125)
    assert (strict["ttft_p99_s"], strict["split_ttft_p99_s"]) == (40.0, 20.0)
    assert out["shared_over_split"] == {} and out["sim_speed"] == pytest.approx(1800.0 / 900.0)


def scaled(label: str, servers: int, pool: str, throughput: float, **figures: Any) -> dict[str, Any]:
    from kvpool.tools.sim.report import SCALE_KEYS

    base = {**dict.fromkeys(SCALE_KEYS, 0.0), "masters": 1 if pool == "shared" else servers, "sessions_per_server": 112,
            "prefill_busy": 0.9, "steady": True, "warmup_s": 1500.0, "dropped_objects": 0, "windows": []}
    return {**run(label, servers, pool, throughput), **base, "duration_s": 2700.0, "throughput_per_gpu": throughput,
            **figures}


def test_the_scale_out_row_names_both_baselines_its_steadiness_and_what_limits_it_first() -> None:
    results = [scaled("scale-64-nofail", 64, "shared", 30_000.0, master_utilization=0.97, nic_use_peak=0.2),
               scaled("scale-64-split", 64, "split", 10_000.0, master_utilization=0.1),
               scaled("scale-64-split-strict", 64, "split", 40_000.0, steady=False),
               scaled("scale-8-nofail", 8, "shared", 40_000.0, master_utilization=0.2, nic_use_peak=0.3)]
    out = final_object(results, wall_s=10.0)["scale_out"]
    row = out["64"]
    assert (row["servers"], row["shards"], row["master_busy"], row["prefill_busy"], row["nic_busy"]) == (
        64, 1, 0.97, 0.9, 0.2)
    assert row["shared_over_split_moving"] == pytest.approx(3.0)
    assert row["shared_over_split_strict"] == pytest.approx(0.75)
    assert row["limit"] == "master_busy"
    # one baseline not settled: the size is not steady
    assert row["steady"] is False and row["steady_runs"] == {"shared": True, "split": True, "split_strict": False}
    # without its baselines a size reports what it has: no ratio, not steady; prefill the limit
    eight = out["8"]
    assert eight["shared_over_split_strict"] is None and eight["steady"] is False and eight["limit"] == "prefill_busy"


def test_the_capacity_rows_compare_shared_with_both_split_baselines_and_say_whether_split_evicts() -> None:
    from kvpool.tools.sim.report import capacity_specs

    specs = capacity_specs((224,), 2700.0, 1500.0)
    assert [(s.label, s.pool, s.affinity, s.agent_prefix, s.max_context) for s in specs] == [
        ("capacity-224-shared", "shared", None, True, 1 << 20), ("capacity-224-split", "split", None, True, 1 << 20),
        ("capacity-224-split-strict", "split", AFFINITY_STRICT, True, 1 << 20)]
    figures = {"reuse_ratio": 0.9, "pool_share": 0.4, "device_share": 0.5, "ttft_p50_s": 9.0, "pool_use_p50": 0.5,
               "master_evictions_per_s": 0.0, "prefill_busy": 0.99, "master_utilization": 0.1,
               "decode_kv_reserved_p50": 0.9, "errors": 0, "turns_per_s": 3.0, "settling": {},
               "trace_policy": {"arrivals": 10}}
    results = [scaled("capacity-224-shared", 4, "shared", 40_000.0, **figures),
               scaled("capacity-224-split", 4, "split", 10_000.0, **figures),
               scaled("capacity-224-split-strict", 4, "split", 20_000.0, **{**figures, "master_evictions_per_s": 3.5})]
    row = final_object(results, wall_s=10.0)["capacity"]["224"]
    assert (row["shared_over_split_moving"], row["shared_over_split_strict"]) == (4.0, 2.0)
    assert row["split_evicts"] is True and row["steady"] is True
    assert row["split_strict"]["master_evictions_per_s"] == 3.5
