"""The calibration's bookkeeping: the verdict against the seed's figures, the bisection, the step's directions."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvpool.tools.sim.calibrate import KvBracket, next_fit, verdict
from kvpool.tools.sim.cost_model import CostModel, FitInputs


def run(**over: Any) -> dict[str, Any]:
    base = {"sessions": 112, "throughput_per_gpu": 44_000.0, "pool_share": 0.46, "decode_kv_reserved_p50": 0.91,
            "ttft_p50_s": 7.0, "ttft_mean_s": 8.4, "prefill_queue_mean": 12.0, "reuse_ratio": 0.951,
            "trace_bound": 0.953, "restore_p50_ms": 160.0, "stage_spread_mean_s": 0.5, "prefill_busy": 0.99,
            "think_mean_s": 4.76, "device_share": 0.49, "turns_per_s": 4.0}
    return base | over


def test_every_figure_within_is_calibrated_and_one_out_is_not() -> None:
    out = verdict(run(), run(ttft_p50_s=5.0))
    assert out["calibrated"] is True
    assert out["figures"]["throughput_per_gpu"] == {"name": "tokens/s per GPU", "value": 44_000.0,
                                                    "target": "44K ± 10%", "fitted": True, "within": True}
    assert out["figures"]["ttft_p50_s_96"]["within"] is True
    # 94.9% reuse is no fit (the seed: above 95%)
    assert verdict(run(reuse_ratio=0.949), None)["figures"]["reuse_ratio"]["within"] is False
    worse = verdict(run(), run(ttft_p50_s=7.5))
    assert worse["calibrated"] is False and worse["figures"]["ttft_p50_s_96"]["within"] is False
    assert verdict(run(restore_p50_ms=90.0), None)["figures"]["restore_p50_ms"]["within"] is False
    assert verdict(run(prefill_queue_mean=0.0), None)["calibrated"] is False


def test_the_kv_bracket_bisects_geometrically() -> None:
    bracket = KvBracket()
    assert bracket.next(50.0, 0.60) == pytest.approx(50.75)  # too much from the pool: more KV
    assert bracket.next(50.75, 0.20) == pytest.approx((50.0 * 50.75) ** 0.5)
    assert (bracket.low, bracket.high) == (50.0, 50.75)


def test_a_step_moves_each_input_the_way_its_figure_asks() -> None:
    fit = FitInputs(device_kv_gib_per_gpu=50.0, prefill_level=1.0, decode_level=1.0, think_scale=0.02)
    slow = next_fit(fit, run(throughput_per_gpu=40_000.0, pool_share=0.3, decode_kv_reserved_p50=0.8, ttft_mean_s=20.0,
                             ttft_p50_s=14.0), CostModel(), KvBracket())
    assert slow.prefill_level < 1.0  # saturated below 44K: a faster prefill
    assert slow.device_kv_gib_per_gpu < 50.0  # the pool serves too little: less device KV
    assert slow.think_scale > 0.02  # TTFT too long: more think time, less load
    # above 44K at 91%: prefill slows the rate to 44K, where fewer pages are held: less decode capacity (from
    # the prefill side's, none given); the decode step's level is not fitted
    fast = next_fit(fit, run(throughput_per_gpu=48_000.0), CostModel(), KvBracket())
    assert fast.prefill_level > 1.0 and fast.decode_kv_gib_per_gpu == pytest.approx(50.0 * (44 / 48) ** 0.6)
    assert fast.decode_level == 1.0
    # the shards full (the router's queue holds turns back): more decode capacity, damped
    full = next_fit(replace(fit, decode_kv_gib_per_gpu=80.0), run(decode_kv_reserved_p50=0.99), CostModel(),
                    KvBracket())
    assert full.decode_kv_gib_per_gpu == pytest.approx(80.0 * 1.25 ** 0.6)
    idle = next_fit(fit, run(prefill_busy=0.7, ttft_mean_s=1.0, ttft_p50_s=0.5), CostModel(), KvBracket())
    assert idle.prefill_level == 1.0 and idle.think_scale < 0.02  # not saturated: more load, same prefill


def test_the_check_reports_each_whole_window_after_the_warm_up() -> None:
    from kvpool.tools.sim.calibrate_cmd import counted_windows

    windows = [{"t": t, "pool_share": 0.1 * k, "reuse": 0.95, "tokens_done": 2_400_000.0 * k}
               for k, t in enumerate((0.0, 300.0, 600.0, 900.0))]
    got = counted_windows(windows, warmup=300.0, duration=1100.0, window_s=300.0, gpus=8)
    assert got == [{"t": 300.0, "pool_share": 0.1, "reuse": 0.95, "throughput_per_gpu": 1000.0},
                   {"t": 600.0, "pool_share": 0.2, "reuse": 0.95, "throughput_per_gpu": 2000.0}]
