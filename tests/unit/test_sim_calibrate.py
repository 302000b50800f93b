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

    windows = [{"t": t, "pool_share": 0.1 * k, "reuse": 0.95, "prompt_tokens": 100.0, "tokens_done": 2_400_000.0 * k}
               for k, t in enumerate((0.0, 300.0, 600.0, 900.0))]
    got = counted_windows(windows, warmup=300.0, duration=1100.0, window_s=300.0, gpus=8)
    assert got == [{"t": 300.0, "pool_share": 0.1, "reuse": 0.95, "prompt_tokens": 100.0, "throughput_per_gpu": 1000.0},
                   {"t": 600.0, "pool_share": 0.2, "reuse": 0.95, "prompt_tokens": 100.0, "throughput_per_gpu": 2000.0}]


def test_the_settling_rule_compares_the_pool_share_of_the_counted_spans_two_halves() -> None:
    from kvpool.tools.sim.metrics import SETTLE_MIN_S, settling

    def windows(shares: list[float], tokens: float = 100.0) -> list[dict[str, float]]:
        return [{"t": 300.0 * k, "pool_share": share, "prompt_tokens": tokens} for k, share in enumerate(shares)]

    # a warm-up window, then 12 counted ones: the share climbs by 8 points over the first half
    climbing = settling(windows([0.1] + [0.30, 0.32, 0.34, 0.36, 0.38, 0.40] + [0.42] * 6), 300.0, 3900.0, 300.0)
    assert climbing["steady"] is False and climbing["moved"] == pytest.approx(0.42 - 0.35)
    flat = settling(windows([0.1] + [0.40, 0.44, 0.38, 0.42, 0.41, 0.43, 0.39, 0.45, 0.40, 0.42, 0.41, 0.44]),
                    300.0, 3900.0, 300.0)
    assert flat["steady"] is True and flat["counted_s"] == 3600.0 and flat["windows"] == 12
    # the halves weigh each window by its prompt tokens
    weighted = settling([{"t": 0.0, "pool_share": 0.2, "prompt_tokens": 300.0},
                         {"t": 300.0, "pool_share": 0.6, "prompt_tokens": 100.0},
                         {"t": 600.0, "pool_share": 0.3, "prompt_tokens": 400.0},
                         {"t": 900.0, "pool_share": 0.3, "prompt_tokens": 400.0}], 0.0, 1200.0, 300.0)
    assert weighted["pool_share_first_half"] == pytest.approx(0.3) and weighted["steady"] is True
    # as flat, but 900 s counted: too short to be told steady
    short = settling(windows([0.1, 0.4, 0.4, 0.4]), 300.0, 1200.0, 300.0)
    assert short["counted_s"] == 900.0 < SETTLE_MIN_S and short["steady"] is False
    # a window the run did not finish is not counted
    assert settling(windows([0.1, 0.4, 0.4, 0.4, 0.4, 0.9]), 300.0, 1600.0, 300.0)["windows"] == 4


def test_a_calibration_shorter_than_the_settling_rule_is_refused_before_it_runs(
        capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from kvpool.tools.sim.calibrate_cmd import counted_span
    from kvpool.tools.sim.cli import add_simulate_parser, main as simulate

    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--calibrate", "--duration", "900"])
    assert simulate(args) == 2
    assert "--duration: 900 s counted is shorter than the settling rule's 1200 s" in capsys.readouterr().err
    # --quick counts the rule's shortest span; the warm-up is past the pool share's climb unless given
    assert counted_span(parser.parse_args(["simulate", "--calibrate", "--quick"])) == (1500.0, 1200.0)
    assert counted_span(parser.parse_args(["simulate", "--calibrate", "--warmup", "300"])) == (300.0, 3600.0)


def test_the_fit_sees_only_the_fitted_figures_and_names_each_input_with_its_figure() -> None:
    from kvpool.tools.sim.calibrate import FITTED, fit_view, fitted_rows

    view = fit_view(run())
    assert set(view) == {"throughput_per_gpu", "pool_share", "decode_kv_reserved_p50", "ttft_p50_s",
                         "prefill_busy", "ttft_mean_s", "think_mean_s"}
    assert not {"restore_p50_ms", "stage_spread_mean_s", "reuse_ratio", "trace_bound"} & set(view)
    rows = fitted_rows(FitInputs(device_kv_gib_per_gpu=42.0), run())
    assert len(rows) == len(FITTED) <= 4
    assert rows[0] == {"input": "[fit] device_kv_gib_per_gpu", "value": 42.0, "fitted_to": "pool_share",
                       "name": "pool share", "figure": 0.46, "target": "46% ± 8 points", "within": True}
    # a check out of range or a run not steady: not calibrated, whatever the fitted figures say
    assert verdict(run(steady=False), run())["calibrated"] is False
    assert verdict(run(steady=True), run(steady=True, ttft_p50_s=5.0))["calibrated"] is True
