"""The simulator's run matrix and its final JSON object, from hand-built run figures (no simulation)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.tools.sim.report import STRICT_KEYS, final_object, matrix
from kvpool.tools.sim.topology import AFFINITY_STRICT


def test_the_scale_out_has_strict_twins_shared_and_split_without_a_failure() -> None:
    specs = {s.label: s for s in matrix(900.0, 600.0, quick=False)}
    for servers in (8, 16, 32):
        shared, split = specs[f"scale-{servers}-strict"], specs[f"scale-{servers}-split-strict"]
        assert (shared.servers, shared.sessions_per_server, shared.pool, shared.affinity, shared.fail_at_s,
                shared.duration_s) == (servers, 112, "shared", AFFINITY_STRICT, None, 600.0)
        assert (split.servers, split.sessions_per_server, split.pool, split.affinity, split.fail_at_s,
                split.duration_s) == (servers, 112, "split", AFFINITY_STRICT, None, 600.0)
        # the default-threshold rows keep the run settings' threshold
        assert [specs[f"scale-{servers}{suffix}"].affinity for suffix in ("", "-nofail", "-split")] == [None] * 3
    assert [s.label for s in matrix(900.0, 600.0, quick=False, scale_sessions=28) if s.label.endswith("strict")
            and s.label.startswith("scale-")] == ["scale-8-strict", "scale-8-split-strict", "scale-16-strict",
                                                   "scale-16-split-strict", "scale-32-strict", "scale-32-split-strict"]


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
